package limiter_test

import (
	"context"
	"math/rand/v2"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

func fw(name string, limit int64, period limiter.Period, loc *time.Location) *limiter.Zone {
	return &limiter.Zone{Name: name, Algorithm: limiter.FixedWindow, Limit: limit, Period: period, Location: loc}
}

func sc(name string, limit int64, window time.Duration) *limiter.Zone {
	return &limiter.Zone{Name: name, Algorithm: limiter.SlidingWindowCounter, Limit: limit, Window: window}
}

func mustLoad(t *testing.T, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Fatal(err)
	}
	return loc
}

// TestWindowAtBoundaries pins the calendar windows: month ends, a leap day, weeks from Monday,
// and daylight saving changes in a named zone (a 23-hour and a 25-hour day, a repeated hour).
func TestWindowAtBoundaries(t *testing.T) {
	paris, newYork := mustLoad(t, "Europe/Paris"), mustLoad(t, "America/New_York")
	utc := func(s string) time.Time {
		v, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for _, c := range []struct {
		zone       *limiter.Zone
		at         string
		start, end string
	}{
		{fw("m", 1, limiter.Month, nil), "2027-01-31T23:59:59.999999Z", "2027-01-01T00:00:00Z", "2027-02-01T00:00:00Z"},
		{fw("m", 1, limiter.Month, nil), "2027-02-01T00:00:00Z", "2027-02-01T00:00:00Z", "2027-03-01T00:00:00Z"},
		{fw("m", 1, limiter.Month, nil), "2028-02-15T12:00:00Z", "2028-02-01T00:00:00Z", "2028-03-01T00:00:00Z"}, // leap year: 29 days
		{fw("d", 1, limiter.Day, nil), "2028-02-29T23:59:59Z", "2028-02-29T00:00:00Z", "2028-03-01T00:00:00Z"},   // the leap day
		{fw("w", 1, limiter.Week, nil), "2026-11-22T23:00:00Z", "2026-11-16T00:00:00Z", "2026-11-23T00:00:00Z"},  // a Sunday
		{fw("w", 1, limiter.Week, nil), "2026-11-23T00:00:00Z", "2026-11-23T00:00:00Z", "2026-11-30T00:00:00Z"},  // the Monday
		{fw("h", 1, limiter.Hour, nil), "2026-11-23T12:34:56Z", "2026-11-23T12:00:00Z", "2026-11-23T13:00:00Z"},
		// Paris: the spring change (2026-03-29, 02:00 CET -> 03:00 CEST) makes a 23-hour day,
		// the autumn change (2026-10-25, 03:00 CEST -> 02:00 CET) a 25-hour day.
		{fw("d", 1, limiter.Day, paris), "2026-03-29T12:00:00Z", "2026-03-28T23:00:00Z", "2026-03-29T22:00:00Z"},
		{fw("d", 1, limiter.Day, paris), "2026-10-25T12:00:00Z", "2026-10-24T22:00:00Z", "2026-10-25T23:00:00Z"},
		{fw("m", 1, limiter.Month, paris), "2026-10-31T23:30:00Z", "2026-10-31T23:00:00Z", "2026-11-30T23:00:00Z"}, // already November there
		// New York repeats 01:00-02:00 on 2026-11-01: each of the two hours is its own window.
		{fw("h", 1, limiter.Hour, newYork), "2026-11-01T05:30:00Z", "2026-11-01T05:00:00Z", "2026-11-01T06:00:00Z"}, // 01:30 EDT
		{fw("h", 1, limiter.Hour, newYork), "2026-11-01T06:30:00Z", "2026-11-01T06:00:00Z", "2026-11-01T07:00:00Z"}, // 01:30 EST
		{&limiter.Zone{Name: "x", Algorithm: limiter.FixedWindow, Limit: 1, Window: 90 * time.Minute}, "2026-11-23T00:10:00Z", "2026-11-23T00:00:00Z", "2026-11-23T01:30:00Z"},
	} {
		start, end := c.zone.WindowAt(utc(c.at))
		if !start.Equal(utc(c.start)) || !end.Equal(utc(c.end)) {
			t.Errorf("%s %v at %s: [%s, %s), want [%s, %s)", c.zone.Period, c.zone.Location, c.at,
				start.UTC().Format(time.RFC3339), end.UTC().Format(time.RFC3339), c.start, c.end)
		}
	}
}

// TestFixedWindowArithmetic: a fixed window admits its limit, denies with the time to the
// window's end, and starts again at 0 when the next window starts, whatever its length (a
// leap-year February, a 23-hour day).
func TestFixedWindowArithmetic(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	paris := mustLoad(t, "Europe/Paris")
	for _, c := range []struct {
		zone *limiter.Zone
		end  time.Time // of the window holding the first request, a second before it ends
	}{
		{fw("daily", 3, limiter.Day, nil), time.Date(2028, 2, 29, 0, 0, 0, 0, time.UTC).Add(24 * time.Hour)},
		{fw("monthly", 3, limiter.Month, nil), time.Date(2028, 3, 1, 0, 0, 0, 0, time.UTC)},
		{fw("paris", 3, limiter.Day, paris), time.Date(2026, 3, 30, 0, 0, 0, 0, paris)},
	} {
		t.Run(c.zone.Name, func(t *testing.T) {
			clk := &clock{t: c.end.Add(-time.Second)}
			l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
			req := limiter.Request{Zone: c.zone, Key: "k", Cost: 1}
			for i := int64(1); i <= 3; i++ {
				want(t, "request "+strconv.FormatInt(i, 10), allow(t, l, req), limiter.Decision{
					Allowed: true, Limit: 3, Remaining: 3 - i, Reset: time.Second, Next: time.Second,
				})
			}
			want(t, "4th", allow(t, l, req), limiter.Decision{Limit: 3, RetryAfter: time.Second, Reset: time.Second, Next: time.Second})
			want(t, "cost 4", allow(t, l, limiter.Request{Zone: c.zone, Key: "k", Cost: 4}),
				limiter.Decision{Limit: 3, Reset: time.Second, Next: time.Second, Unsatisfiable: true})
			clk.Advance(time.Second - time.Microsecond)
			want(t, "1µs before the end", allow(t, l, req), limiter.Decision{Limit: 3, RetryAfter: time.Microsecond, Reset: time.Microsecond, Next: time.Microsecond})
			clk.Advance(time.Microsecond)
			_, next := c.zone.WindowAt(clk.Now())
			left := next.Sub(clk.Now())
			want(t, "the next window", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 3, Remaining: 2, Reset: left, Next: left})
		})
	}
}

