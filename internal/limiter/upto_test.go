package limiter_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// uptoZones are a token bucket and a fixed window zone of quota q with UpTo, and no refill or
// window end within a test.
func uptoZones(q int64) []*limiter.Zone {
	tb := &limiter.Zone{Name: "tb", Algorithm: limiter.TokenBucket, Capacity: q, RefillRate: 1.0 / 3600, UpTo: true}
	fw := &limiter.Zone{Name: "fw", Algorithm: limiter.FixedWindow, Limit: q, Window: time.Hour, UpTo: true}
	return []*limiter.Zone{tb, fw}
}

// TestUpToGrantsWhatIsLeft: a request given a bound is charged all the zone holds up to that
// bound, never less than its cost, and is denied when the zone holds less than its cost; a
// settlement then charges what the response used and gives back the rest of the grant.
func TestUpToGrantsWhatIsLeft(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	ctx := context.Background()
	for _, z := range uptoZones(100) {
		t.Run(z.Name, func(t *testing.T) {
			decide := func(cost, upTo int64) (limiter.Decision, limiter.Result) {
				t.Helper()
				r := limiter.Request{Zone: z, Key: "alice", Cost: cost, Hold: time.Minute}
				r.SetUpTo(upTo)
				reqs := []limiter.Request{r}
				d, err := l.Decide(ctx, reqs)
				if err != nil {
					t.Fatal(err)
				}
				return d, reqs[0].Result
			}
			steps := []struct {
				cost, upTo, granted, remaining int64
				allowed                        bool
			}{
				{cost: 10, upTo: 60, granted: 60, remaining: 40, allowed: true},
				{cost: 10, upTo: 60, granted: 40, remaining: 0, allowed: true}, // what is left
				{cost: 1, upTo: 60, granted: 0, remaining: 0, allowed: false},
			}
			var held []*limiter.Held
			for i, s := range steps {
				d, res := decide(s.cost, s.upTo)
				if d.Allowed != s.allowed || int64(res.Granted) != s.granted || res.Remaining != s.remaining {
					t.Fatalf("step %d: allowed %v, granted %d, remaining %d; want %v, %d, %d", i, d.Allowed, res.Granted, res.Remaining, s.allowed, s.granted, s.remaining)
				}
				if d.Allowed {
					held = append(held, d.Held)
				}
			}
			// The first response used 25 of its 60: 35 come back; the second keeps its 40.
			if _, err := l.Settle(ctx, held[0], []int64{25}); err != nil {
				t.Fatal(err)
			}
			if _, err := l.Settle(ctx, held[1], []int64{40}); err != nil {
				t.Fatal(err)
			}
			d, res := decide(30, 30)
			if !d.Allowed || res.Granted != 0 || res.Remaining != 5 {
				t.Fatalf("after settling: allowed %v, granted %d, remaining %d; want true, 0 (a bound at the cost asks nothing), 5", d.Allowed, res.Granted, res.Remaining)
			}
			d, res = decide(5, 1000)
			if !d.Allowed || res.Granted != 5 || res.Remaining != 0 {
				t.Fatalf("last: allowed %v, granted %d, remaining %d; want true, 5, 0", d.Allowed, res.Granted, res.Remaining)
			}
		})
	}
}

// TestUpToNeverOverdrawn: concurrent requests, each asking for up to 4,000 units at a cost of
// 16, against a quota of 10,000 on several instances (Limiters) are granted 10,000 in total at
// most, every grant between its cost and its bound; settled to what they were granted (a
// response that used all of its cap), the zone is then empty.
func TestUpToNeverOverdrawn(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	var instances []*limiter.Limiter
	for range 3 {
		b := limiter.NewBatcher(srv.Client(), 4)
		t.Cleanup(b.Close)
		instances = append(instances, limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Batcher: b}))
	}
	ctx := context.Background()
	for _, z := range uptoZones(10_000) {
		t.Run(z.Name, func(t *testing.T) {
			var mu sync.Mutex
			var total, admitted int64
			var wg sync.WaitGroup
			for i := range 30 {
				wg.Go(func() {
					l := instances[i%len(instances)]
					r := limiter.Request{Zone: z, Key: "bob", Cost: 16, Hold: time.Minute}
					r.SetUpTo(4000)
					reqs := []limiter.Request{r}
					d, err := l.Decide(ctx, reqs)
					if err != nil {
						t.Error(err)
						return
					}
					if !d.Allowed {
						return
					}
					g := int64(reqs[0].Result.Granted)
					if g < 16 || g > 4000 {
						t.Errorf("granted %d, want 16 to 4000", g)
					}
					if _, err := l.Settle(ctx, d.Held, []int64{g}); err != nil {
						t.Error(err)
					}
					mu.Lock()
					total += g
					admitted++
					mu.Unlock()
				})
			}
			wg.Wait()
			if total > 10_000 {
				t.Fatalf("granted %d in total over %d requests, want at most 10000", total, admitted)
			}
			if total < 10_000-15 {
				t.Fatalf("granted %d in total, want all but less than one cost of 10000: a request is denied only when less than its cost is left", total)
			}
			r := limiter.Request{Zone: z, Key: "bob", Cost: 10_000 - total + 1}
			if d, err := instances[0].Decide(ctx, []limiter.Request{r}); err != nil || d.Allowed {
				t.Fatalf("after the grants, a request of one unit more than is left: %+v, %v; want denied", d, err)
			}
		})
	}
}

