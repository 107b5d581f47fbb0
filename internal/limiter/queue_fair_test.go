package limiter_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// fairWaiter is a waiter of a fair queue test, its tenant and the Limiter it waits on.
type fairWaiter struct {
	w      *limiter.Waiter
	tenant string
	l      *limiter.Limiter
	req    limiter.Request
}

// enterFair enqueues n waiters of tenant (class class) of zone z on l, and appends them to ws.
func enterFair(t *testing.T, ws []fairWaiter, l *limiter.Limiter, z *limiter.Zone, tenant string, class, n int) []fairWaiter {
	t.Helper()
	for range n {
		r := limiter.Request{Zone: z, Key: "upstream", Cost: 1, Hold: time.Minute, Class: class, Tenant: tenant}
		w, err := l.Enqueue(context.Background(), r, 0)
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, fairWaiter{w, tenant, l, r})
	}
	return ws
}

// nextGrant waits up to 5 s for exactly one of ws to be signalled and returns its index; it
// fails t when none is, or when two are.
func nextGrant[W any](t *testing.T, ws []W, waiter func(W) *limiter.Waiter) int {
	t.Helper()
	got := -1
	for deadline := time.Now().Add(5 * time.Second); got < 0 && time.Now().Before(deadline); {
		for k := range ws {
			select {
			case <-waiter(ws[k]).Ready():
				if got >= 0 {
					t.Fatalf("two waiters granted one slot")
				}
				got = k
			default:
			}
		}
		time.Sleep(time.Millisecond) // polling the waiters' signals
	}
	if got < 0 {
		t.Fatal("no grant within 5s")
	}
	return got
}

// fairOrder gives back held (the one slot of ws's queue) and then each grant's slot, claiming
// every grant on its waiter's Limiter, and returns the tenants in the order granted; the last
// grant's slot is given back too.
func fairOrder(t *testing.T, held limiter.Decision, holder *limiter.Limiter, ws []fairWaiter) []string {
	t.Helper()
	var order []string
	for len(ws) > 0 {
		settleAll(t, holder, held)
		k := nextGrant(t, ws, func(f fairWaiter) *limiter.Waiter { return f.w })
		order = append(order, ws[k].tenant)
		held, holder = claimSlot(t, ws[k].l, ws[k].req, ws[k].w, ws[k].tenant), ws[k].l
		ws = slices.Delete(ws, k, k+1)
	}
	settleAll(t, holder, held)
	return order
}

// rounds sorts order within each run of lengths given, so that ties broken either way compare
// equal: rounds([A B A C], 2, 2) is "A B | A C".
func rounds(order []string, lengths ...int) string {
	var out []string
	for _, n := range lengths {
		n = min(n, len(order))
		r := slices.Clone(order[:n])
		slices.Sort(r)
		out = append(out, strings.Join(r, " "))
		order = order[n:]
	}
	return strings.Join(out, " | ")
}

// fairZone is queued(name, limit, shares...) with fair queuing by tenant.
func fairZone(name string, limit int64, shares ...int) *limiter.Zone {
	z := queued(name, limit, shares...)
	z.FairTenants = limiter.DefaultFairTenants
	return z
}

// TestQueueFairTakesTurnsAcrossInstances: limit 1 held; tenant A's 6 waiters enter on one
// instance, then B's 2 on another, then C's 1 on the first: each slot given back goes by
// start-time fair queuing, so the first three grants are one each of A, B and C, the next two
// one each of A and B, and A's remaining four last; each waiter's Ahead counts the waiters of
// a lesser tag.
func TestQueueFairTakesTurnsAcrossInstances(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls := queueLimiters(t, srv, 3)
	z := fairZone("q", 1)
	held := allow(t, ls[0], limiter.Request{Zone: z, Key: "upstream", Cost: 1, Hold: time.Minute})
	ws := enterThreeTenants(t, ls, z)
	var ahead []int64
	for _, f := range ws {
		ahead = append(ahead, f.w.Ahead)
	}
	if want := []int64{0, 1, 2, 3, 4, 5, 0, 2, 0}; !slices.Equal(ahead, want) {
		t.Fatalf("waiters ahead of each (A's 6, B's 2, C's): %v, want %v", ahead, want)
	}
	checkThreeTenantsOrder(t, fairOrder(t, held, ls[0], ws))
}

// enterThreeTenants enqueues tenant A's 6 waiters of zone z on ls[1], then B's 2 on ls[2], then
// C's 1 on ls[1].
func enterThreeTenants(t *testing.T, ls []*limiter.Limiter, z *limiter.Zone) []fairWaiter {
	t.Helper()
	ws := enterFair(t, nil, ls[1], z, "A", 0, 6)
	ws = enterFair(t, ws, ls[2], z, "B", 0, 2)
	return enterFair(t, ws, ls[1], z, "C", 0, 1)
}

