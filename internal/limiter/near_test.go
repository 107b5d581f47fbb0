package limiter_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestNearLimitOncePerCrossing: 60 concurrent requests of one client, sent through 3 Limiters
// (3 instances, each its own client and Batcher) to a zone of quota 20 with near_limit 0.8,
// admit 20, and exactly one of them reports the crossing: the one that took the 16th unit (its
// Remaining 4). Each algorithm; the same load without near_limit reports none.
func TestNearLimitOncePerCrossing(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	noRefill := 20 / (limiter.MaxWindow.Seconds() / 2)
	ls := make([]*limiter.Limiter, 3)
	for i := range ls {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 16})
		t.Cleanup(func() { _ = c.Close() })
		b := limiter.NewBatcher(c, 4)
		t.Cleanup(b.Close)
		ls[i] = limiter.New(c, limiter.Options{KeyPrefix: "rl:", Batcher: b})
	}
	zones := []*limiter.Zone{
		tb("tb", 20, noRefill), sw("sw", 20, time.Hour), fw("fw", 20, limiter.Month, nil),
		sc("sc", 20, time.Hour), cc("cc", 20),
	}
	for _, base := range zones {
		for _, near := range []float64{0.8, 0} {
			z := *base
			z.Name = fmt.Sprintf("%s-%v", base.Name, near)
			z.NearLimit = near
			if err := z.Validate(); err != nil {
				t.Fatal(err)
			}
			t.Run(z.Name, func(t *testing.T) {
				admitted, crossings := nearLoad(t, ls, &z, 60)
				want := 1
				if near == 0 {
					want = 0
				}
				if len(admitted) != 20 || len(crossings) != want {
					t.Fatalf("%d admitted, crossings %v: want 20 admitted and %d crossing", len(admitted), crossings, want)
				}
				if want == 1 && crossings[0] != 4 {
					t.Fatalf("the crossing left %d remaining, want 4 (16 of 20 used)", crossings[0])
				}
			})
		}
	}
}

