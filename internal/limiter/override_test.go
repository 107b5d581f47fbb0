package limiter_test

import (
	"context"
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
