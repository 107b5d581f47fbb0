package limiter_test

// Zones whose numbers change per request (plans and tiers): the handler gives the
// limiter a copy of the zone per request with the numbers resolved for it.

import (
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestDenyCacheKeyedByNumbers: a cached denial answers for a later request of the same zone
// name, client and cost only if it is decided under the same numbers, whatever *Zone carries
// them: a copy with the same numbers is covered, one with a larger capacity goes to Redis and
// gets the difference at once (a bucket stores what is used), one with a smaller capacity goes
// to Redis too. Forget clears the zone's entries under every number.
func TestDenyCacheKeyedByNumbers(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Minute})
	free := func() *limiter.Zone { return tb("api", 3, 3.0/3600) } // a new copy per request
	paid := func() *limiter.Zone { return tb("api", 10, 10.0/3600) }
	for range 3 {
		if d := allow(t, l, limiter.Request{Zone: free(), Key: "k", Cost: 1}); !d.Allowed {
			t.Fatalf("free: %+v", d)
		}
	}
	if d := allow(t, l, limiter.Request{Zone: free(), Key: "k", Cost: 1}); d.Allowed || d.Cached {
		t.Fatalf("4th free: %+v, want denied by Redis", d)
	}
	calls := srv.ScriptCalls()
	if d := allow(t, l, limiter.Request{Zone: free(), Key: "k", Cost: 1}); d.Allowed || !d.Cached || d.Limit != 3 {
		t.Fatalf("5th free, another copy of the same numbers: %+v, want the cached denial", d)
	}
	for i := range 7 {
		if d := allow(t, l, limiter.Request{Zone: paid(), Key: "k", Cost: 1}); !d.Allowed || d.Cached || d.Limit != 10 || d.Remaining != int64(6-i) {
			t.Fatalf("paid %d: %+v, want admitted by Redis with %d left", i+1, d, 6-i)
		}
	}
	if d := allow(t, l, limiter.Request{Zone: paid(), Key: "k", Cost: 1}); d.Allowed || d.Limit != 10 {
		t.Fatalf("8th paid: %+v, want denied: 10 used", d)
	}
	if got := srv.ScriptCalls() - calls; got != 8 {
		t.Fatalf("%d script calls for 8 paid requests, want 8: a denial under the free numbers answered", got)
	}
	// Another refill rate is other numbers too.
	if d := allow(t, l, limiter.Request{Zone: tb("api", 10, 1), Key: "k", Cost: 1}); d.Cached || d.RetryAfter != time.Second {
		t.Fatalf("paid capacity, faster refill: %+v, want Redis to decide: a token in 1s", d)
	}
	allow(t, l, limiter.Request{Zone: paid(), Key: "k", Cost: 1})
	calls = srv.ScriptCalls()
	l.Forget(free(), "k")
	for _, z := range []*limiter.Zone{free(), paid()} {
		allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 1})
	}
	if got := srv.ScriptCalls() - calls; got != 2 {
		t.Fatalf("%d script calls after Forget, want 2: Forget clears every number's entries", got)
	}
}

// TestDeniedAllocatesNothing: answering from the deny cache allocates nothing, for the zone's
// own parameters as for a per-request copy.
func TestDeniedAllocatesNothing(t *testing.T) {
	// Not parallel: testing.AllocsPerRun refuses a parallel test.
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", DenyCacheKeys: 100, DenyCacheMaxAge: time.Minute})
	z := tb("z", 1, 0.001)
	allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 1})
	allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 1})
	copied := *z
	for name, reqs := range map[string][]limiter.Request{
		"own":  {{Zone: z, Key: "k", Cost: 1}},
		"copy": {{Zone: &copied, Key: "k", Cost: 1}},
	} {
		if _, ok := l.Denied(reqs); !ok {
			t.Fatalf("%s: no cached denial", name)
		}
		if n := testing.AllocsPerRun(100, func() { l.Denied(reqs) }); n != 0 {
			t.Fatalf("%s: %.0f allocations per cached denial, want 0", name, n)
		}
	}
}

// TestLocalFollowsRequestNumbers: while Redis fails (fail_mode local), a client's in-process
// bucket takes each request's numbers: a larger capacity raises its burst and a faster refill
// rate applies from then on; a smaller capacity caps the tokens it holds.
func TestLocalFollowsRequestNumbers(t *testing.T) {
	l := limiter.NewLocal(0)
	t0 := time.Unix(1_700_000_000, 0)
	free := limiter.Request{Zone: tb("api", 3, 1), Key: "alice", Cost: 1}
	paid := limiter.Request{Zone: tb("api", 10, 10), Key: "alice", Cost: 1}
	for range 3 {
		l.Allow([]limiter.Request{free}, t0)
	}
	if d := l.Allow([]limiter.Request{free}, t0); d.Allowed {
		t.Fatalf("4th free: %+v, want denied", d)
	}
	want(t, "paid, 0 tokens", l.Allow([]limiter.Request{paid}, t0),
		limiter.Decision{Limit: 10, RetryAfter: 100 * time.Millisecond, Reset: time.Second, Next: 100 * time.Millisecond})
	// A second at the paid rate: 10 tokens, the paid capacity.
	want(t, "paid, a second later", l.Allow([]limiter.Request{paid}, t0.Add(time.Second)),
		limiter.Decision{Allowed: true, Limit: 10, Remaining: 9, Reset: 100 * time.Millisecond, Next: 100 * time.Millisecond})
	// Back to free: at most 3 tokens.
	want(t, "free again", l.Allow([]limiter.Request{free}, t0.Add(time.Second)),
		limiter.Decision{Allowed: true, Limit: 3, Remaining: 2, Reset: time.Second, Next: time.Second})
}