// nearLoad sends n concurrent requests of cost 1 of client "c" to zone z through the Limiters
// ls in turn, and returns the Remaining of each admitted request and of each that reported a
// near-limit crossing.
func nearLoad(t *testing.T, ls []*limiter.Limiter, z *limiter.Zone, n int) (admitted, crossings []int64) {
	t.Helper()
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			<-start
			reqs := []limiter.Request{{Zone: z, Key: "c", Cost: 1, Hold: time.Minute}}
			if z.Algorithm != limiter.Concurrency {
				reqs[0].Hold = 0
			}
			d, err := ls[i%len(ls)].Decide(context.Background(), reqs)
			if err != nil {
				errs <- err
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if d.Allowed {
				admitted = append(admitted, reqs[0].Result.Remaining)
			}
			if reqs[0].Result.NearLimit {
				crossings = append(crossings, reqs[0].Result.Remaining)
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return admitted, crossings
}

// nearStep decides one request of cost for client "c" in z and returns whether it was admitted
// and whether it reported a near-limit crossing.
func nearStep(t *testing.T, l *limiter.Limiter, z *limiter.Zone, cost int64) (bool, bool) {
	t.Helper()
	r := []limiter.Request{{Zone: z, Key: "c", Cost: cost}}
	d := allow(t, l, r...)
	return d.Allowed, r[0].Result.NearLimit
}

// nearSteps decides n requests of cost 1 and returns the 1-based indexes of those that reported
// a crossing; every request must be admitted.
func nearSteps(t *testing.T, l *limiter.Limiter, z *limiter.Zone, n int) []int {
	t.Helper()
	var at []int
	for i := range n {
		ok, near := nearStep(t, l, z, 1)
		if !ok {
			t.Fatalf("request %d denied", i+1)
		}
		if near {
			at = append(at, i+1)
		}
	}
	return at
}

// TestNearLimitCrossesAgain: a token bucket of 10 tokens at 1 token/s with near_limit 0.8
// reports the 8th request of a burst, not the 9th and 10th; 5 s later (5 tokens back: 5 used)
// the 3rd request (8 used again) reports a new crossing. A fixed window reports its 8th request
// in each window.
func TestNearLimitCrossesAgain(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	b := tb("bucket", 10, 1)
	b.NearLimit = 0.8
	if at := nearSteps(t, l, b, 10); fmt.Sprint(at) != "[8]" {
		t.Fatalf("burst of 10: crossings at %v, want [8]", at)
	}
	if ok, _ := nearStep(t, l, b, 1); ok {
		t.Fatal("11th request admitted, want denied")
	}
	clk.Advance(5 * time.Second)
	if at := nearSteps(t, l, b, 5); fmt.Sprint(at) != "[3]" {
		t.Fatalf("after 5 tokens came back: crossings at %v, want [3]", at)
	}

	w := &limiter.Zone{Name: "window", Algorithm: limiter.FixedWindow, Limit: 10, Window: time.Minute, NearLimit: 0.8}
	for i := range 2 {
		if at := nearSteps(t, l, w, 10); fmt.Sprint(at) != "[8]" {
			t.Fatalf("window %d: crossings at %v, want [8]", i+1, at)
		}
		clk.Advance(time.Minute)
	}
}

// TestNearLimitCostAndThreshold: a request of cost 6 into a bucket of 10 with near_limit 0.5
// (5 units) crosses it at once; near_limit 1 is crossed by the request that takes the last
// unit; a denied request and a request of a zone another zone denies report nothing, and leave
// the crossing to the next admitted one.
func TestNearLimitCostAndThreshold(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	half := tb("half", 10, 0.001)
	half.NearLimit = 0.5
	if ok, near := nearStep(t, l, half, 6); !ok || !near {
		t.Fatalf("cost 6 of 10: admitted %v, crossing %v; want both", ok, near)
	}
	full := tb("full", 3, 0.001)
	full.NearLimit = 1
	if at := nearSteps(t, l, full, 3); fmt.Sprint(at) != "[3]" {
		t.Fatalf("near_limit 1: crossings at %v, want [3]", at)
	}
	if ok, near := nearStep(t, l, full, 1); ok || near {
		t.Fatalf("4th request: admitted %v, crossing %v; want neither", ok, near)
	}

	z := tb("pair", 4, 0.001)
	z.NearLimit = 0.5
	other := tb("other", 1, 0.001)
	allow(t, l, limiter.Request{Zone: other, Key: "c", Cost: 1})
	allow(t, l, limiter.Request{Zone: z, Key: "c", Cost: 1})
	reqs := []limiter.Request{{Zone: z, Key: "c", Cost: 1}, {Zone: other, Key: "c", Cost: 1}}
	if d := allow(t, l, reqs...); d.Allowed || reqs[0].Result.NearLimit {
		t.Fatalf("denied by the other zone: allowed %v, crossing %v; want neither", d.Allowed, reqs[0].Result.NearLimit)
	}
	if ok, near := nearStep(t, l, z, 1); !ok || !near {
		t.Fatalf("next request alone: admitted %v, crossing %v; want both (2 of 4 used)", ok, near)
	}
}

// TestNearLimitOfOverride: the threshold is a fraction of the quota in force: a client whose
// override raises the capacity from 10 to 20 crosses near_limit 0.5 at its 10th request, not
// its 5th.
func TestNearLimitOfOverride(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	z := tb("ov", 10, 0.001)
	z.Overrides, z.NearLimit = true, 0.5
	if err := l.SetOverride(context.Background(), z, "c", limiter.Override{Capacity: 20}, time.Hour); err != nil {
		t.Fatal(err)
	}
	if at := nearSteps(t, l, z, 12); fmt.Sprint(at) != "[10]" {
		t.Fatalf("crossings at %v, want [10]", at)
	}
}

// TestNearLimitWhileInDebt: a bucket of 4 with a max_wait, near_limit 1: the request that takes
// the last token reports the crossing; the requests admitted after it into debt (held) report
// none.
func TestNearLimitWhileInDebt(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := tb("shaped", 4, 1)
	z.MaxWait, z.NearLimit = 10*time.Second, 1
	var at []int
	for i := range 8 {
		r := []limiter.Request{{Zone: z, Key: "c", Cost: 1}}
		if d := allow(t, l, r...); !d.Allowed || (i >= 4) != (d.Delay > 0) {
			t.Fatalf("request %d: %+v, want admitted, held from the 5th on", i+1, d)
		}
		if r[0].Result.NearLimit {
			at = append(at, i+1)
		}
	}
	if fmt.Sprint(at) != "[4]" {
		t.Fatalf("crossings at %v, want [4]", at)
	}
}

// TestNearLimitValidate: near_limit is a fraction above 0 and at most 1, in millionths, and
// not with a lease.
func TestNearLimitValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		near  float64
		lease bool
		want  string
	}{
		{0.8, false, ""},
		{1, false, ""},
		{0.000001, false, ""},
		{1.5, false, "zone z: near_limit 1.5 must be above 0 and at most 1: a fraction of the quota (0.8, or 80%)"},
		{-0.2, false, "zone z: near_limit -0.2 must be above 0 and at most 1: a fraction of the quota (0.8, or 80%)"},
		{0.0000001, false, "zone z: near_limit 1e-07 must be at least 0.000001"},
		{0.8, true, "zone z: near_limit excludes lease: a grant is spent in process, where the request that crosses the threshold is not seen"},
	} {
		z := tb("z", 10, 1)
		z.NearLimit = tc.near
		if tc.lease {
			z.Lease = &limiter.Lease{Max: 5, TTL: time.Second}
		}
		err := z.Validate()
		if got := fmt.Sprint(err); (tc.want == "" && err != nil) || (tc.want != "" && got != tc.want) {
			t.Errorf("near_limit %v, lease %v: %v, want %q", tc.near, tc.lease, err, tc.want)
		}
	}
}

