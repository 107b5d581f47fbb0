package limiter_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// queued returns a concurrency zone of limit slots whose requests wait up to a minute, in
// classes of the shares given (permille).
func queued(name string, limit int64, shares ...int) *limiter.Zone {
	z := cc(name, limit)
	z.MaxWait = time.Minute
	z.Classes = shares
	return z
}

// queueLimiters returns n Limiters on srv, each on a client of its own (as n instances are),
// each hearing its grants.
func queueLimiters(t *testing.T, srv *redistest.Server, n int) []*limiter.Limiter {
	t.Helper()
	var ls []*limiter.Limiter
	for range n {
		rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
		l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Subscriber: rdb})
		t.Cleanup(func() { _ = l.Close(); _ = rdb.Close() })
		ls = append(ls, l)
	}
	return ls
}

// ready waits up to 5 s for w's signal and fails t without it.
func ready(t *testing.T, w *limiter.Waiter, what string) {
	t.Helper()
	select {
	case <-w.Ready():
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: no grant within 5s", what)
	}
}

// notReady fails t when w has a signal now.
func notReady(t *testing.T, w *limiter.Waiter, what string) {
	t.Helper()
	select {
	case <-w.Ready():
		t.Fatalf("%s: granted, want waiting", what)
	default:
	}
}

// claimSlot decides req on l with w's claim, fails t unless it is admitted, and marks w
// Claimed; it returns the decision, which holds the slot.
func claimSlot(t *testing.T, l *limiter.Limiter, req limiter.Request, w *limiter.Waiter, what string) limiter.Decision {
	t.Helper()
	claim := req
	claim.Claim(w)
	d := allow(t, l, claim)
	if !d.Allowed || d.Held == nil {
		t.Fatalf("%s's claim: %+v, want admitted", what, d)
	}
	l.Claimed(w)
	return d
}

// TestQueueGrantsInArrivalOrderAcrossInstances: limit 1 held on instance 0; waiters enter on
// instances 1, 2, 1, 2 in turn; each slot given back goes to the earliest waiter, on whichever
// instance it waits, and a request decided afresh while they wait is denied (it does not
// overtake them) even when a slot is free. A claim takes the reserved slot (a Leave after it
// sends nothing); its settlement hands the slot on.
func TestQueueGrantsInArrivalOrderAcrossInstances(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls := queueLimiters(t, srv, 3)
	z := queued("q", 1)
	req := limiter.Request{Zone: z, Key: "site", Cost: 1, Hold: time.Minute}
	first := allow(t, ls[0], req)
	if !first.Allowed {
		t.Fatalf("first request: %+v", first)
	}
	if d := allow(t, ls[0], req); d.Allowed {
		t.Fatalf("second request admitted with the slot taken: %+v", d)
	}
	var ws []*limiter.Waiter
	for i := range 4 {
		w, err := ls[1+i%2].Enqueue(context.Background(), req, 0)
		if err != nil {
			t.Fatal(err)
		}
		if w.Ahead != int64(i) {
			t.Fatalf("waiter %d: %d ahead, want %d", i, w.Ahead, i)
		}
		ws = append(ws, w)
	}
	prev := first
	for i, w := range ws {
		for _, later := range ws[i:] {
			notReady(t, later, "before the slot is given back")
		}
		settleAll(t, ls[0], prev) // the holder's instance gives the slot back
		if i == 0 {
			settleAll(t, ls[0], limiter.Decision{}) // nothing to settle: no effect
		}
		ready(t, w, "the earliest waiter")
		if d := allow(t, ls[0], req); d.Allowed {
			t.Fatalf("a newcomer took the slot reserved for waiter %d: %+v", i, d)
		}
		inst := ls[1+i%2]
		d := claimSlot(t, inst, req, w, "waiter "+strconv.Itoa(i))
		calls := srv.ScriptCalls()
		if err := inst.Leave(context.Background(), w); err != nil || srv.ScriptCalls() != calls {
			t.Fatalf("Leave after the claim: %v, %d script calls; want none", err, srv.ScriptCalls()-calls)
		}
		ls[0], ls[1+i%2] = inst, ls[0] // its instance now holds the slot
		prev = d
	}
	settleAll(t, ls[0], prev)
	if d := allow(t, ls[1], req); !d.Allowed {
		t.Fatalf("with no waiter left, a request: %+v, want admitted", d)
	}
}