// TestUpToAcrossSlots: on Redis Cluster, a request whose zones are in two hash slots, one with a
// bound, is granted there what is left, and a denial by the other slot gives the grant back.
func TestUpToAcrossSlots(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	l := clusterLimiter(t, c, limiter.Options{})
	keys := clientsOn(t, c, 1)
	ctx := context.Background()
	capped := uptoZones(100)[0]
	other := &limiter.Zone{Name: "other", Algorithm: limiter.FixedWindow, Limit: 1, Window: time.Hour}
	decide := func() (limiter.Decision, []limiter.Request) {
		t.Helper()
		r := limiter.Request{Zone: capped, Key: keys[0][0], Cost: 10, Hold: time.Minute}
		r.SetUpTo(70)
		reqs := []limiter.Request{r, {Zone: other, Key: keys[1][0], Cost: 1}}
		d, err := l.Decide(ctx, reqs)
		if err != nil {
			t.Fatal(err)
		}
		return d, reqs
	}
	d, reqs := decide()
	if !d.Allowed || reqs[0].Result.Granted != 70 || reqs[0].Result.Remaining != 30 {
		t.Fatalf("first: allowed %v, granted %d, remaining %d; want true, 70, 30", d.Allowed, reqs[0].Result.Granted, reqs[0].Result.Remaining)
	}
	if _, err := l.Settle(ctx, d.Held, []int64{20, 1}); err != nil {
		t.Fatal(err)
	}
	d, reqs = decide() // the other zone is full: denied, and the grant given back
	if d.Allowed || reqs[0].Result.Granted != 0 {
		t.Fatalf("second: allowed %v, granted %d; want false, 0", d.Allowed, reqs[0].Result.Granted)
	}
	r := limiter.Request{Zone: capped, Key: keys[0][0], Cost: 80}
	if d, err := l.Decide(ctx, []limiter.Request{r}); err != nil || !d.Allowed {
		t.Fatalf("80 of the 80 left after settling 20 of 70: %+v, %v; want allowed", d, err)
	}
}

// TestUpToValidate: a bound needs a token bucket or fixed window zone without a lease or
// dry_run.
func TestUpToValidate(t *testing.T) {
	t.Parallel()
	for _, z := range []*limiter.Zone{
		{Name: "sw", Algorithm: limiter.SlidingWindow, Limit: 10, Window: time.Minute, UpTo: true},
		{Name: "sc", Algorithm: limiter.SlidingWindowCounter, Limit: 10, Window: time.Minute, UpTo: true},
		{Name: "cc", Algorithm: limiter.Concurrency, Limit: 10, UpTo: true},
		{Name: "lease", Algorithm: limiter.TokenBucket, Capacity: 10, RefillRate: 1, UpTo: true, Lease: &limiter.Lease{Max: 5, TTL: time.Second}},
		{Name: "shadow", Algorithm: limiter.TokenBucket, Capacity: 10, RefillRate: 1, UpTo: true, Shadow: true},
	} {
		if err := z.Validate(); err == nil {
			t.Errorf("zone %s with UpTo: Validate returned nil, want an error", z.Name)
		}
	}
	for _, z := range uptoZones(10) {
		if err := z.Validate(); err != nil {
			t.Errorf("zone %s with UpTo: %v", z.Name, err)
		}
	}
}
