package limiter_test

import (
	"context"
	"crypto/sha1"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

// clock is a settable clock for `clock local` tests.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time          { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) Advance(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

func newClock() *clock { return &clock{t: time.Unix(1_700_000_000, 0)} }

func tb(name string, capacity int64, rate float64) *limiter.Zone {
	z := &limiter.Zone{Name: name, Algorithm: limiter.TokenBucket, Capacity: capacity, RefillRate: rate}
	return z
}

func sw(name string, limit int64, window time.Duration) *limiter.Zone {
	return &limiter.Zone{Name: name, Algorithm: limiter.SlidingWindow, Limit: limit, Window: window}
}

func allow(t *testing.T, l *limiter.Limiter, reqs ...limiter.Request) limiter.Decision {
	t.Helper()
	for _, r := range reqs {
		if err := r.Zone.Validate(); err != nil {
			t.Fatalf("zone: %v", err)
		}
	}
	d, err := l.Decide(context.Background(), reqs) // as the handler decides
	if err != nil {
		t.Fatalf("Decide: %v", err)
	}
	return d
}

func want(t *testing.T, step string, got, want limiter.Decision) {
	t.Helper()
	if got != want {
		t.Fatalf("%s:\n got %+v\nwant %+v", step, got, want)
	}
}

func TestTokenBucketArithmetic(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := tb("api", 10, 2) // 10 tokens, 2 tokens/s: one token per 500ms
	req := limiter.Request{Zone: z, Key: "alice", Cost: 1}

	for i := int64(1); i <= 10; i++ {
		want(t, "request "+strconv.FormatInt(i, 10), allow(t, l, req), limiter.Decision{
			Allowed: true, Limit: 10, Remaining: 10 - i, Reset: time.Duration(i) * 500 * time.Millisecond, Next: 500 * time.Millisecond,
		})
	}
	want(t, "11th request, bucket empty", allow(t, l, req), limiter.Decision{
		Limit: 10, Remaining: 0, RetryAfter: 500 * time.Millisecond, Reset: 5 * time.Second, Next: 500 * time.Millisecond,
	})
	clk.Advance(250 * time.Millisecond) // 0.5 tokens
	want(t, "half a token", allow(t, l, req), limiter.Decision{
		Limit: 10, Remaining: 0, RetryAfter: 250 * time.Millisecond, Reset: 4750 * time.Millisecond, Next: 250 * time.Millisecond,
	})
	clk.Advance(250 * time.Millisecond) // 1 token
	want(t, "one token refilled", allow(t, l, req), limiter.Decision{
		Allowed: true, Limit: 10, Remaining: 0, Reset: 5 * time.Second, Next: 500 * time.Millisecond,
	})
	// A denied request changes nothing: the bucket is where the last admission left it.
	if got := srv.Do("HGET", "rl:{alice}:api:tb", "u"); got != "10" {
		t.Fatalf("tokens after refill and spend = %v, want 0", got)
	}

	clk.Advance(time.Hour) // far beyond full: never above capacity
	want(t, "after an hour", allow(t, l, req), limiter.Decision{
		Allowed: true, Limit: 10, Remaining: 9, Reset: 500 * time.Millisecond, Next: 500 * time.Millisecond,
	})

	// Cost: 9 tokens left, cost 4 twice, then 1 left and cost 4 denied: 3 tokens missing = 1.5s.
	big := limiter.Request{Zone: z, Key: "alice", Cost: 4}
	want(t, "cost 4", allow(t, l, big), limiter.Decision{Allowed: true, Limit: 10, Remaining: 5, Reset: 2500 * time.Millisecond, Next: 500 * time.Millisecond})
	want(t, "cost 4 again", allow(t, l, big), limiter.Decision{Allowed: true, Limit: 10, Remaining: 1, Reset: 4500 * time.Millisecond, Next: 500 * time.Millisecond})
	want(t, "cost 4 denied", allow(t, l, big), limiter.Decision{Limit: 10, Remaining: 1, RetryAfter: 1500 * time.Millisecond, Reset: 4500 * time.Millisecond, Next: 500 * time.Millisecond})

	// Another client has its own full bucket.
	want(t, "bob", allow(t, l, limiter.Request{Zone: z, Key: "bob", Cost: 1}), limiter.Decision{
		Allowed: true, Limit: 10, Remaining: 9, Reset: 500 * time.Millisecond, Next: 500 * time.Millisecond,
	})
}

func TestTokenBucketFractionalRefill(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := tb("slow", 1, 100.0/60) // 100 per minute: one token per 600ms
	req := limiter.Request{Zone: z, Key: "k", Cost: 1}
	allow(t, l, req)
	for i := 0; i < 20; i++ { // 20 × 599ms denied, then the 600th ms admits: fractions are kept
		clk.Advance(599 * time.Millisecond)
		if d := allow(t, l, req); d.Allowed {
			t.Fatalf("round %d: admitted 599ms after the last admission", i)
		}
		clk.Advance(time.Millisecond)
		if d := allow(t, l, req); !d.Allowed {
			t.Fatalf("round %d: denied 600ms after the last admission: %+v", i, d)
		}
	}
}

func TestTokenBucketTTL(t *testing.T) {
	// Not parallel: it bounds a PTTL to 100ms of real time.
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := tb("api", 10, 2)
	allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 3}) // 7 left: full again in 1.5s
	pttl := srv.Do("PTTL", "rl:{alice}:api:tb").(int64)
	if pttl <= 1400 || pttl > 1500 {
		t.Fatalf("PTTL = %dms, want the 1500ms until the bucket is full (less what elapsed)", pttl)
	}
}

