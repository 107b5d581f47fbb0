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
