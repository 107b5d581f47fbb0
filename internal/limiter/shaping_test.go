package limiter_test

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// shaped is a token bucket zone with a max_wait.
func shaped(name string, capacity int64, rate float64, maxWait time.Duration) *limiter.Zone {
	z := tb(name, capacity, rate)
	z.MaxWait = maxWait
	return z
}

// TestShapingSchedule: capacity 10, refill 10/s, max_wait 2s, 31 requests at one instant: the
// first 10 pass at once; the next 20 are admitted in debt, each delayed 100ms more than the one
// before (the bucket's turn for it), remaining 0 and reset counting the debt; the 31st would
// wait 2.1s and is denied, charging nothing, with Retry-After the 100ms until it would be
// admitted (and held 2s). 100ms later, exactly that.
func TestShapingSchedule(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	req := limiter.Request{Zone: shaped("api", 10, 10, 2*time.Second), Key: "alice", Cost: 1}
	for i := int64(1); i <= 10; i++ {
		want(t, "request "+strconv.FormatInt(i, 10), allow(t, l, req), limiter.Decision{
			Allowed: true, Limit: 10, Remaining: 10 - i, Reset: time.Duration(i) * 100 * time.Millisecond, Next: 100 * time.Millisecond,
		})
	}
	for k := int64(1); k <= 20; k++ {
		step := time.Duration(k) * 100 * time.Millisecond
		want(t, "held request "+strconv.FormatInt(k, 10), allow(t, l, req), limiter.Decision{
			Allowed: true, Delay: step, Limit: 10, Remaining: 0, Reset: time.Second + step, Next: step + 100*time.Millisecond,
		})
	}
	denied := limiter.Decision{Limit: 10, RetryAfter: 100 * time.Millisecond, Reset: 3 * time.Second, Next: 2100 * time.Millisecond}
	want(t, "31st: a wait of 2.1s", allow(t, l, req), denied)
	want(t, "32nd: the same, nothing charged", allow(t, l, req), denied)
	st, err := l.State(context.Background(), req.Zone, "alice")
	if err != nil {
		t.Fatal(err)
	}
	if st.Tokens != -20 || st.Remaining != 0 || st.Wait != 2100*time.Millisecond || st.RetryAfter != 100*time.Millisecond {
		t.Fatalf("state in debt: %+v, want tokens -20, remaining 0, wait 2.1s, retry after 100ms", st)
	}
	clk.Advance(100 * time.Millisecond)
	want(t, "Retry-After later: admitted, held max_wait", allow(t, l, req), limiter.Decision{
		Allowed: true, Delay: 2 * time.Second, Limit: 10, Reset: 3 * time.Second, Next: 2100 * time.Millisecond,
	})
	clk.Advance(3 * time.Second)
	want(t, "the debt paid: a full bucket", allow(t, l, req), limiter.Decision{
		Allowed: true, Limit: 10, Remaining: 9, Reset: 100 * time.Millisecond, Next: 100 * time.Millisecond,
	})
}

// TestShapingNeverForAnUnsatisfiableCost: a cost above the capacity (or max_cost) is never
// admitted, even where the debt allowed by max_wait would cover it.
func TestShapingNeverForAnUnsatisfiableCost(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := shaped("api", 10, 10, time.Minute) // may owe 600 tokens
	capped := shaped("capped", 10, 10, time.Minute)
	capped.MaxCost = 5
	for _, r := range []limiter.Request{{Zone: z, Key: "k", Cost: 11}, {Zone: capped, Key: "k", Cost: 6}} {
		want(t, r.Zone.Name+" cost "+strconv.FormatInt(r.Cost, 10), allow(t, l, r), limiter.Decision{Limit: 10, Remaining: 10, Unsatisfiable: true})
	}
}

// TestShapingNoWait: a request decided with NoWait (the handler holds as many as it may) is
// admitted only if the bucket holds its cost now; its denial says when that is, and is not
// remembered by the deny cache, so that the next request, which may wait, is decided by Redis.
func TestShapingNoWait(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Minute})
	z := shaped("api", 2, 10, time.Second)
	noWait := limiter.Request{Zone: z, Key: "k", Cost: 1, NoWait: true}
	allow(t, l, noWait)
	allow(t, l, noWait)
	d := allow(t, l, noWait)
	want(t, "no wait, empty bucket", d, limiter.Decision{Limit: 2, RetryAfter: 100 * time.Millisecond, Reset: 200 * time.Millisecond, Next: 100 * time.Millisecond})
	calls := srv.ScriptCalls()
	want(t, "may wait: Redis holds it", allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 1}), limiter.Decision{
		Allowed: true, Delay: 100 * time.Millisecond, Limit: 2, Reset: 300 * time.Millisecond, Next: 200 * time.Millisecond,
	})
	if got := srv.ScriptCalls() - calls; got != 1 {
		t.Fatalf("%d script calls, want 1: a NoWait denial must not be cached", got)
	}
}