// TestFixedWindowExactAcrossInstances: 3 instances race 1,536 requests of one client on a limit
// of 50 per UTC day (the Redis server's clock): exactly 50 pass, and every 429's Retry-After is
// the time until the next UTC midnight.
func TestFixedWindowExactAcrossInstances(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	z := fw("quota", 50, limiter.Day, nil)
	// Not across a midnight: the count would start again in the middle of the test.
	if left := time.Until(time.Now().UTC().Truncate(24 * time.Hour).Add(24 * time.Hour)); left < 10*time.Second {
		time.Sleep(left + time.Second)
	}
	ls := make([]*limiter.Limiter, 3)
	for i := range ls {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 32})
		t.Cleanup(func() { _ = c.Close() })
		p := limiter.NewBatcher(c, 4)
		t.Cleanup(p.Close)
		ls[i] = limiter.New(c, limiter.Options{KeyPrefix: "rl:", Batcher: p, DenyCacheKeys: 100})
	}
	var admitted, failed atomic.Int64
	var mu sync.Mutex
	var retries []time.Duration
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := 0; i < 1536; i++ {
		wg.Go(func() {
			<-start
			l := ls[i%3]
			reqs := []limiter.Request{{Zone: z, Key: "customer", Cost: 1}}
			d, ok := l.Denied(reqs)
			if !ok {
				var err error
				if d, err = l.Allow(context.Background(), reqs); err != nil {
					failed.Add(1)
					return
				}
			}
			if d.Allowed {
				admitted.Add(1)
				return
			}
			mu.Lock()
			retries = append(retries, d.RetryAfter)
			mu.Unlock()
		})
	}
	close(start)
	wg.Wait()
	redisNow := srv.Client().Time(context.Background()).Val()
	if admitted.Load() != 50 || failed.Load() != 0 {
		t.Fatalf("admitted %d with %d errors, want exactly 50", admitted.Load(), failed.Load())
	}
	midnight := redisNow.UTC().Truncate(24 * time.Hour).Add(24 * time.Hour)
	for _, r := range retries {
		if diff := midnight.Sub(redisNow) - r; diff < -time.Second || diff > time.Second {
			t.Fatalf("Retry-After %v, want the %v until the next UTC midnight (±1s)", r, midnight.Sub(redisNow))
		}
	}
}

