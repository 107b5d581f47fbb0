package limiter_test

import (
	"context"
	"errors"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func state(t *testing.T, l *limiter.Limiter, z *limiter.Zone, key string) limiter.State {
	t.Helper()
	s, err := l.State(context.Background(), z, key)
	if err != nil {
		t.Fatalf("State: %v", err)
	}
	return s
}

// checkState compares s with want, except TTL, which must lie in (ttlMin, ttlMax]: it is
// Redis's, counting down in real time.
func checkState(t *testing.T, step string, s, want limiter.State, ttlMin, ttlMax time.Duration) {
	t.Helper()
	ttl := s.TTL
	s.TTL, want.TTL = 0, 0
	if math.Abs(s.Tokens-want.Tokens) < 1e-9 { // float arithmetic: 3 - (3 - 0.6) is not 0.6
		s.Tokens = want.Tokens
	}
	if s != want {
		t.Fatalf("%s:\n got %+v\nwant %+v", step, s, want)
	}
	if ttl <= ttlMin || ttl > ttlMax {
		t.Fatalf("%s: TTL %v, want in (%v, %v]", step, ttl, ttlMin, ttlMax)
	}
}

func TestStateTokenBucket(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := tb("api", 3, 2) // 3 tokens, 2 tokens/s: one per 500ms
	const key = "rl:{alice}:api:tb"

	// Never seen: a full bucket, and reading it creates nothing.
	s := state(t, l, z, "alice")
	if s != (limiter.State{Key: key, Now: clk.Now(), Tokens: 3, Remaining: 3}) {
		t.Fatalf("never seen: %+v, want a full bucket that does not exist", s)
	}
	if n := srv.Do("EXISTS", key); n != int64(0) {
		t.Fatalf("State created the key (EXISTS = %v)", n)
	}

	for i := 0; i < 3; i++ {
		allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1})
	}
	// Empty: the TTL the script set is the 1.5s until the bucket is full again.
	checkState(t, "empty", state(t, l, z, "alice"), limiter.State{
		Key: key, Exists: true, Now: clk.Now(), Tokens: 0, Remaining: 0, RetryAfter: 500 * time.Millisecond,
		Reset: 1500 * time.Millisecond, Next: 500 * time.Millisecond,
	}, 0, 1500*time.Millisecond)
	d := allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1})
	if d.Allowed || d.RetryAfter != 500*time.Millisecond || d.Reset != 1500*time.Millisecond || d.Next != 500*time.Millisecond {
		t.Fatalf("the script disagrees with State: %+v", d)
	}

	clk.Advance(300 * time.Millisecond) // 0.6 tokens: refilled to now, as the script computes
	checkState(t, "0.6 tokens", state(t, l, z, "alice"), limiter.State{
		Key: key, Exists: true, Now: clk.Now(), Tokens: 0.6, Remaining: 0, RetryAfter: 200 * time.Millisecond,
		Reset: 1200 * time.Millisecond, Next: 200 * time.Millisecond,
	}, 0, 1500*time.Millisecond)
	clk.Advance(950 * time.Millisecond) // 2.5 tokens
	checkState(t, "2.5 tokens", state(t, l, z, "alice"), limiter.State{
		Key: key, Exists: true, Now: clk.Now(), Tokens: 2.5, Remaining: 2,
		Reset: 250 * time.Millisecond, Next: 250 * time.Millisecond,
	}, 0, 1500*time.Millisecond)
	clk.Advance(time.Hour) // never above capacity
	checkState(t, "an hour later", state(t, l, z, "alice"), limiter.State{
		Key: key, Exists: true, Now: clk.Now(), Tokens: 3, Remaining: 3,
	}, 0, 1500*time.Millisecond)
}

