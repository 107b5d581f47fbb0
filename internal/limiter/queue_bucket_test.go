package limiter_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// queuedBucket returns a token bucket zone of capacity tokens refilled at rate tokens/s whose
// requests wait up to a minute in its queue, in classes of the shares given (permille).
func queuedBucket(name string, capacity int64, rate float64, shares ...int) *limiter.Zone {
	z := tb(name, capacity, rate)
	z.MaxWait = time.Minute
	z.Classes = shares
	return z
}

// grants subscribes to every instance's grants on srv and returns the ids granted, in the order
// queue.lua published them, as they come.
func grants(t *testing.T, srv *redistest.Server) <-chan string {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	ps := rdb.PSubscribe(context.Background(), "rl:queue:*")
	if _, err := ps.Receive(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ps.Close(); _ = rdb.Close() })
	out := make(chan string, 100)
	go func() {
		for m := range ps.Channel() {
			out <- m.Payload
		}
	}()
	return out
}

// fakeClock is a clock the test moves: the scripts' and the Limiters' (Options.Now). Redis's key
// TTLs still run on its own clock: the tests' buckets are emptied of a large capacity, so that
// their state lives seconds (the used tokens' drain time) whatever the test's clock says.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// clockLimiters returns n Limiters on srv, as queueLimiters does, all on one fakeClock.
func clockLimiters(t *testing.T, srv *redistest.Server, n int) ([]*limiter.Limiter, *fakeClock) {
	t.Helper()
	clock := &fakeClock{t: time.Now()}
	var ls []*limiter.Limiter
	for range n {
		rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
		l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Subscriber: rdb, Now: clock.now})
		t.Cleanup(func() { _ = l.Close(); _ = rdb.Close() })
		ls = append(ls, l)
	}
	return ls, clock
}

// TestQueueTokenBucketPriorityAcrossInstances: three instances on one clock the test moves; a
// token bucket of 100 tokens refilled at 20/s with classes interactive and batch (20% share),
// emptied; 10 batch waiters, then 10 interactive ones, enter on the instances in turn. A request
// decided afresh once a token has refilled is denied: it does not overtake the waiters. Then,
// moved on one token's refill at a time, the queue grants exactly one waiter per token, in the
// order queue.lua publishes them: interactive waiters first but for the batch class's share,
// each class in arrival order; and every claim is admitted.
func TestQueueTokenBucketPriorityAcrossInstances(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls, clock := clockLimiters(t, srv, 3)
	published := grants(t, srv)
	z := queuedBucket("qb", 100, 20, 0, 200)
	req := limiter.Request{Zone: z, Key: "site", Cost: 1}
	if d := allow(t, ls[0], limiter.Request{Zone: z, Key: "site", Cost: 100}); !d.Allowed {
		t.Fatalf("first request: %+v", d)
	}
	name := map[string]string{} // waiter id -> "i3", "b0"...
	claimed := make(chan string, 20)
	var claims sync.WaitGroup
	t.Cleanup(claims.Wait) // before the Limiters close: no claim outlives the test
	for i := range 20 {
		r := req
		r.Class = 1 - i/10 // 10 batch, then 10 interactive
		l := ls[i%3]
		clock.add(time.Microsecond) // arrivals apart, as on a real clock
		w, err := l.Enqueue(context.Background(), r, 0)
		if err != nil {
			t.Fatal(err)
		}
		name[limiter.WaiterID(w)] = []string{"i", "b"}[r.Class] + string(rune('0'+i%10))
		claims.Go(func() { // reports with Errorf: FailNow belongs to the test's goroutine
			select {
			case <-w.Ready():
			case <-time.After(10 * time.Second):
				t.Errorf("waiter %s: no grant within 10s", limiter.WaiterID(w))
				return
			}
			claim := r
			claim.Claim(w)
			if d, err := l.Decide(context.Background(), []limiter.Request{claim}); err != nil || !d.Allowed {
				t.Errorf("claim of %s: %+v, %v", limiter.WaiterID(w), d, err)
			}
			l.Claimed(w)
			claimed <- limiter.WaiterID(w)
		})
	}
	clock.add(60 * time.Millisecond) // a token refills
	if d := allow(t, ls[1], req); d.Allowed {
		t.Fatalf("a request decided afresh overtook the waiters: %+v", d)
	}
	var order []string
	for k := range 20 {
		if k > 0 {
			clock.add(50 * time.Millisecond) // the next token
		}
		select {
		case id := <-published:
			order = append(order, name[id])
		case <-time.After(5 * time.Second):
			t.Fatalf("no grant within 5s after %v", order)
		}
		select {
		case <-claimed:
		case <-time.After(5 * time.Second):
			t.Fatalf("no claim within 5s after %v", order)
		}
		select {
		case id := <-published:
			t.Fatalf("after %v: %s granted too, with one token", order, name[id])
		case <-time.After(20 * time.Millisecond): // a second grant would come with the first
		}
	}
	want := []string{"i0", "i1", "i2", "i3", "b0", "i4", "i5", "i6", "i7", "b1", "i8", "i9", "b2", "b3", "b4", "b5", "b6", "b7", "b8", "b9"}
	if strings.Join(order, " ") != strings.Join(want, " ") {
		t.Fatalf("grants %v, want %v", order, want)
	}
}