func TestSlidingWindowArithmetic(t *testing.T) {
	// Not parallel: it bounds a PTTL to 100ms of real time.
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := sw("login", 3, 10*time.Second)
	req := limiter.Request{Zone: z, Key: "alice", Cost: 1}

	want(t, "t=0", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 3, Remaining: 2, Reset: 10 * time.Second, Next: 10 * time.Second})
	clk.Advance(time.Second)
	want(t, "t=1s", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 3, Remaining: 1, Reset: 10 * time.Second, Next: 9 * time.Second})
	clk.Advance(time.Second)
	want(t, "t=2s", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 3, Remaining: 0, Reset: 10 * time.Second, Next: 8 * time.Second})
	clk.Advance(time.Second)
	// Full: the entry of t=0 leaves at t=10s; the newest (t=2s) at t=12s.
	want(t, "t=3s denied", allow(t, l, req), limiter.Decision{Limit: 3, Remaining: 0, RetryAfter: 7 * time.Second, Reset: 9 * time.Second, Next: 7 * time.Second})
	// Cost 2 needs two entries gone: the second oldest (t=1s) leaves at t=11s.
	want(t, "t=3s cost 2", allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 2}),
		limiter.Decision{Limit: 3, Remaining: 0, RetryAfter: 8 * time.Second, Reset: 9 * time.Second, Next: 7 * time.Second})
	clk.Advance(7*time.Second - time.Microsecond)
	want(t, "1µs before t=10s", allow(t, l, req), limiter.Decision{Limit: 3, Remaining: 0, RetryAfter: time.Microsecond, Reset: 2*time.Second + time.Microsecond, Next: time.Microsecond})
	clk.Advance(time.Microsecond)
	want(t, "t=10s", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 3, Remaining: 0, Reset: 10 * time.Second, Next: time.Second})
	if n := srv.Do("ZCARD", "rl:{alice}:login:sw"); n != int64(3) {
		t.Fatalf("ZCARD = %v, want 3: the expired entry must be gone and denials must add nothing", n)
	}
	pttl := srv.Do("PTTL", "rl:{alice}:login:sw").(int64)
	if pttl <= 9900 || pttl > 10000 {
		t.Fatalf("PTTL = %dms, want the 10s until the newest entry leaves the window", pttl)
	}
}