// TestNearLimitClusterAcrossSlots: on a 3-primary Redis Cluster, 3 instances sending 60
// concurrent requests report one crossing; and a request whose near_limit zone's slot admits it
// (with the charge as a hold that crosses) while the other zone's slot denies reports nothing:
// the hold is released, and the next request alone crosses.
func TestNearLimitClusterAcrossSlots(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	ls := []*limiter.Limiter{clusterLimiter(t, c, limiter.Options{}), clusterLimiter(t, c, limiter.Options{}), clusterLimiter(t, c, limiter.Options{})}
	z := tb("near", 20, 20/(limiter.MaxWindow.Seconds()/2))
	z.NearLimit = 0.8
	if admitted, crossings := nearLoad(t, ls, z, 60); len(admitted) != 20 || fmt.Sprint(crossings) != "[4]" {
		t.Fatalf("%d admitted, crossings at remaining %v: want 20 and [4]", len(admitted), crossings)
	}

	keys := clientsOn(t, c, 1)
	a, b := keys[0][0], keys[1][0]
	half := tb("half", 4, 0.001)
	half.NearLimit = 0.5
	other := tb("other", 1, 0.001)
	l := ls[0]
	allow(t, l, limiter.Request{Zone: other, Key: b, Cost: 1})
	allow(t, l, limiter.Request{Zone: half, Key: a, Cost: 1})
	reqs := []limiter.Request{{Zone: half, Key: a, Cost: 1}, {Zone: other, Key: b, Cost: 1}}
	if d := allow(t, l, reqs...); d.Allowed || reqs[0].Result.NearLimit {
		t.Fatalf("denied by the other slot: allowed %v, crossing %v; want neither", d.Allowed, reqs[0].Result.NearLimit)
	}
	r := []limiter.Request{{Zone: half, Key: a, Cost: 1}}
	if d := allow(t, l, r...); !d.Allowed || !r[0].Result.NearLimit {
		t.Fatalf("next request alone: allowed %v, crossing %v; want both (2 of 4 used)", d.Allowed, r[0].Result.NearLimit)
	}
}
