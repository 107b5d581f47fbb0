package limiter_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestDenyCacheServesDenialsWithoutRedis: after a denial, requests of the same cost are denied
// with no script call, with the Retry-After, reset and next unit Redis would give, until the
// zone can admit (max_age set long enough not to matter here).
func TestDenyCacheServesDenialsWithoutRedis(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Minute})
	req := limiter.Request{Zone: tb("z", 1, 0.1), Key: "k", Cost: 1} // one token per 10s
	allow(t, l, req)
	want(t, "denied by Redis", allow(t, l, req), limiter.Decision{Limit: 1, RetryAfter: 10 * time.Second, Reset: 10 * time.Second, Next: 10 * time.Second})
	calls := srv.ScriptCalls()
	clk.Advance(4 * time.Second)
	want(t, "denied from the cache", allow(t, l, req),
		limiter.Decision{Limit: 1, RetryAfter: 6 * time.Second, Reset: 6 * time.Second, Next: 6 * time.Second, Cached: true})
	clk.Advance(6*time.Second - time.Microsecond)
	want(t, "1µs before the token", allow(t, l, req),
		limiter.Decision{Limit: 1, RetryAfter: time.Microsecond, Reset: time.Microsecond, Next: time.Microsecond, Cached: true})
	if got := srv.ScriptCalls(); got != calls {
		t.Fatalf("%d script calls for cached denials, want 0", got-calls)
	}
	clk.Advance(time.Microsecond)
	want(t, "the token is back: Redis decides", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 1, Reset: 10 * time.Second, Next: 10 * time.Second})
	if got := srv.ScriptCalls(); got != calls+1 {
		t.Fatalf("%d script calls after the denial expired, want 1", got-calls)
	}
}

// TestDenyCacheMaxAge: a cached denial is trusted for at most DenyCacheMaxAge after its call was
// sent, however long its Retry-After; then Redis is asked again and the fresh denial cached.
func TestDenyCacheMaxAge(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Second})
	req := limiter.Request{Zone: sw("quota", 1, time.Hour), Key: "k", Cost: 1}
	allow(t, l, req)
	if d := allow(t, l, req); d.Allowed || d.Cached || d.RetryAfter != time.Hour {
		t.Fatalf("second request: %+v, want denied by Redis for 1h", d)
	}
	calls := srv.ScriptCalls()
	clk.Advance(time.Second - time.Microsecond)
	if d := allow(t, l, req); !d.Cached || d.RetryAfter != time.Hour-time.Second+time.Microsecond {
		t.Fatalf("within max_age: %+v, want a cached denial", d)
	}
	clk.Advance(time.Microsecond)
	if d := allow(t, l, req); d.Cached || d.Allowed {
		t.Fatalf("at max_age: %+v, want Redis to deny again", d)
	}
	if d := allow(t, l, req); !d.Cached {
		t.Fatalf("after Redis denied again: %+v, want the fresh denial cached", d)
	}
	if got := srv.ScriptCalls() - calls; got != 1 {
		t.Fatalf("%d script calls, want 1", got)
	}
}

// TestDenyCacheCoversOnlyTheSameCost: a denial of cost 5 answers only for cost 5: a cost of 2
// may fit, a cost of 6 waits longer than the entry knows, and a cost above the quota gets no
// Retry-After; neither another zone nor another client.
func TestDenyCacheCoversOnlyTheSameCost(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Hour})
	n := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now}) // Redis's answers
	z := tb("z", 10, 0.001)
	allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 8}) // 2 left
	if d := allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 5}); d.Allowed || d.Cached {
		t.Fatalf("cost 5 with 2 left: %+v, want denied by Redis", d)
	}
	if d := allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 5}); d.Allowed || !d.Cached {
		t.Fatalf("cost 5 again: %+v, want denied from the cache", d)
	}
	for _, cost := range []int64{6, 11} {
		got := allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: cost})
		redis := allow(t, n, limiter.Request{Zone: z, Key: "k", Cost: cost})
		if got.Cached || got != redis {
			t.Fatalf("cost %d after cost 5 was denied:\n got %+v\nwant %+v (Redis's answer)", cost, got, redis)
		}
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

// TestDenyCacheUntilTheNextUnit: a cached denial answers only until the zone's next unit
// arrives, so its Remaining is Redis's: a cost-5 denial of an empty 1/s bucket is cached for 1s,
// not for the 5s of its Retry-After.
func TestDenyCacheUntilTheNextUnit(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Hour})
	z := tb("z", 10, 1)
	req := limiter.Request{Zone: z, Key: "k", Cost: 5}
	allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 10})
	allow(t, l, req)
	clk.Advance(999 * time.Millisecond)
	want(t, "before the next token", allow(t, l, req), limiter.Decision{
		Limit: 10, RetryAfter: 4001 * time.Millisecond, Reset: 9001 * time.Millisecond, Next: time.Millisecond, Cached: true,
	})
	clk.Advance(3 * time.Second) // 3.999 tokens
	want(t, "after 3 more tokens", allow(t, l, req), limiter.Decision{
		Limit: 10, Remaining: 3, RetryAfter: 1001 * time.Millisecond, Reset: 6001 * time.Millisecond, Next: time.Millisecond,
	})
}

// TestDenyCacheStartsWhenSent: a cached denial's clock starts when its call was sent, so a slow
// reply does not make it outlive Redis's answer.
func TestDenyCacheStartsWhenSent(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	rdb := srv.Client()
	slow := &slowReply{clk: clk}
	rdb.AddHook(slow)
	l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Hour})
	req := limiter.Request{Zone: tb("z", 1, 1), Key: "k", Cost: 1}
	allow(t, l, req)
	slow.delay.Store(int64(300 * time.Millisecond)) // the reply takes 300ms to come back
	d := allow(t, l, req)
	slow.delay.Store(0)
	if d.Allowed || d.RetryAfter != time.Second {
		t.Fatalf("second request: %+v, want denied by Redis for 1s", d)
	}
	clk.Advance(700*time.Millisecond - time.Microsecond) // 1µs before Redis admits
	if c, ok := l.Denied([]limiter.Request{req}); !ok || c.RetryAfter != time.Microsecond {
		t.Fatalf("1µs before Redis admits: %+v (cached %v), want a cached denial for 1µs", c, ok)
	}
	clk.Advance(time.Microsecond)
	if c, ok := l.Denied([]limiter.Request{req}); ok {
		t.Fatalf("when Redis admits: cached denial %+v, want none", c)
	}
}

// slowReply is a go-redis hook that advances clk by delay after each command's reply: a reply
// that takes that long to arrive.
type slowReply struct {
	clk   *clock
	delay atomic.Int64
}

func (h *slowReply) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *slowReply) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.clk.Advance(time.Duration(h.delay.Load()))
		return err
	}
}
func (h *slowReply) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestDenyCacheBoundPerClient: a client's denials in a zone are kept for up to 4 costs, the
// newest: a fifth cost's denial pushes out the oldest, which Redis then answers again.
func TestDenyCacheBoundPerClient(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Hour})
	z := tb("z", 10, 0.001)
	allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 10}) // empty
	for cost := int64(1); cost <= 5; cost++ {
		if d := allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: cost}); d.Allowed || d.Cached {
			t.Fatalf("cost %d: %+v, want denied by Redis", cost, d)
		}
	}
	for cost := int64(1); cost <= 5; cost++ {
		if _, ok := l.Denied([]limiter.Request{{Zone: z, Key: "k", Cost: cost}}); ok != (cost > 1) {
			t.Fatalf("cost %d: cached %v, want the 4 newest costs (2 to 5) cached", cost, ok)
		}
	}
}