func TestSlidingWindowSameMicrosecondCountsTwice(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock() // never advanced: every request has the same timestamp
	a := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	b := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := sw("w", 5, time.Minute)
	for i, l := range []*limiter.Limiter{a, b, a, b} {
		if d := allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 1}); !d.Allowed || d.Remaining != int64(4-i) {
			t.Fatalf("request %d: %+v, want allowed with %d remaining", i, d, 4-i)
		}
	}
	if d := allow(t, a, limiter.Request{Zone: z, Key: "k", Cost: 2}); d.Allowed {
		t.Fatalf("cost 2 with 1 slot left was admitted")
	}
	if n := srv.Do("ZCARD", "rl:{k}:w:sw"); n != int64(4) {
		t.Fatalf("ZCARD = %v, want 4 entries for 4 requests in one microsecond", n)
	}
}

func TestMultiZoneAllOrNothing(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	api := tb("api", 5, 1)
	login := sw("login", 2, time.Minute)
	reqs := []limiter.Request{{Zone: api, Key: "alice", Cost: 1}, {Zone: login, Key: "alice", Cost: 1}}

	// Allowed: the deciding zone is the one with the least remaining share (login: 1/2 < api: 4/5).
	want(t, "first", allow(t, l, reqs...), limiter.Decision{Allowed: true, Zone: 1, Limit: 2, Remaining: 1, Reset: time.Minute, Next: time.Minute})
	want(t, "second", allow(t, l, reqs...), limiter.Decision{Allowed: true, Zone: 1, Limit: 2, Remaining: 0, Reset: time.Minute, Next: time.Minute})
	for i := 0; i < 3; i++ {
		want(t, "denied by login", allow(t, l, reqs...), limiter.Decision{Zone: 1, Limit: 2, Remaining: 0, RetryAfter: time.Minute, Reset: time.Minute, Next: time.Minute})
	}
	// The three denials charged api nothing: 3 of 5 tokens left.
	if got := srv.Do("HGET", "rl:{alice}:api:tb", "u"); got != "2" {
		t.Fatalf("api tokens = %v, want 3 (a denial by login must not charge api)", got)
	}
	// And the reverse: api denies, login is not charged.
	clk.Advance(time.Minute) // login empty again; api refilled to 5
	reqs[0].Cost = 6         // more than capacity 5: unsatisfiable
	want(t, "unsatisfiable", allow(t, l, reqs...), limiter.Decision{Zone: 0, Limit: 5, Remaining: 5, Reset: 0, Unsatisfiable: true})
	// Entries of the last minute (the two of t0 have left the window; a denial removes nothing).
	if n := srv.Do("ZCOUNT", "rl:{alice}:login:sw", "(1700000000000000", "+inf"); n != int64(0) {
		t.Fatalf("login entries = %v, want 0 (a denial by api must not charge login)", n)
	}
}

func TestDenyingZoneWithLongestWaitDecides(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	short := tb("short", 1, 1)  // refills in 1s
	long := tb("long", 1, 0.1)  // refills in 10s
	free := tb("free", 100, 10) // never denies here
	reqs := []limiter.Request{{Zone: free, Key: "k", Cost: 1}, {Zone: short, Key: "k", Cost: 1}, {Zone: long, Key: "k", Cost: 1}}
	allow(t, l, reqs...)
	want(t, "both deny", allow(t, l, reqs...), limiter.Decision{Zone: 2, Limit: 1, RetryAfter: 10 * time.Second, Reset: 10 * time.Second, Next: 10 * time.Second})
}