// TestQueueTokenBucketLeaveHandsOn: a token bucket of 100 tokens refilled at 1/s, emptied, two
// waiters. Once the token has refilled the first is granted it; when the first leaves, the
// token goes to the second at once (the clock not moved), whose claim is admitted; and a
// request decided afresh then, with no waiter left, is denied: the token was taken once.
func TestQueueTokenBucketLeaveHandsOn(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls, clock := clockLimiters(t, srv, 1)
	l := ls[0]
	req := limiter.Request{Zone: queuedBucket("qb", 100, 1, 0), Key: "site", Cost: 1}
	empty := req
	empty.Cost = 100
	if d := allow(t, l, empty); !d.Allowed {
		t.Fatalf("first request: %+v", d)
	}
	var ws []*limiter.Waiter
	for range 2 {
		clock.add(time.Microsecond)
		w, err := l.Enqueue(context.Background(), req, 0)
		if err != nil {
			t.Fatal(err)
		}
		notReady(t, w, "a waiter before the refill")
		ws = append(ws, w)
	}
	clock.add(time.Second)
	ready(t, ws[0], "the first waiter")
	notReady(t, ws[1], "the second waiter, behind the first's grant")
	if err := l.Leave(context.Background(), ws[0]); err != nil {
		t.Fatal(err)
	}
	ready(t, ws[1], "the second waiter, once the first left")
	claim := req
	claim.Claim(ws[1])
	if d := allow(t, l, claim); !d.Allowed {
		t.Fatalf("claim: %+v", d)
	}
	l.Claimed(ws[1])
	if d := allow(t, l, req); d.Allowed {
		t.Fatalf("a request after the claim was admitted: the token was taken twice: %+v", d)
	}
}

// TestQueueTokenBucketCostInOrder: a token bucket of 30 tokens refilled at 10/s, emptied; a
// waiter of cost 3, then one of cost 1. One token in, neither is granted (the second does not
// overtake the first); three in, the first is granted them all, and its claim admitted; one
// more, the second.
func TestQueueTokenBucketCostInOrder(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls, clock := clockLimiters(t, srv, 1)
	l := ls[0]
	z := queuedBucket("qb", 30, 10, 0)
	if d := allow(t, l, limiter.Request{Zone: z, Key: "site", Cost: 30}); !d.Allowed {
		t.Fatalf("first request: %+v", d)
	}
	var ws []*limiter.Waiter
	for _, cost := range []int64{3, 1} {
		clock.add(time.Microsecond)
		w, err := l.Enqueue(context.Background(), limiter.Request{Zone: z, Key: "site", Cost: cost}, 0)
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, w)
	}
	clock.add(100 * time.Millisecond)                             // 1 token
	if err := l.RefreshQueues(context.Background()); err != nil { // a grant call at 1 token
		t.Fatal(err)
	}
	notReady(t, ws[0], "cost 3 with 1 token")
	notReady(t, ws[1], "cost 1 behind cost 3")
	clock.add(200 * time.Millisecond) // 3 tokens
	ready(t, ws[0], "cost 3 with 3 tokens")
	claim := limiter.Request{Zone: z, Key: "site", Cost: 3}
	claim.Claim(ws[0])
	if d := allow(t, l, claim); !d.Allowed {
		t.Fatalf("claim of cost 3: %+v", d)
	}
	l.Claimed(ws[0])
	notReady(t, ws[1], "cost 1 once cost 3 took the 3 tokens")
	clock.add(100 * time.Millisecond)
	ready(t, ws[1], "cost 1 with 1 more token")
}