// TestFixedWindowFollowsTheScriptClock: of the three windows the instance computes around its
// own clock, the script takes the one that holds its own (the Redis server's) time, so a skew
// of less than a window never puts a request in the wrong window.
func TestFixedWindowFollowsTheScriptClock(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	decide := redis.NewScript(lua.Decide)
	for _, c := range []struct{ now, start int64 }{{50, 0}, {150, 100}, {250, 200}} {
		key := "rl:{k}:skew:fw"
		srv.Do("DEL", key)
		reply, err := decide.Run(context.Background(), srv.Client(), []string{key}, c.now, "n", "0", 1, "fw", 5, "0,100,200,300", 1, "").Int64Slice()
		if err != nil || reply[0] != 1 {
			t.Fatalf("now %d: %v, %v", c.now, reply, err)
		}
		mark := strconv.FormatFloat(float64(c.start)/1e6, 'f', 6, 64) // not a whole second, but 0
		if c.start == 0 {
			mark = "0"
		}
		if got := srv.Do("GET", key); got != mark+":1" {
			t.Fatalf("now %d: stored %v, want the window of %dµs", c.now, got, c.start)
		}
		if reply[4] != 100-(c.now-c.start) { // reset: the window's end
			t.Fatalf("now %d: reset %dµs, want %d", c.now, reply[4], 100-(c.now-c.start))
		}
	}
}

// TestSlidingWindowCounterArithmetic: the estimate weighs the previous window by its share still
// inside the sliding window.
func TestSlidingWindowCounterArithmetic(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := &clock{t: time.Unix(1_700_000_000, 0)} // a multiple of 10s: a window starts here
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := sc("api", 10, 10*time.Second)
	req := limiter.Request{Zone: z, Key: "k", Cost: 1}
	for i := 0; i < 10; i++ {
		if d := allow(t, l, req); !d.Allowed {
			t.Fatalf("request %d: %+v", i, d)
		}
	}
	// Full: the previous window will weigh 10 × (1 - 1/10) = 9 one second into the next.
	want(t, "11th", allow(t, l, req), limiter.Decision{Limit: 10, RetryAfter: 11 * time.Second, Reset: 20 * time.Second, Next: 11 * time.Second})
	clk.Advance(10 * time.Second) // the next window: estimate 10
	want(t, "window 2, t=0", allow(t, l, req), limiter.Decision{Limit: 10, RetryAfter: time.Second, Reset: 10 * time.Second, Next: time.Second})
	clk.Advance(5 * time.Second) // estimate 5
	want(t, "t=5s", allow(t, l, req), limiter.Decision{Allowed: true, Limit: 10, Remaining: 4, Reset: 15 * time.Second, Next: time.Second})
	if n := srv.Do("MEMORY", "USAGE", limiter.StateKey("rl:", z, "k")).(int64); n > 100 {
		t.Fatalf("MEMORY USAGE %d bytes, want under 100", n)
	}
}