func TestStateTokenBucketRedisClock(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	z := tb("slow", 2, 1.0/3600) // one token per hour
	for i := 0; i < 2; i++ {
		allow(t, l, limiter.Request{Zone: z, Key: "bob", Cost: 1})
	}
	s := state(t, l, z, "bob")
	// Now is the Redis server's TIME: the refill since the last request is a few µs of a token.
	if !s.Exists || s.Remaining != 0 || s.Tokens < 0 || s.Tokens > 0.01 {
		t.Fatalf("empty bucket: %+v", s)
	}
	if s.RetryAfter <= 3590*time.Second || s.RetryAfter > time.Hour {
		t.Fatalf("RetryAfter %v, want just under the hour until one token is back", s.RetryAfter)
	}
	if s.TTL <= 7190*time.Second || s.TTL > 2*time.Hour {
		t.Fatalf("TTL %v, want just under the 2h until the bucket is full", s.TTL)
	}
}

func TestStateSlidingWindow(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := sw("login", 3, 10*time.Second)
	const key = "rl:{alice}:login:sw"

	s := state(t, l, z, "alice")
	if s != (limiter.State{Key: key, Now: clk.Now(), Remaining: 3}) {
		t.Fatalf("never seen: %+v, want an empty window that does not exist", s)
	}
	if n := srv.Do("EXISTS", key); n != int64(0) {
		t.Fatalf("State created the key (EXISTS = %v)", n)
	}

	allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 2}) // t=0: 2 entries
	clk.Advance(time.Second)
	checkState(t, "t=1s", state(t, l, z, "alice"), limiter.State{
		Key: key, Exists: true, Now: clk.Now(), Count: 2, Remaining: 1, Reset: 9 * time.Second, Next: 9 * time.Second,
	}, 0, 10*time.Second)
	allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1}) // t=1s: full
	clk.Advance(2 * time.Second)
	// Full: one slot is free when the t=0 entries leave, at t=10s, all when the t=1s one does.
	checkState(t, "t=3s", state(t, l, z, "alice"), limiter.State{
		Key: key, Exists: true, Now: clk.Now(), Count: 3, Remaining: 0, RetryAfter: 7 * time.Second,
		Reset: 8 * time.Second, Next: 7 * time.Second,
	}, 0, 10*time.Second)
	if d := allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1}); d.Allowed || d.RetryAfter != 7*time.Second || d.Reset != 8*time.Second || d.Next != 7*time.Second {
		t.Fatalf("the script disagrees with State: %+v", d)
	}

	// The same zone with a lower limit (a config change) is over it: the request fits when the
	// 2nd newest entry (t=0) leaves the window.
	lower := sw("login", 2, 10*time.Second)
	checkState(t, "limit lowered to 2", state(t, l, lower, "alice"), limiter.State{
		Key: key, Exists: true, Now: clk.Now(), Count: 3, Remaining: 0, RetryAfter: 7 * time.Second,
		Reset: 8 * time.Second, Next: 7 * time.Second,
	}, 0, 10*time.Second)
	lowest := sw("login", 1, 10*time.Second) // the newest entry (t=1s) must leave: t=11s
	checkState(t, "limit lowered to 1", state(t, l, lowest, "alice"), limiter.State{
		Key: key, Exists: true, Now: clk.Now(), Count: 3, Remaining: 0, RetryAfter: 8 * time.Second,
		Reset: 8 * time.Second, Next: 7 * time.Second,
	}, 0, 10*time.Second)
	if d := allow(t, l, limiter.Request{Zone: lowest, Key: "alice", Cost: 1}); d.Allowed || d.RetryAfter != 8*time.Second {
		t.Fatalf("the script disagrees with State: %+v", d)
	}

	// At t=10s the t=0 entries are out of the window, though no decision has removed them yet.
	clk.Advance(7 * time.Second)
	if n := srv.Do("ZCARD", key); n != int64(3) {
		t.Fatalf("ZCARD = %v, want the 3 entries still stored", n)
	}
	checkState(t, "t=10s", state(t, l, z, "alice"), limiter.State{
		Key: key, Exists: true, Now: clk.Now(), Count: 1, Remaining: 2, Reset: time.Second, Next: time.Second,
	}, 0, 10*time.Second)
}