// TestShapingDenyCacheNeverHidesAWait: a denial of a shaping zone is cached only until the
// request would be admitted with a hold: the first request after it is decided by Redis and held.
func TestShapingDenyCacheNeverHidesAWait(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Minute})
	req := limiter.Request{Zone: shaped("api", 1, 1, 2*time.Second), Key: "k", Cost: 1}
	allow(t, l, req) // the token
	want(t, "held 1s", allow(t, l, req), limiter.Decision{Allowed: true, Delay: time.Second, Limit: 1, Reset: 2 * time.Second, Next: 2 * time.Second})
	want(t, "held 2s", allow(t, l, req), limiter.Decision{Allowed: true, Delay: 2 * time.Second, Limit: 1, Reset: 3 * time.Second, Next: 3 * time.Second})
	want(t, "a wait of 3s: denied", allow(t, l, req), limiter.Decision{Limit: 1, RetryAfter: time.Second, Reset: 3 * time.Second, Next: 3 * time.Second})
	clk.Advance(time.Second - time.Microsecond)
	want(t, "1µs before: from the cache", allow(t, l, req), limiter.Decision{
		Limit: 1, RetryAfter: time.Microsecond, Reset: 2*time.Second + time.Microsecond, Next: 2*time.Second + time.Microsecond, Cached: true,
	})
	clk.Advance(time.Microsecond)
	want(t, "then Redis: held max_wait", allow(t, l, req), limiter.Decision{Allowed: true, Delay: 2 * time.Second, Limit: 1, Reset: 3 * time.Second, Next: 3 * time.Second})
}

// TestShapingAllZonesOrNone: the longest delay of a request's zones applies, and its zone
// decides; a zone that denies leaves every other zone uncharged, the shaping ones included.
func TestShapingAllZonesOrNone(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	fast := shaped("fast", 1, 10, time.Second) // 100ms per token
	slow := shaped("slow", 1, 2, time.Second)  // 500ms per token
	plain := tb("plain", 4, 1e-3)
	reqs := []limiter.Request{{Zone: fast, Key: "k", Cost: 1}, {Zone: slow, Key: "k", Cost: 1}, {Zone: plain, Key: "k", Cost: 1}}
	want(t, "first: no wait", allow(t, l, reqs...), limiter.Decision{Allowed: true, Zone: 0, Limit: 1, Reset: 100 * time.Millisecond, Next: 100 * time.Millisecond})
	want(t, "second: slow's 500ms", allow(t, l, reqs...), limiter.Decision{Allowed: true, Delay: 500 * time.Millisecond, Zone: 1, Limit: 1, Reset: time.Second, Next: time.Second})
	want(t, "third: plain has 1 token left", allow(t, l, reqs...), limiter.Decision{Allowed: true, Delay: time.Second, Zone: 1, Limit: 1, Reset: 1500 * time.Millisecond, Next: 1500 * time.Millisecond})
	want(t, "fourth: slow would hold it 1.5s", allow(t, l, reqs...), limiter.Decision{Zone: 1, Limit: 1, RetryAfter: 500 * time.Millisecond, Reset: 1500 * time.Millisecond, Next: 1500 * time.Millisecond})
	// Nothing charged by the denial: fast owes 2 tokens (held 300ms from now), plain has 1 left.
	want(t, "fast alone", allow(t, l, reqs[0]), limiter.Decision{Allowed: true, Delay: 300 * time.Millisecond, Limit: 1, Reset: 400 * time.Millisecond, Next: 400 * time.Millisecond})
	if d := allow(t, l, reqs[2]); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("plain alone: %+v, want its last token", d)
	}
}

// TestShapingOnClusterAcrossSlots: zones of one request in different hash slots are decided per
// slot with token bucket holds, then committed (settle.lua): a shaping zone's hold is committed
// as debt, and the next request waits behind it.
func TestShapingOnClusterAcrossSlots(t *testing.T) {
	t.Parallel()
	cc := oneNodeCluster(t)
	clk := newClock()
	l := limiter.New(cc, limiter.Options{KeyPrefix: "rl:", Cluster: true, Now: clk.Now})
	a, b := shaped("a", 1, 10, time.Second), tb("b", 100, 1)
	reqs := []limiter.Request{{Zone: a, Key: "alice", Cost: 1}, {Zone: b, Key: "org1", Cost: 1}} // two slots
	mustAllow(t, l, reqs...)
	want(t, "second, held", mustAllow(t, l, reqs...), limiter.Decision{Allowed: true, Delay: 100 * time.Millisecond, Limit: 1, Reset: 200 * time.Millisecond, Next: 200 * time.Millisecond})
	want(t, "third, behind it", mustAllow(t, l, reqs...), limiter.Decision{Allowed: true, Delay: 200 * time.Millisecond, Limit: 1, Reset: 300 * time.Millisecond, Next: 300 * time.Millisecond})
	st, err := l.State(context.Background(), a, "alice")
	if err != nil || st.Tokens != -2 {
		t.Fatalf("zone a after two commits: %+v, %v; want -2 tokens (no hold left)", st, err)
	}
}

