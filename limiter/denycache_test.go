package limiter_test

import (
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
)

// TestDenyCacheServesDenialsWithoutRedis: after a denial, requests it covers are denied with no
// script call, with the Retry-After and reset the zone would give, until the zone can admit.
func TestDenyCacheServesDenialsWithoutRedis(t *testing.T) {
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100})
	req := limiter.Request{Zone: tb("z", 1, 0.1), Key: "k", Cost: 1} // one token per 10s
	allow(t, l, req)
	want(t, "denied by Redis", allow(t, l, req), limiter.Decision{Limit: 1, RetryAfter: 10 * time.Second, Reset: 10 * time.Second})
	calls := srv.ScriptCalls()
	clk.Advance(4 * time.Second)
	want(t, "denied from the cache", allow(t, l, req),
		limiter.Decision{Limit: 1, RetryAfter: 6 * time.Second, Reset: 6 * time.Second, Cached: true})
	clk.Advance(6*time.Second - time.Microsecond)
	want(t, "1µs before the token", allow(t, l, req),
		limiter.Decision{Limit: 1, RetryAfter: time.Microsecond, Reset: time.Microsecond, Cached: true})
	if got := srv.ScriptCalls(); got != calls {
		t.Fatalf("%d script calls for cached denials, want 0", got-calls)
	}
	clk.Advance(time.Microsecond)
	want(t, "the token is back: Redis decides", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 1, Reset: 10 * time.Second})
	if got := srv.ScriptCalls(); got != calls+1 {
		t.Fatalf("%d script calls after the denial expired, want 1", got-calls)
	}
}

// TestDenyCacheCoversOnlyLargerCosts: a denial of cost 5 does not deny a request of cost 2,
// which may fit; nor a request to another zone or client.
func TestDenyCacheCoversOnlyLargerCosts(t *testing.T) {
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100})
	z := tb("z", 10, 0.001)
	allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 8}) // 2 left
	if d := allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 5}); d.Allowed || d.Cached {
		t.Fatalf("cost 5 with 2 left: %+v, want denied by Redis", d)
	}
	if d := allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 6}); d.Allowed || !d.Cached {
		t.Fatalf("cost 6 after cost 5 was denied: %+v, want denied from the cache", d)
	}
	if d := allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 2}); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("cost 2 with 2 left: %+v, want allowed by Redis", d)
	}
	if d := allow(t, l, limiter.Request{Zone: z, Key: "other", Cost: 5}); !d.Allowed {
		t.Fatalf("another client: %+v, want allowed", d)
	}
	if d := allow(t, l, limiter.Request{Zone: tb("y", 10, 0.001), Key: "k", Cost: 5}); !d.Allowed {
		t.Fatalf("another zone: %+v, want allowed", d)
	}
}

// TestDenyCacheMultiZone: a request that includes a zone with a cached denial is denied by it
// without a Redis call, and charges no other zone.
func TestDenyCacheMultiZone(t *testing.T) {
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100})
	wide, narrow := tb("wide", 10, 0.001), tb("narrow", 1, 0.001)
	both := []limiter.Request{{Zone: wide, Key: "k", Cost: 1}, {Zone: narrow, Key: "k", Cost: 1}}
	allow(t, l, both...)
	allow(t, l, both...) // denied by narrow: recorded
	calls := srv.ScriptCalls()
	if d := allow(t, l, both...); d.Allowed || !d.Cached || d.Zone != 1 {
		t.Fatalf("third: %+v, want a cached denial by zone 1", d)
	}
	if got := srv.ScriptCalls(); got != calls {
		t.Fatalf("%d script calls, want 0", got-calls)
	}
	if got := srv.Do("HGET", "rl:{k}:wide:tb", "t"); got != "9" {
		t.Fatalf("wide tokens = %v, want 9: denials charge no zone", got)
	}
}