func TestStateBadStoredValues(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: newClock().Now})
	z := tb("api", 5, 1)
	// Fields that are not numbers: decide.lua treats the bucket as full, and so does State.
	srv.Do("HSET", "rl:{x}:api:tb", "t", "abc", "ts", "1")
	if s := state(t, l, z, "x"); !s.Exists || s.Tokens != 5 || s.Remaining != 5 || s.TTL != -1 {
		t.Fatalf("unreadable bucket: %+v, want full, existing, no expiry", s)
	}
	// A key of the wrong type is an error, not a panic.
	srv.Do("SET", "rl:{y}:api:tb", "1")
	if _, err := l.State(context.Background(), z, "y"); err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Fatalf("State of a string key: %v, want WRONGTYPE", err)
	}
}

func TestStateSanitisesTheClientKey(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "p:", Now: newClock().Now})
	z := tb("api", 5, 1)
	raw := "a key with spaces {and braces}"
	allow(t, l, limiter.Request{Zone: z, Key: raw, Cost: 2})
	s := state(t, l, z, raw)
	if s.Key != limiter.StateKey("p:", z, raw) || !strings.HasPrefix(s.Key, "p:{~") || !s.Exists || s.Remaining != 3 {
		t.Fatalf("State of a digested key: %+v", s)
	}
}

func TestReset(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100})
	z := tb("api", 2, 1.0/3600)
	req := limiter.Request{Zone: z, Key: "alice", Cost: 1}
	other := limiter.Request{Zone: z, Key: "bob", Cost: 1}
	for _, r := range []limiter.Request{req, req, req, other, other, other} {
		allow(t, l, r)
	}
	if _, ok := l.Denied([]limiter.Request{req}); !ok {
		t.Fatal("alice's denial is not in the deny cache")
	}

	existed, err := l.Reset(context.Background(), z, "alice")
	if err != nil || !existed {
		t.Fatalf("Reset = %v, %v; want true, nil", existed, err)
	}
	if n := srv.Do("EXISTS", "rl:{alice}:api:tb"); n != int64(0) {
		t.Fatalf("the key survived Reset (EXISTS = %v)", n)
	}
	if _, ok := l.Denied([]limiter.Request{req}); ok {
		t.Fatal("alice's cached denial survived Reset")
	}
	want(t, "after reset", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 2, Remaining: 1, Reset: time.Hour, Next: time.Hour})
	// Bob was not touched.
	if _, ok := l.Denied([]limiter.Request{other}); !ok {
		t.Fatal("bob's cached denial went with alice's")
	}
	if s := state(t, l, z, "bob"); s.Remaining != 0 {
		t.Fatalf("bob's bucket changed: %+v", s)
	}

	if existed, err := l.Reset(context.Background(), z, "carol"); err != nil || existed {
		t.Fatalf("Reset of a client never seen = %v, %v; want false, nil", existed, err)
	}
}

// TestResetNotBroadcast: a reset whose announcement Redis refuses (a user without PUBLISH) is
// done, and says it was not broadcast.
func TestResetNotBroadcast(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	srv.Do("ACL", "SETUSER", "nopublish", "on", ">s3cret", "~*", "&*", "+@all", "-publish")
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: "nopublish", Password: "s3cret"})
	t.Cleanup(func() { _ = rdb.Close() })
	l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Now: newClock().Now})
	z := tb("api", 2, 1.0/3600)
	allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1})
	existed, err := l.Reset(context.Background(), z, "alice")
	if !existed || !errors.Is(err, limiter.ErrNotBroadcast) || !strings.Contains(err.Error(), "NOPERM") {
		t.Fatalf("Reset = %v, %v; want true and ErrNotBroadcast with Redis's refusal", existed, err)
	}
	if n := srv.Do("EXISTS", "rl:{alice}:api:tb"); n != int64(0) {
		t.Fatalf("the key survived Reset (EXISTS = %v)", n)
	}
}