// TestShapingAcrossInstances is the proof, at the limiter: 3 instances (Limiters on
// separate Redis clients, on one clock the test holds still, so that no refill comes between
// the requests however slowly they reach Redis), one client, capacity 10, refill 1/s, max_wait 20s, 60
// requests at once. The first 10 are admitted with no delay, the next 20 with a delay each, the
// last 30 are denied: 30 admitted in all, whichever instance decided. Each held request's slot,
// its decision's time plus its delay (the decision ran between the call's sending and its
// reply), is the bucket's turn for one token: the times at which the final debt, drained at the
// refill rate, falls back to each of the 20 tokens owed, 1s apart, each taken exactly once.
func TestShapingAcrossInstances(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	z := shaped("api", 10, 1, 20*time.Second)
	var ls []*limiter.Limiter
	for range 3 {
		rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1})
		t.Cleanup(func() { _ = rdb.Close() })
		if err := rdb.Ping(context.Background()).Err(); err != nil { // connected before the burst
			t.Fatal(err)
		}
		ls = append(ls, limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Now: clk.Now}))
	}
	type result struct {
		instance   int
		d          limiter.Decision
		sent, recv time.Time
	}
	results := make([]result, 60)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range results {
		wg.Go(func() {
			<-start
			sent := clk.Now()
			d, err := ls[i%3].Allow(context.Background(), []limiter.Request{{Zone: z, Key: "alice", Cost: 1}})
			if err != nil {
				t.Error(err)
			}
			results[i] = result{i % 3, d, sent, clk.Now()}
		})
	}
	close(start)
	wg.Wait()
	var held []result
	now, denied, perInstance := 0, 0, [3]int{}
	for _, r := range results {
		switch {
		case !r.d.Allowed:
			denied++
			continue
		case r.d.Delay == 0:
			now++
		default:
			held = append(held, r)
		}
		perInstance[r.instance]++
	}
	if now != 10 || len(held) != 20 || denied != 30 {
		t.Fatalf("%d admitted at once, %d held, %d denied; want 10, 20, 30", now, len(held), denied)
	}
	turns := bucketTurns(t, srv, z, "alice", 20)
	taken := make([]bool, len(turns))
	for _, r := range held {
		from, to := r.sent.Add(r.d.Delay-time.Millisecond), r.recv.Add(r.d.Delay+time.Millisecond) // 1ms: µs rounding, clock reads
		k := slices.IndexFunc(turns, func(turn time.Time) bool { return !turn.Before(from) && !turn.After(to) })
		if k < 0 || taken[k] || r.d.Delay > z.MaxWait {
			t.Fatalf("instance %d, delay %v: its slot [%v, %v] is on no free turn of %v", r.instance, r.d.Delay,
				from.Format("15:04:05.000000"), to.Format("15:04:05.000000"), turns)
		}
		taken[k] = true
	}
	slices.SortFunc(held, func(a, b result) int { return int(a.d.Delay - b.d.Delay) })
	t.Logf("admitted per instance: %v; delays %v to %v; turns %s to %s", perInstance, held[0].d.Delay, held[19].d.Delay,
		turns[0].Format("15:04:05.000000"), turns[19].Format("15:04:05.000000"))
}

// bucketTurns reads the token bucket of zone z and client key and returns the times at which
// its last n debts come due, the earliest first: the turns of the n requests it holds. A bucket
// that used u tokens at ts (µs) can serve a request when u has drained to capacity - 1; the
// request before the last when it has drained to capacity - 2, and so on.
func bucketTurns(t *testing.T, srv *redistest.Server, z *limiter.Zone, key string, n int) []time.Time {
	t.Helper()
	v, err := srv.Client().HMGet(context.Background(), limiter.StateKey("rl:", z, key), "u", "ts").Result()
	if err != nil {
		t.Fatal(err)
	}
	used, err1 := strconv.ParseFloat(v[0].(string), 64)
	ts, err2 := strconv.ParseInt(v[1].(string), 10, 64)
	if err1 != nil || err2 != nil {
		t.Fatalf("bucket %v: %v %v", v, err1, err2)
	}
	turns := make([]time.Time, n)
	for k := range turns {
		drain := used - float64(z.Capacity) - float64(n-1-k) // tokens to drain before turn k
		turns[k] = time.UnixMicro(ts).Add(time.Duration(drain / z.RefillRate * float64(time.Second)))
	}
	return turns
}
