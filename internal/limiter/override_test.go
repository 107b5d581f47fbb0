package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestOverrideOutOfRangeIgnored: an override limit written under a fixed window (2,000,000, in
// its range) is out of a sliding window log's range (at most MaxLimit): once the zone is a
// sliding window, the override's limit is ignored and the zone's limit of 5 decides; its window,
// in range, still applies.
func TestOverrideOutOfRangeIgnored(t *testing.T) {
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	ctx := context.Background()
	fw := &limiter.Zone{Name: "w", Algorithm: limiter.FixedWindow, Limit: 5, Window: time.Minute, Overrides: true}
	if err := l.SetOverride(ctx, fw, "c", limiter.Override{Limit: 2_000_000, Window: time.Hour}, 0); err != nil {
		t.Fatal(err)
	}
	sw := &limiter.Zone{Name: "w", Algorithm: limiter.SlidingWindow, Limit: 5, Window: time.Minute, Overrides: true}
	for i := range 6 {
		reqs := []limiter.Request{{Zone: sw, Key: "c", Cost: 1}}
		d := allow(t, l, reqs...)
		if d.Allowed != (i < 5) {
			t.Fatalf("request %d: %+v, want admitted only within the zone's limit of 5", i+1, d)
		}
		if i == 5 && d.RetryAfter < 59*time.Minute {
			t.Fatalf("request 6: retry after %v, want the override's window of 1h", d.RetryAfter)
		}
	}
}

// TestOverrideRaisesMaxCostAboveZoneQuota: a zone with Overrides may have a MaxCost above its own
// quota (a sliding window whose cost the client chooses: at most 1000). A client whose override
// raises the limit is admitted a cost up to the quota in force; a client without one is bounded
// by the zone's own quota, and a larger cost is unsatisfiable (no wait cures it).
func TestOverrideRaisesMaxCostAboveZoneQuota(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	z := &limiter.Zone{Name: "w", Algorithm: limiter.SlidingWindow, Limit: 100, Window: time.Minute, MaxCost: 1000, Overrides: true}
	if err := l.SetOverride(context.Background(), z, "alice", limiter.Override{Limit: 1000}, 0); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		key           string
		cost          int64
		admitted      bool
		unsatisfiable bool
	}{
		{"alice", 500, true, false},
		{"alice", 400, true, false},
		{"alice", 101, false, false}, // 900 of 1000 used: waiting cures it
		{"bob", 101, false, true},    // no override: the zone's limit of 100 bounds the cost
		{"bob", 100, true, false},
	} {
		reqs := []limiter.Request{{Zone: z, Key: c.key, Cost: c.cost}}
		d := allow(t, l, reqs...)
		if d.Allowed != c.admitted || d.Unsatisfiable != c.unsatisfiable {
			t.Fatalf("%s, cost %d: %+v, want admitted %v, unsatisfiable %v", c.key, c.cost, d, c.admitted, c.unsatisfiable)
		}
	}
}

// overrideChargeZones are the zones of TestSettleUsesTheNumbersOfTheReservation, each of 100 an
// hour, with overrides, holding its charge until after the response.
func overrideChargeZones() []*limiter.Zone {
	return []*limiter.Zone{
		{Name: "llm", Algorithm: limiter.TokenBucket, Capacity: 100, RefillRate: 100.0 / 3600, Overrides: true},
		{Name: "llm", Algorithm: limiter.FixedWindow, Limit: 100, Window: time.Hour, Overrides: true},
		{Name: "llm", Algorithm: limiter.SlidingWindowCounter, Limit: 100, Window: time.Hour, Overrides: true},
	}
}

// charged is what zone z of client holds charged: a token bucket's u (no holds left), a window
// counter's count.
func charged(t *testing.T, srv *redistest.Server, z *limiter.Zone, client string) int64 {
	t.Helper()
	if z.Algorithm != limiter.TokenBucket {
		return count(t, srv, z, client)
	}
	key := limiter.StateKey("rl:", z, client)
	if h := srv.Do("HGET", key, "h"); h != nil {
		t.Fatalf("%s: holds %v left", key, h)
	}
	n, err := strconv.ParseInt(fmt.Sprint(srv.Do("HGET", key, "u")), 10, 64)
	if err != nil {
		t.Fatalf("%s: u %v", key, srv.Do("HGET", key, "u"))
	}
	return n
}