// TestQueuePriorityWithShare: limit 1, class 0 (interactive) and class 1 (batch, share 20%):
// with 10 batch waiters and then 10 interactive ones, the 20 grants go interactive first,
// except that batch gets every fifth (floor(0.2 × n) of the first n grants it waits through),
// and within a class in arrival order.
func TestQueuePriorityWithShare(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := queueLimiters(t, srv, 1)[0]
	z := queued("q", 1, 0, 200)
	req := limiter.Request{Zone: z, Key: "site", Cost: 1, Hold: time.Minute}
	held := allow(t, l, req)
	type waiter struct {
		w     *limiter.Waiter
		class int
		n     int
	}
	var ws []waiter
	for i := range 20 {
		r := req
		r.Class = 1 - i/10 // 10 batch, then 10 interactive
		w, err := l.Enqueue(context.Background(), r, 0)
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, waiter{w, r.Class, i % 10})
	}
	var order []string
	for range 20 {
		settleAll(t, l, held)
		got := &ws[nextGrant(t, ws, func(w waiter) *limiter.Waiter { return w.w })]
		order = append(order, []string{"i", "b"}[got.class]+string(rune('0'+got.n)))
		held = claimSlot(t, l, req, got.w, order[len(order)-1])
	}
	want := []string{"i0", "i1", "i2", "i3", "b0", "i4", "i5", "i6", "i7", "b1", "i8", "i9", "b2", "b3", "b4", "b5", "b6", "b7", "b8", "b9"}
	if len(order) != len(want) {
		t.Fatalf("order %v, want %v", order, want)
	}
	for k := range want {
		if order[k] != want[k] {
			t.Fatalf("order %v, want %v", order, want)
		}
	}
}

// TestQueueLeaveHandsOn: a waiter that leaves is out of the queue (the next is granted the
// slot), and one that leaves holding a reserved slot hands it to the next at once.
func TestQueueLeaveHandsOn(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := queueLimiters(t, srv, 1)[0]
	z := queued("q", 1)
	req := limiter.Request{Zone: z, Key: "site", Cost: 1, Hold: time.Minute}
	held := allow(t, l, req)
	var ws []*limiter.Waiter
	for range 3 {
		w, err := l.Enqueue(context.Background(), req, 0)
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, w)
	}
	if err := l.Leave(context.Background(), ws[0]); err != nil {
		t.Fatal(err)
	}
	settleAll(t, l, held)
	ready(t, ws[1], "the second waiter, the first having left")
	notReady(t, ws[2], "the third")
	if err := l.Leave(context.Background(), ws[1]); err != nil { // leaves holding the reservation
		t.Fatal(err)
	}
	ready(t, ws[2], "the third, the second having left with the slot")
	if l.Waiting() != 1 {
		t.Fatalf("%d waiting, want 1", l.Waiting())
	}
}

// TestQueueLapsedWaiterDropped: the waiters of an instance that stops renewing them (it died)
// are dropped once their lease ends, and the slot goes to a live instance's waiter behind them.
func TestQueueLapsedWaiterDropped(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls := queueLimiters(t, srv, 2)
	z := queued("q", 1)
	req := limiter.Request{Zone: z, Key: "site", Cost: 1, Hold: time.Minute}
	held := allow(t, ls[1], req)
	if _, err := ls[0].Enqueue(context.Background(), req, 0); err != nil {
		t.Fatal(err)
	}
	live, err := ls[1].Enqueue(context.Background(), req, 0)
	if err != nil {
		t.Fatal(err)
	}
	_ = ls[0].Close() // instance 0 "dies": its waiter is no longer renewed
	start := time.Now()
	settleAll(t, ls[1], held) // the slot goes to instance 0's waiter, never claimed
	// Instance 1's keeper renews its waiter every second, and so learns of its grant.
	select {
	case <-live.Ready():
	case <-time.After(10 * time.Second):
		t.Fatal("the live waiter was not granted within 10s")
	}
	if live.Gone() {
		t.Fatal("the live waiter was dropped, want granted")
	}
	if took := time.Since(start); took < limiter.QueueClaim-100*time.Millisecond {
		t.Fatalf("granted after %v: before the dead waiter's reservation (%v) lapsed", took, limiter.QueueClaim)
	}
}