// checkThreeTenantsOrder checks the grants of enterThreeTenants's waiters, in order: one each
// of A, B and C, one each of A and B, then A's remaining four.
func checkThreeTenantsOrder(t *testing.T, order []string) {
	t.Helper()
	if got, want := rounds(order, 3, 2, 4), "A B C | A B | A A A A"; got != want {
		t.Fatalf("grants %v: rounds %q, want %q", order, got, want)
	}
}

// TestQueueFairInsideClasses: classes interactive and batch (share 20%), fair by tenant; batch
// tenant A's 6 waiters, then B's 2, then 2 interactive waiters of tenant A: the interactive
// waiters are granted first (batch is owed nothing within 2 grants), then batch's take turns:
// A and B, A and B, then A's 4.
func TestQueueFairInsideClasses(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls := queueLimiters(t, srv, 2)
	z := fairZone("q", 1, 0, 200)
	held := allow(t, ls[0], limiter.Request{Zone: z, Key: "upstream", Cost: 1, Hold: time.Minute})
	ws := enterFair(t, nil, ls[0], z, "A", 1, 6)
	ws = enterFair(t, ws, ls[1], z, "B", 1, 2)
	ws = enterFair(t, ws, ls[1], z, "interactive", 0, 2)
	order := fairOrder(t, held, ls[0], ws)
	if got, want := rounds(order, 2, 2, 2, 4), "interactive interactive | A B | A B | A A A A"; got != want {
		t.Fatalf("grants %v: rounds %q, want %q", order, got, want)
	}
}

// TestQueueFairTenantsBound: fair_tenants 2; tenants A (4 waiters) and B (1) have a place each,
// C and D, beyond the bound, share one (""): Queue lists A 4, "" 2, B 1 of 3 tenants; the
// grants go A, B and C in the first round, A and D in the second, then A's last two; and once
// every grant is claimed the queue's keys are gone but for their TTL's, holding no waiter.
func TestQueueFairTenantsBound(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls := queueLimiters(t, srv, 1)
	z := fairZone("q", 1)
	z.FairTenants = 2
	held := allow(t, ls[0], limiter.Request{Zone: z, Key: "upstream", Cost: 1, Hold: time.Minute})
	ws := enterFair(t, nil, ls[0], z, "A", 0, 4)
	for _, tenant := range []string{"B", "C", "D"} {
		ws = enterFair(t, ws, ls[0], z, tenant, 0, 1)
	}
	q, err := ls[0].Queue(context.Background(), z, "upstream")
	if err != nil {
		t.Fatal(err)
	}
	want := []limiter.TenantWaiting{{Tenant: "A", Waiting: 4}, {Tenant: "", Waiting: 2}, {Tenant: "B", Waiting: 1}}
	if !slices.Equal(q.Tenants, want) || q.TenantsWaiting != 3 {
		t.Fatalf("tenants %+v of %d, want %+v of 3", q.Tenants, q.TenantsWaiting, want)
	}
	order := fairOrder(t, held, ls[0], ws)
	if got, want := rounds(order, 3, 2, 2), "A B C | A D | A A"; got != want {
		t.Fatalf("grants %v: rounds %q, want %q", order, got, want)
	}
	if q, err = ls[0].Queue(context.Background(), z, "upstream"); err != nil || len(q.Tenants) != 0 || q.Waiting[0] != 0 {
		t.Fatalf("after every grant: %+v, %v; want no waiter and no tenant", q, err)
	}
}

// TestQueueFairTokenBucketByCost: a token bucket queue with priority, fair by tenant, emptied;
// tenant A's 3 waiters of cost 2, then B's 3 of cost 1. Once 9 tokens have refilled, one
// promote grants all six, published in start-time fair order with each request's cost as its
// size: A and B (tag 0), B (1), A and B (2), A (4).
func TestQueueFairTokenBucketByCost(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls, clock := clockLimiters(t, srv, 2)
	published := grants(t, srv)
	z := queuedBucket("qb", 100, 20, 0)
	z.FairTenants = limiter.DefaultFairTenants
	if d := allow(t, ls[0], limiter.Request{Zone: z, Key: "site", Cost: 100}); !d.Allowed {
		t.Fatalf("first request: %+v", d)
	}
	tenant := map[string]string{}
	for i := range 6 {
		r := limiter.Request{Zone: z, Key: "site", Cost: int64(2 - i/3), Tenant: []string{"A", "B"}[i/3]}
		w, err := ls[i%2].Enqueue(context.Background(), r, 0)
		if err != nil {
			t.Fatal(err)
		}
		tenant[limiter.WaiterID(w)] = r.Tenant
	}
	clock.add(450 * time.Millisecond) // 9 tokens refill: the instances' next promote grants all
	var order []string
	for range 6 {
		select {
		case id := <-published:
			order = append(order, tenant[id])
		case <-time.After(5 * time.Second):
			t.Fatalf("no grant within 5s after %v", order)
		}
	}
	if got, want := rounds(order, 2, 1, 2, 1), "A B | B | A B | A"; got != want {
		t.Fatalf("grants %v: rounds %q, want %q", order, got, want)
	}
}