func TestKeySanitising(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	z := tb("z", 10, 1)
	huge := strings.Repeat("a", 10_000)
	hostile := []string{huge, huge + "b", "}{evil}{", "{", "ключ", "a b", "nul\x00byte", "crlf\r\nx", ""}
	for _, k := range hostile {
		allow(t, l, limiter.Request{Zone: z, Key: k, Cost: 1})
	}
	keys, err := srv.Client().Keys(context.Background(), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != len(hostile) {
		t.Fatalf("%d Redis keys for %d distinct client keys: %q", len(keys), len(hostile), keys)
	}
	for _, k := range keys {
		if len(k) > len("rl:{}:z:tb")+limiter.MaxClientKeyBytes {
			t.Errorf("key %q is %d bytes long", k, len(k))
		}
		if strings.Count(k, "{") != 1 || strings.Count(k, "}") != 1 || !strings.HasPrefix(k, "rl:{") || !strings.HasSuffix(k, "}:z:tb") {
			t.Errorf("key %q escapes its hash tag", k)
		}
	}
	// Verbatim keys stay readable; the empty key is the zone's shared key.
	for raw, want := range map[string]string{"203.0.113.9": "203.0.113.9", "user@example.com": "user@example.com", "": "~empty", "::1": "::1"} {
		if got := limiter.ClientKey(raw); got != want {
			t.Errorf("ClientKey(%q) = %q, want %q", raw, got, want)
		}
	}
	if got := limiter.ClientKey(strings.Repeat("x", 65)); len(got) != 44 || got[0] != '~' {
		t.Errorf("ClientKey of 65 bytes = %q, want a 44-byte digest", got)
	}
}

func TestNoScriptAfterScriptFlush(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	req := limiter.Request{Zone: tb("z", 3, 1), Key: "k", Cost: 1}
	allow(t, l, req)
	sha := fmt.Sprintf("%x", sha1.Sum([]byte(lua.Decide)))
	exists := func() int64 { return srv.Do("SCRIPT", "EXISTS", sha).([]any)[0].(int64) }
	if exists() != 1 {
		t.Fatal("the script is not in the Redis script cache after a decision")
	}
	srv.Do("SCRIPT", "FLUSH")
	if exists() != 0 {
		t.Fatal("SCRIPT FLUSH left the script cached")
	}
	want(t, "after SCRIPT FLUSH", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 3, Remaining: 1, Reset: 2 * time.Second, Next: time.Second})
	if exists() != 1 {
		t.Fatal("the script was not loaded again after NOSCRIPT")
	}
}

func TestRedisClockByDefault(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	z := tb("z", 2, 0.001)
	req := limiter.Request{Zone: z, Key: "k", Cost: 1}
	allow(t, l, req)
	allow(t, l, req)
	d := allow(t, l, req)
	if d.Allowed || d.RetryAfter <= 990*time.Second || d.RetryAfter > 1000*time.Second {
		t.Fatalf("third request: %+v, want denied with about 1000s to wait", d)
	}
	ts, _ := strconv.ParseInt(srv.Do("HGET", "rl:{k}:z:tb", "ts").(string), 10, 64)
	redisNow := srv.Client().Time(context.Background()).Val()
	if diff := redisNow.Sub(time.UnixMicro(ts)); diff < 0 || diff > 10*time.Second {
		t.Fatalf("bucket time %v is not the Redis server's clock %v", time.UnixMicro(ts), redisNow)
	}
}

func TestRedisDownIsAnError(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1})
	defer c.Close()
	l := limiter.New(c, limiter.Options{KeyPrefix: "rl:"})
	srv.Stop()
	_, err := l.Allow(context.Background(), []limiter.Request{{Zone: tb("z", 1, 1), Key: "k", Cost: 1}})
	if err == nil || errors.Is(err, limiter.ErrBadResponse) {
		t.Fatalf("Allow with Redis down: err = %v, want a connection error", err)
	}
}