// TestSlidingWindowCounterErrorBound measures the counter against the exact sliding window log
// on the same bursty request stream: the counter never lets more than 2 × limit requests into
// any sliding window (its documented bound), and the figures are logged for docs/decisions.md.
func TestSlidingWindowCounterErrorBound(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := &clock{t: time.Unix(1_700_000_000, 0)}
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	const limit, window = 100, 10 * time.Second
	log, counter := sw("log", limit, window), sc("counter", limit, window)
	rng := rand.New(rand.NewPCG(1, 2))
	var logTimes, counterTimes []time.Time
	end := clk.Now().Add(5 * time.Minute)
	for clk.Now().Before(end) {
		// Bursts: quiet gaps of up to 15s, then up to 300 requests within a second.
		clk.Advance(time.Duration(rng.Int64N(int64(15 * time.Second))))
		for range rng.IntN(300) {
			clk.Advance(time.Duration(rng.Int64N(int64(3 * time.Millisecond))))
			if mustAllow(t, l, limiter.Request{Zone: log, Key: "k", Cost: 1}).Allowed {
				logTimes = append(logTimes, clk.Now())
			}
			if mustAllow(t, l, limiter.Request{Zone: counter, Key: "k", Cost: 1}).Allowed {
				counterTimes = append(counterTimes, clk.Now())
			}
		}
	}
	worstLog, worstCounter := maxInWindow(logTimes, window), maxInWindow(counterTimes, window)
	t.Logf("sliding log admitted %d, counter %d (%+.1f%%); most in any %v: log %d, counter %d (limit %d)",
		len(logTimes), len(counterTimes), 100*float64(len(counterTimes)-len(logTimes))/float64(len(logTimes)),
		window, worstLog, worstCounter, limit)
	if worstLog > limit {
		t.Fatalf("the sliding log let %d into one window, limit %d", worstLog, limit)
	}
	if worstCounter > 2*limit {
		t.Fatalf("the counter let %d into one window, above its bound 2 × %d", worstCounter, limit)
	}
}

// maxInWindow is the most times (sorted) within any half-open span of length w: (t - w, t].
func maxInWindow(times []time.Time, w time.Duration) int {
	sort.Slice(times, func(i, j int) bool { return times[i].Before(times[j]) })
	best, lo := 0, 0
	for hi := range times {
		for !times[lo].After(times[hi].Add(-w)) {
			lo++
		}
		best = max(best, hi-lo+1)
	}
	return best
}

// TestCounterMemoryPerClient: 100,000 clients on a monthly quota of 1,000,000, a few requests
// each: every client is one small hash, whatever the limit.
func TestCounterMemoryPerClient(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client()
	z := fw("monthly", 1_000_000, limiter.Month, nil)
	ctx := context.Background()
	const clients = 100_000
	p := limiter.NewBatcher(rdb, 8)
	t.Cleanup(p.Close)
	lp := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Batcher: p})
	var wg sync.WaitGroup
	for w := 0; w < 16; w++ {
		wg.Go(func() {
			for i := w; i < clients; i += 16 {
				for range 1 + i%3 {
					if _, err := lp.Allow(ctx, []limiter.Request{{Zone: z, Key: "client-" + strconv.Itoa(i), Cost: 1}}); err != nil {
						t.Error(err)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	usage := srv.Do("MEMORY", "USAGE", limiter.StateKey("rl:", z, "client-99999")).(int64)
	keys := srv.Do("DBSIZE").(int64)
	t.Logf("%d keys; MEMORY USAGE of one client's fixed window key: %d bytes", keys, usage)
	if keys != clients || usage >= 100 {
		t.Fatalf("%d keys, %d bytes per key: want %d keys under 100 bytes", keys, usage, clients)
	}
}