// TestQueueFairNeedsQueue: fair queuing on a zone without a queue is refused, naming why.
func TestQueueFairNeedsQueue(t *testing.T) {
	t.Parallel()
	z := cc("q", 1)
	z.FairTenants = 10
	err := z.Validate()
	if err == nil || !strings.Contains(err.Error(), "fair queuing needs a queue: a max_wait, on algorithm concurrency, or with priority on token_bucket") {
		t.Fatalf("fair queuing without max_wait: %v", err)
	}
}

// TestQueueFairFaults: limit 1 held; an instance that then dies has 4 waiters each of tenants A
// and B; a live one has C's first waiter, and 3 more of C whose clients hang up (Leave). Redis
// pauses for a second (less than a lease): C's waiter stays. Once the dead waiters' leases end
// and they are dropped, C's next waiter, then A's and B's again, enter on the live instance:
// the waiters that left gave their turns back, so A and B are not tagged behind their dead
// waiters, nor C behind its hung-up ones: the first round grants C, A and B, then C's second.
// In the end no slot is held and no waiter or tenant is left in the queue's keys (the tenants'
// finish tags go with the class's last waiter).
func TestQueueFairFaults(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls := queueLimiters(t, srv, 3)
	z := fairZone("q", 1)
	held := allow(t, ls[0], limiter.Request{Zone: z, Key: "upstream", Cost: 1, Hold: time.Minute})
	enterFair(t, nil, ls[1], z, "A", 0, 4)
	enterFair(t, nil, ls[1], z, "B", 0, 4)
	ws := enterFair(t, nil, ls[2], z, "C", 0, 1)
	for _, f := range enterFair(t, nil, ls[2], z, "C", 0, 3) {
		if err := ls[2].Leave(context.Background(), f.w); err != nil {
			t.Fatal(err)
		}
	}
	_ = ls[1].Close() // the instance dies: its waiters are no longer renewed
	srv.Pause()
	time.Sleep(time.Second) // the pause, shorter than a lease
	srv.Resume()
	key := limiter.StateKey("rl:", z, "upstream")
	redistest.WaitFor(t, limiter.QueueLease+5*time.Second, "the dead instance's waiters dropped", func() bool {
		n, _ := srv.Do("ZCARD", key+":ql").(int64)
		return n == 1
	})
	notReady(t, ws[0].w, "C's waiter after the pause")
	if ws[0].w.Gone() {
		t.Fatal("C's waiter was dropped by a pause shorter than its lease")
	}
	ws = enterFair(t, ws, ls[2], z, "C", 0, 1)
	ws = enterFair(t, ws, ls[2], z, "A", 0, 1)
	ws = enterFair(t, ws, ls[2], z, "B", 0, 1)
	order := fairOrder(t, held, ls[0], ws)
	if got, want := rounds(order, 3, 1), "A B C | C"; got != want {
		t.Fatalf("grants %v: rounds %q, want %q", order, got, want)
	}
	for _, k := range []string{key, key + ":ql", key + ":q1", key + ":qv1"} {
		if n, _ := srv.Do("ZCARD", k).(int64); n != 0 {
			t.Errorf("%s: %d members left, want none", k, n)
		}
	}
	if n, _ := srv.Do("HLEN", key+":qt").(int64); n != 0 {
		t.Errorf("tenants of %d waiters left, want none", n)
	}
	if n, _ := srv.Do("EXISTS", key+":qf1").(int64); n != 0 {
		t.Error("the tenants' finish tags left with no waiter, want them gone")
	}
}

// TestQueueFairAdaptive: an adaptive concurrency zone's queue takes turns by tenant against the
// limit in force, not its ceiling: with a ceiling of 5 and nothing learnt yet (the limit in force
// its min limit, 1), each slot given back is one grant, in the order of
// TestQueueFairTakesTurnsAcrossInstances.
func TestQueueFairAdaptive(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ls := queueLimiters(t, srv, 3)
	z := adaptiveZone("q", 5)
	z.Adaptive.MinLimit = 1
	z.MaxWait, z.FairTenants = 10*time.Second, 100
	held := allow(t, ls[0], limiter.Request{Zone: z, Key: "upstream", Cost: 1, Hold: time.Minute})
	if held.Limit != 1 {
		t.Fatalf("the limit in force: %d, want the min limit 1", held.Limit)
	}
	checkThreeTenantsOrder(t, fairOrder(t, held, ls[0], enterThreeTenants(t, ls, z)))
}