// TestExactUnderConcurrency is the core promise: 8 instances (separate clients and pools) racing
// 2,000 requests for one key admit exactly the quota, for every algorithm, with and without the
// deny cache, and with decisions sent one by one or batched.
func TestExactUnderConcurrency(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	noRefill := 100 / (limiter.MaxWindow.Seconds() / 2) // one token per 1.8 days: none during the test
	for _, tc := range []struct {
		zone       *limiter.Zone
		denyCache  int
		roundTrips int
	}{
		{tb("bucket", 100, noRefill), 0, 0},
		{sw("window", 100, time.Hour), 0, 0},
		{tb("bucket-cached", 100, noRefill), limiter.DefaultDenyCacheKeys, 0},
		{sw("window-cached", 100, time.Hour), limiter.DefaultDenyCacheKeys, 0},
		{tb("bucket-pipelined", 100, noRefill), limiter.DefaultDenyCacheKeys, 4},
		{sw("window-pipelined", 100, time.Hour), 0, 4},
		{fw("fixed-monthly", 100, limiter.Month, nil), limiter.DefaultDenyCacheKeys, 4}, // a month: no window starts during the test
		{sc("counter", 100, time.Hour), limiter.DefaultDenyCacheKeys, 4},
	} {
		z := tc.zone
		t.Run(z.Name, func(t *testing.T) {
			const instances, requests = 8, 2000
			ls := make([]*limiter.Limiter, instances)
			for i := range ls {
				c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 32})
				t.Cleanup(func() { _ = c.Close() })
				opts := limiter.Options{KeyPrefix: "rl:", DenyCacheKeys: tc.denyCache}
				if tc.roundTrips > 0 {
					opts.Batcher = limiter.NewBatcher(c, tc.roundTrips)
					t.Cleanup(opts.Batcher.Close)
				}
				ls[i] = limiter.New(c, opts)
			}
			var admitted, failed atomic.Int64
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := 0; i < requests; i++ {
				wg.Add(1)
				go func(l *limiter.Limiter) {
					defer wg.Done()
					<-start
					reqs := []limiter.Request{{Zone: z, Key: "shared", Cost: 1}}
					if d, ok := l.Denied(reqs); ok && !d.Allowed {
						return
					}
					d, err := l.Allow(context.Background(), reqs)
					if err != nil {
						failed.Add(1)
						return
					}
					if d.Allowed {
						admitted.Add(1)
					}
				}(ls[i%instances])
			}
			close(start)
			wg.Wait()
			if failed.Load() != 0 || admitted.Load() != 100 {
				t.Fatalf("admitted %d of %d with %d errors, want exactly 100 and no errors", admitted.Load(), requests, failed.Load())
			}
		})
	}
}

// TestBatcherScriptFlushAndStall: decisions sent through a Batcher load the script again after
// SCRIPT FLUSH, and with Redis stalled every decision ends with a timeout error.
func TestBatcherScriptFlushAndStall(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true}) // as the module's client
	t.Cleanup(func() { _ = c.Close() })
	p := limiter.NewBatcher(c, 2)
	t.Cleanup(p.Close)
	l := limiter.New(c, limiter.Options{KeyPrefix: "rl:", Now: clk.Now, Batcher: p})
	req := limiter.Request{Zone: tb("z", 3, 1), Key: "k", Cost: 1}
	allow(t, l, req)
	srv.Do("SCRIPT", "FLUSH")
	want(t, "after SCRIPT FLUSH", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 3, Remaining: 1, Reset: 2 * time.Second, Next: time.Second})

	srv.Pause()
	defer srv.Resume()
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancel()
			_, errs[i] = l.Allow(ctx, []limiter.Request{req})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		// The context's deadline, or the socket deadline go-redis set from it.
		var ne net.Error
		if !errors.Is(err, context.DeadlineExceeded) && !(errors.As(err, &ne) && ne.Timeout()) {
			t.Errorf("decision %d with Redis stalled: err = %v, want a timeout", i, err)
		}
	}
}

// batchSizes is a go-redis hook that records how many decisions each decide.lua call carried
// (one zone per decision in TestBatchesAreExact: the number of keys).
type batchSizes struct {
	mu    sync.Mutex
	sizes []int
}

func (h *batchSizes) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *batchSizes) record(cmd redis.Cmder) {
	if a := cmd.Args(); len(a) > 2 && (a[0] == "evalsha" || a[0] == "eval") {
		n, _ := strconv.Atoi(fmt.Sprint(a[2]))
		h.mu.Lock()
		h.sizes = append(h.sizes, n)
		h.mu.Unlock()
	}
}
func (h *batchSizes) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { h.record(cmd); return next(ctx, cmd) }
}
func (h *batchSizes) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			h.record(c)
		}
		return next(ctx, cmds)
	}
}