func TestForget(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: newClock().Now, DenyCacheKeys: 100})
	z := sw("w", 1, time.Hour)
	req := limiter.Request{Zone: z, Key: "k", Cost: 1}
	allow(t, l, req)
	allow(t, l, req)
	if _, ok := l.Denied([]limiter.Request{req}); !ok {
		t.Fatal("no cached denial")
	}
	l.Forget(z, "k")
	if _, ok := l.Denied([]limiter.Request{req}); ok {
		t.Fatal("the cached denial survived Forget")
	}
	if s := state(t, l, z, "k"); s.Count != 1 {
		t.Fatalf("Forget touched Redis: %+v", s)
	}
	limiter.New(srv.Client(), limiter.Options{}).Forget(z, "k") // no deny cache: nothing to do
}

func TestStateRedisFailures(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	// As the module's client: the context's deadline bounds every socket wait, one retry.
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true, MaxRetries: 1})
	t.Cleanup(func() { _ = rdb.Close() })
	l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:"})
	z := tb("api", 5, 1)

	srv.Pause()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	// The context's deadline, as the context's check or as the socket's deadline it set ("i/o
	// timeout"), whichever the scheduler makes come first: both are the one 200ms deadline.
	timedOut := func(err error) bool {
		return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded)
	}
	if _, err := l.State(ctx, z, "a"); !timedOut(err) {
		t.Fatalf("State on a stalled Redis: %v, want the context's deadline", err)
	}
	if _, err := l.Reset(ctx, z, "a"); !timedOut(err) {
		t.Fatalf("Reset on a stalled Redis: %v, want the context's deadline", err)
	}
	srv.Resume()

	srv.Stop()
	if _, err := l.State(context.Background(), z, "a"); err == nil {
		t.Fatal("State with Redis down: no error")
	}
	if _, err := l.Reset(context.Background(), z, "a"); err == nil {
		t.Fatal("Reset with Redis down: no error")
	}
}

// TestStateTimesAsADenial: for every algorithm that keeps state between requests, and under a
// block, State's Reset and Next are those a denied request's decision reports at the same
// instant, and State's Remaining is its Remaining: spent in part, then read, then denied by a
// cost of the whole quota, which charges nothing.
func TestStateTimesAsADenial(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	zones := []*limiter.Zone{
		tb("tb", 4, 0.5),
		sw("sw", 4, 10*time.Second),
		{Name: "fw", Algorithm: limiter.FixedWindow, Limit: 4, Window: 10 * time.Second},
		{Name: "sc", Algorithm: limiter.SlidingWindowCounter, Limit: 4, Window: 10 * time.Second},
		{Name: "blocked", Algorithm: limiter.TokenBucket, Capacity: 4, RefillRate: 0.5, Block: time.Minute},
	}
	clk.Advance(2500 * time.Millisecond) // into the fixed windows, which are aligned to the epoch
	for _, z := range zones {
		allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 2})
		clk.Advance(1300 * time.Millisecond)
		allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1})
		if z.Block > 0 {
			allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 4}) // denied: the block starts
		}
		clk.Advance(700 * time.Millisecond)
		s := state(t, l, z, "alice")
		d := allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 4})
		if d.Allowed || s.Reset != d.Reset || s.Next != d.Next || s.Remaining != d.Remaining {
			t.Fatalf("%s: State Remaining %d Reset %v Next %v, denial %+v", z.Name, s.Remaining, s.Reset, s.Next, d)
		}
		if s.Next <= 0 || s.Reset < s.Next {
			t.Fatalf("%s: Next %v, Reset %v: want 0 < Next <= Reset in a zone spent in part", z.Name, s.Next, s.Reset)
		}
	}
}