// reserveOn decides, on the 3 Limiters ls, n requests of client "alice" in zone z concurrently
// (request k on ls[k%3]), each of cost 100 held 10 minutes, and returns their decisions.
func reserveOn(t *testing.T, ls []*limiter.Limiter, z *limiter.Zone, n int) []limiter.Decision {
	t.Helper()
	ds := make([]limiter.Decision, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for k := range n {
		wg.Go(func() {
			ds[k], errs[k] = ls[k%3].Decide(context.Background(), []limiter.Request{{Zone: z, Key: "alice", Cost: 100, Hold: 10 * time.Minute}})
		})
	}
	wg.Wait()
	for k, err := range errs {
		if err != nil || !ds[k].Allowed {
			t.Fatalf("reservation %d: %+v, %v; want admitted", k+1, ds[k], err)
		}
	}
	return ds
}

// TestSettleUsesTheNumbersOfTheReservation: 3 instances share a zone of 100 an hour (token
// bucket, fixed window, sliding window counter) whose client alice is raised to 10,000 in 90
// minutes. Six requests of cost 100 are reserved under the raise, then the override is cut to
// 1000 (same window) and three more are reserved under the cut; a fourth of 200 is denied by it.
// Then the override is deleted: alice's next request sees the zone's own limit of 100 (a cost of
// 101 is never admissible). Only then
// are the nine settled, concurrently across the instances: 250 each for those reserved under
// the raise, 150 for the others, all above the zone's own 100. Each settle finds its charge, and
// alice is charged exactly 6 × 250 + 3 × 150 = 1950: each settled with the numbers in force at
// its reservation (the max cost, the window its charge went into, the bucket's capacity).
func TestSettleUsesTheNumbersOfTheReservation(t *testing.T) {
	t.Parallel()
	for _, z := range overrideChargeZones() {
		t.Run(z.Algorithm.String(), func(t *testing.T) {
			srv := redistest.Start(t)
			clk := newClock() // a fixed clock: nothing refills, the charges are all the state
			ls := make([]*limiter.Limiter, 3)
			for i := range ls {
				ls[i] = limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
			}
			ctx := context.Background()
			setOv := func(quota int64) {
				t.Helper()
				o := limiter.Override{Capacity: quota, RefillRate: float64(quota) / 5400, Limit: quota, Window: 90 * time.Minute}
				if err := ls[quota%3].SetOverride(ctx, z, "alice", o, 0); err != nil {
					t.Fatal(err)
				}
			}
			setOv(10_000)
			raised := reserveOn(t, ls, z, 6)
			setOv(1000)
			cut := reserveOn(t, ls, z, 3)
			big := limiter.Request{Zone: z, Key: "alice", Cost: 200, Hold: 10 * time.Minute}
			if d := allow(t, ls[0], big); d.Allowed || d.Limit != 1000 {
				t.Fatalf("cost 200 with 900 reserved under the cut: %+v, want denied with limit 1000", d)
			}
			if _, err := ls[1].DeleteOverride(ctx, z, "alice"); err != nil {
				t.Fatal(err)
			}
			over := limiter.Request{Zone: z, Key: "alice", Cost: 101, Hold: 10 * time.Minute}
			if d := allow(t, ls[2], over); d.Allowed || !d.Unsatisfiable || d.Limit != 100 {
				t.Fatalf("cost 101 after the delete: %+v, want never admissible under the zone's own limit of 100", d)
			}
			ds := append(raised, cut...)
			errs := make([]error, len(ds))
			var wg sync.WaitGroup
			for k, d := range ds {
				amount := int64(250)
				if k >= len(raised) {
					amount = 150
				}
				wg.Go(func() {
					var ok []bool
					ok, errs[k] = ls[(k+1)%3].Settle(ctx, d.Held, []int64{amount})
					if errs[k] == nil && !ok[0] {
						errs[k] = errors.New("not settled")
					}
				})
			}
			wg.Wait()
			for k, err := range errs {
				if err != nil {
					t.Errorf("settle %d: %v", k+1, err)
				}
			}
			if got := charged(t, srv, z, "alice"); got != 6*250+3*150 {
				t.Fatalf("alice charged %d, want 6 × 250 + 3 × 150 = 1950", got)
			}
		})
	}
}

// TestClusterOverrideZoneAcrossSlots: on Redis Cluster, a request whose zones are in two hash
// slots: a fixed window of 100 an hour, held until after the response, whose client has an
// override of 1000 in 90 minutes, and a token bucket of 1 of another client. The admission
// holds the window's charge; Settle charges 300 in the override's window. When the bucket
// denies the next request, the window's charge of 100, taken in the override's window, is
// given back: the count stays 300.
func TestClusterOverrideZoneAcrossSlots(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	perNode := clientsOn(t, c, 1)
	alice, bob := perNode[0][0], perNode[1][0]
	clk := newClock()
	l := clusterLimiter(t, c, limiter.Options{Now: clk.Now})
	zw := &limiter.Zone{Name: "w", Algorithm: limiter.FixedWindow, Limit: 100, Window: time.Hour, Overrides: true}
	zb := tb("plain", 1, 1.0/3600)
	if err := l.SetOverride(context.Background(), zw, alice, limiter.Override{Limit: 1000, Window: 90 * time.Minute}, 0); err != nil {
		t.Fatal(err)
	}
	// reqs are the request's zones afresh (a decision puts the numbers in force in its requests).
	reqs := func() []limiter.Request {
		return []limiter.Request{{Zone: zw, Key: alice, Cost: 100, Hold: time.Hour}, {Zone: zb, Key: bob, Cost: 1}}
	}
	d := allow(t, l, reqs()...)
	if !d.Allowed || d.Held == nil {
		t.Fatalf("first request: %+v, want allowed with a hold", d)
	}
	if got, err := l.Settle(context.Background(), d.Held, []int64{300, 0}); err != nil || !got[0] {
		t.Fatalf("settle: %v, %v", got, err)
	}
	if n := count(t, c.Nodes[0], zw, alice); n != 300 {
		t.Fatalf("window after the settle: %d, want 300", n)
	}
	if d := allow(t, l, reqs()...); d.Allowed || d.Zone != 1 {
		t.Fatalf("with the bucket empty: %+v, want denied by it", d)
	}
	if n := count(t, c.Nodes[0], zw, alice); n != 300 {
		t.Fatalf("window after the bucket's denial: %d, want 300 (the charge of 100 given back)", n)
	}
}