// TestBatchesAreExact: 2,000 concurrent decisions for 50 clients through one Batcher share
// script calls (some carry 10 decisions or more: batching is measured, not assumed), and each
// client gets exactly its capacity, for every algorithm.
func TestBatchesAreExact(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	noRefill := 20 / (limiter.MaxWindow.Seconds() / 2)
	for _, z := range []*limiter.Zone{tb("bucket", 20, noRefill), sw("window", 20, time.Hour), fw("fixed", 20, limiter.Month, nil), sc("counter", 20, time.Hour)} {
		t.Run(z.Name, func(t *testing.T) {
			rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 8, ContextTimeoutEnabled: true})
			t.Cleanup(func() { _ = rdb.Close() })
			sizes := &batchSizes{}
			rdb.AddHook(sizes)
			p := limiter.NewBatcher(rdb, 2)
			t.Cleanup(p.Close)
			l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Batcher: p})
			admitted := make([]atomic.Int64, 50)
			var failed atomic.Int64
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range 2000 {
				wg.Go(func() {
					<-start
					d, err := l.Allow(context.Background(), []limiter.Request{{Zone: z, Key: "client-" + strconv.Itoa(i%50), Cost: 1}})
					if err != nil {
						failed.Add(1)
					} else if d.Allowed {
						admitted[i%50].Add(1)
					}
				})
			}
			close(start)
			wg.Wait()
			if failed.Load() > 0 {
				t.Fatalf("%d decisions failed", failed.Load())
			}
			for c := range admitted {
				if n := admitted[c].Load(); n != 20 {
					t.Fatalf("client-%d: %d admitted, want exactly its capacity 20", c, n)
				}
			}
			big, most := 0, 0
			for _, n := range sizes.sizes {
				most = max(most, n)
				if n >= 10 {
					big++
				}
			}
			t.Logf("%d decisions in %d script calls (%.1f per call); %d calls carried 10 or more, the largest %d",
				2000, len(sizes.sizes), 2000/float64(len(sizes.sizes)), big, most)
			if big == 0 {
				t.Fatalf("no script call carried 10 decisions or more (largest %d): no batching", most)
			}
		})
	}
}

// TestBatcherRepliesReachTheirCallers checks that a decision gets its own reply when the
// batcher's calls are used again (they are pooled) while others time out and are abandoned:
// every decision is the first of its own key and cost, so its Remaining names the cost it was
// decided for; a reply meant for another caller would show another's cost.
func TestBatcherRepliesReachTheirCallers(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 8, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	p := limiter.NewBatcher(rdb, 2)
	t.Cleanup(p.Close)
	l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Batcher: p})
	z := tb("bucket", 100, 1)
	var answered, abandoned atomic.Int64
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 150 {
				cost := int64(1 + (g*7+i)%99)
				ctx, cancel := context.Background(), context.CancelFunc(func() {})
				if i%3 == 0 { // a third give up almost at once, mid-flight or before
					ctx, cancel = context.WithTimeout(ctx, time.Duration(i%5)*50*time.Microsecond)
				}
				d, err := l.Allow(ctx, []limiter.Request{{Zone: z, Key: fmt.Sprintf("g%d-%d", g, i), Cost: cost}})
				cancel()
				switch {
				case err != nil && i%3 == 0:
					abandoned.Add(1)
				case err != nil:
					t.Errorf("decision %d-%d: %v", g, i, err)
				case !d.Allowed || d.Remaining != 100-cost:
					t.Errorf("decision %d-%d of cost %d: allowed %v, remaining %d, want allowed with %d: another call's reply",
						g, i, cost, d.Allowed, d.Remaining, 100-cost)
				default:
					answered.Add(1)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d answered, %d abandoned", answered.Load(), abandoned.Load())
	if abandoned.Load() == 0 {
		t.Fatal("no decision was abandoned: the test did not exercise abandoned calls")
	}
}