// TestQueueDeadInstanceWaiterDropped: a waiter of an instance that stops renewing it (it died)
// is dropped from the queue once its lease (QueueLease) ends, by the next call of a live
// instance, so that the slot freed after that goes straight to the live instance's waiter
// behind it, with no reservation left to lapse first.
func TestQueueDeadInstanceWaiterDropped(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls := queueLimiters(t, srv, 2)
	z := queued("q", 1)
	req := limiter.Request{Zone: z, Key: "site", Cost: 1, Hold: time.Minute}
	held := allow(t, ls[1], req)
	if _, err := ls[0].Enqueue(context.Background(), req, 0); err != nil {
		t.Fatal(err)
	}
	_ = ls[0].Close() // instance 0 "dies": its waiter is no longer renewed
	live, err := ls[1].Enqueue(context.Background(), req, 0)
	if err != nil || live.Ahead != 1 {
		t.Fatalf("the live waiter: %+v, %v; want 1 ahead", live, err)
	}
	waiters := limiter.StateKey("rl:", z, "site") + ":ql"
	start := time.Now()
	redistest.WaitFor(t, limiter.QueueLease+5*time.Second, "the dead instance's waiter dropped", func() bool {
		n, _ := srv.Do("ZCARD", waiters).(int64)
		return n == 1
	})
	if took := time.Since(start); took < limiter.QueueLease-200*time.Millisecond {
		t.Fatalf("dropped after %v, before its lease of %v ended", took, limiter.QueueLease)
	}
	settleAll(t, ls[1], held)
	select { // at once: not after a reservation for the dead waiter lapsed (QueueClaim)
	case <-live.Ready():
	case <-time.After(time.Second):
		t.Fatal("the live waiter was not granted the slot at once")
	}
}

// TestQueueWaiterAfterTheLastLeft: a Limiter whose grant listener and renewals stopped (Close)
// once its last waiter left, as a reloaded handler's did, still hears and renews a waiter that
// enters after: the waiter's lease is renewed past its first end, and it is granted the slot
// when the slot comes back.
func TestQueueWaiterAfterTheLastLeft(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls := queueLimiters(t, srv, 2)
	z := queued("q", 1)
	req := limiter.Request{Zone: z, Key: "site", Cost: 1, Hold: time.Minute}
	held := allow(t, ls[1], req)
	first, err := ls[0].Enqueue(context.Background(), req, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := ls[0].Leave(context.Background(), first); err != nil || ls[0].Waiting() != 0 {
		t.Fatalf("the first waiter's Leave: %v, %d waiting; want none", err, ls[0].Waiting())
	}
	_ = ls[0].Close()
	w, err := ls[0].Enqueue(context.Background(), req, 0)
	if err != nil {
		t.Fatal(err)
	}
	waiters := limiter.StateKey("rl:", z, "site") + ":ql"
	rdb := srv.Client()
	lease := func() int64 { // the waiter's lease end (µs), 0 when it is not in the queue
		m, _ := rdb.ZRangeWithScores(context.Background(), waiters, 0, -1).Result()
		if len(m) != 1 {
			return 0
		}
		return int64(m[0].Score)
	}
	firstEnd := lease()
	if firstEnd == 0 {
		t.Fatal("the waiter is not in the queue")
	}
	redistest.WaitFor(t, limiter.QueueLease+3*time.Second, "the waiter's lease renewed past its first end", func() bool {
		now := srv.Time().UnixMicro()
		return now > firstEnd && lease() > now
	})
	settleAll(t, ls[1], held)
	ready(t, w, "the waiter, once the slot came back")
	if w.Gone() {
		t.Fatal("the waiter was dropped, want granted")
	}
	settleAll(t, ls[0], claimSlot(t, ls[0], req, w, "the waiter"))
}

// TestQueueKeeperEndsWithTheLastWaiter: a Limiter's subscription to its grants lasts while it
// has waiters, and ends within two renewal periods of its last waiter leaving.
func TestQueueKeeperEndsWithTheLastWaiter(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := queueLimiters(t, srv, 1)[0]
	z := queued("q", 1)
	req := limiter.Request{Zone: z, Key: "site", Cost: 1, Hold: time.Minute}
	held := allow(t, l, req)
	subscribed := func() int {
		v, _ := srv.Do("PUBSUB", "CHANNELS", "rl:queue:*").([]any)
		return len(v)
	}
	w, err := l.Enqueue(context.Background(), req, 0)
	if err != nil {
		t.Fatal(err)
	}
	if n := subscribed(); n != 1 {
		t.Fatalf("%d grant channels subscribed with a waiter, want 1", n)
	}
	if err := l.Leave(context.Background(), w); err != nil {
		t.Fatal(err)
	}
	redistest.WaitFor(t, 2*limiter.QueueRefreshEvery+time.Second, "the grant channel unsubscribed", func() bool { return subscribed() == 0 })
	settleAll(t, l, held)
}
