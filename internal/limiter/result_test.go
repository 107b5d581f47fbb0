package limiter_test

import (
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// results checks each request's Result against want, in order.
func results(t *testing.T, step string, reqs []limiter.Request, want ...limiter.Result) {
	t.Helper()
	for i, r := range reqs {
		if r.Result != want[i] {
			t.Fatalf("%s: zone %s:\n got %+v\nwant %+v", step, r.Zone.Name, r.Result, want[i])
		}
	}
}

// TestResultOfEveryZone: Allow writes every zone's own outcome into its request, whichever zone
// decides, on admissions and on denials (a zone that would have admitted a denied request shows
// its figures as they are, uncharged).
func TestResultOfEveryZone(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	reqs := []limiter.Request{
		{Zone: tb("api", 3, 0.5), Key: "alice", Cost: 1},           // one token per 2s
		{Zone: sw("login", 2, time.Minute), Key: "alice", Cost: 1}, // 2 per minute
	}
	want(t, "first", allow(t, l, reqs...), limiter.Decision{Allowed: true, Zone: 1, Limit: 2, Remaining: 1, Reset: time.Minute, Next: time.Minute})
	results(t, "first", reqs,
		limiter.Result{Known: true, Allowed: true, Remaining: 2, Next: 2 * time.Second, Reset: 2 * time.Second},
		limiter.Result{Known: true, Allowed: true, Remaining: 1, Next: time.Minute, Reset: time.Minute})
	clk.Advance(10 * time.Second)
	allow(t, l, reqs...)
	results(t, "second", reqs,
		limiter.Result{Known: true, Allowed: true, Remaining: 2, Next: 2 * time.Second, Reset: 2 * time.Second},
		limiter.Result{Known: true, Allowed: true, Remaining: 0, Next: 50 * time.Second, Reset: time.Minute})
	want(t, "denied by login", allow(t, l, reqs...),
		limiter.Decision{Zone: 1, Limit: 2, RetryAfter: 50 * time.Second, Reset: time.Minute, Next: 50 * time.Second})
	results(t, "denied by login", reqs,
		// Not charged: 2 tokens (1 used 0s ago), the next in 2s; Reset is as if charged.
		limiter.Result{Known: true, Allowed: true, Remaining: 2, Next: 2 * time.Second, Reset: 4 * time.Second},
		limiter.Result{Known: true, Remaining: 0, Next: 50 * time.Second, Reset: time.Minute})
}

// TestResultOfCachedDenial: a denial from the deny cache knows only the zones it covers; the
// others are not Known, whatever a previous decision wrote into the requests.
func TestResultOfCachedDenial(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Minute})
	reqs := []limiter.Request{
		{Zone: tb("api", 10, 1), Key: "alice", Cost: 1},
		{Zone: tb("login", 1, 0.1), Key: "alice", Cost: 1}, // one token per 10s
	}
	allow(t, l, reqs...)
	if d := allow(t, l, reqs...); d.Allowed || d.Cached {
		t.Fatalf("second: %+v, want denied by Redis", d)
	}
	results(t, "denied by Redis", reqs,
		limiter.Result{Known: true, Allowed: true, Remaining: 9, Next: time.Second, Reset: 2 * time.Second},
		limiter.Result{Known: true, Remaining: 0, Next: 10 * time.Second, Reset: 10 * time.Second})
	clk.Advance(4 * time.Second)
	want(t, "cached", allow(t, l, reqs...),
		limiter.Decision{Zone: 1, Limit: 1, RetryAfter: 6 * time.Second, Reset: 6 * time.Second, Next: 6 * time.Second, Cached: true})
	results(t, "cached", reqs,
		limiter.Result{},
		limiter.Result{Known: true, Remaining: 0, Next: 6 * time.Second, Reset: 6 * time.Second})
}

// TestResultOfLocal: fail_mode local's decisions fill in every zone's Result too.
func TestResultOfLocal(t *testing.T) {
	l := limiter.NewLocal(0)
	t0 := time.Unix(1_700_000_000, 0)
	reqs := []limiter.Request{
		{Zone: tb("api", 3, 1), Key: "alice", Cost: 1},
		{Zone: sw("login", 2, 10*time.Second), Key: "alice", Cost: 1}, // a bucket of 2 refilled every 5s
	}
	want(t, "first", l.Allow(reqs, t0), limiter.Decision{Allowed: true, Zone: 1, Limit: 2, Remaining: 1, Reset: 5 * time.Second, Next: 5 * time.Second})
	results(t, "first", reqs,
		limiter.Result{Known: true, Allowed: true, Remaining: 2, Next: time.Second, Reset: time.Second},
		limiter.Result{Known: true, Allowed: true, Remaining: 1, Next: 5 * time.Second, Reset: 5 * time.Second})
	l.Allow(reqs, t0)
	want(t, "denied by login", l.Allow(reqs, t0), limiter.Decision{Zone: 1, Limit: 2, RetryAfter: 5 * time.Second, Reset: 10 * time.Second, Next: 5 * time.Second})
	results(t, "denied by login", reqs,
		limiter.Result{Known: true, Allowed: true, Remaining: 1, Next: time.Second, Reset: 3 * time.Second}, // not charged
		limiter.Result{Known: true, Remaining: 0, Next: 5 * time.Second, Reset: 10 * time.Second})
}
