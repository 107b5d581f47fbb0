package limiter_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func settle(t *testing.T, l *limiter.Limiter, d limiter.Decision, amounts ...int64) ([]bool, error) {
	t.Helper()
	if d.Held == nil {
		t.Fatalf("decision %+v holds nothing to settle", d)
	}
	return l.Settle(context.Background(), d.Held, amounts)
}

// TestSettleChargesTheReportedAmount: capacity 1000, 1000 tokens per hour, a reservation of 100
// settled to 300 four times: the 4th puts the bucket 200 in debt, and the 5th waits for the debt
// and its cost, 300 tokens: 1080 s. A second settle of the same decision changes nothing.
func TestSettleChargesTheReportedAmount(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := tb("llm", 1000, 1000.0/3600)
	req := limiter.Request{Zone: z, Key: "alice", Cost: 100, Hold: 10 * time.Minute}
	var last limiter.Decision
	for i := range 4 {
		d := allow(t, l, req)
		if !d.Allowed {
			t.Fatalf("request %d denied: %+v", i+1, d)
		}
		if got, err := settle(t, l, d, 300); err != nil || len(got) != 1 || !got[0] {
			t.Fatalf("settle %d: %v, %v", i+1, got, err)
		}
		last = d
	}
	if u := srv.Do("HGET", "rl:{alice}:llm:tb", "u"); u != "1200" {
		t.Fatalf("used after 4 × 300: %v, want 1200 (200 in debt)", u)
	}
	got, err := settle(t, l, last, 300)
	if !errors.Is(err, limiter.ErrNotHeld) || got[0] {
		t.Fatalf("second settle of the same decision: %v, %v; want ErrNotHeld", got, err)
	}
	if u := srv.Do("HGET", "rl:{alice}:llm:tb", "u"); u != "1200" {
		t.Fatalf("used after a second settle: %v, want 1200", u)
	}
	d := allow(t, l, req)
	if d.Allowed || d.RetryAfter != 1080*time.Second || d.Remaining != 0 {
		t.Fatalf("5th request: %+v, want denied with RetryAfter 1080s", d)
	}
}

// TestSettleReleaseAndKeep: a reservation settled to 0 gives everything back; one settled to
// the cost keeps it; one not settled holds its tokens (no refill drains a hold) until its hold
// time has passed, and then counts as charged when a decision finds it: a settle after that
// applies its difference all the same (settled to 0, the charge is given back).
func TestSettleReleaseAndKeep(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := tb("login", 3, 3.0/3600)
	req := limiter.Request{Zone: z, Key: "bob", Cost: 1, Hold: time.Minute}
	for i := range 10 {
		d := allow(t, l, req)
		if !d.Allowed || d.Remaining != 2 {
			t.Fatalf("request %d: %+v, want allowed with 2 left", i+1, d)
		}
		if _, err := settle(t, l, d, 0); err != nil {
			t.Fatal(err)
		}
	}
	kept := allow(t, l, req)
	if _, err := settle(t, l, kept, 1); err != nil {
		t.Fatal(err)
	}
	pending := []limiter.Decision{allow(t, l, req), allow(t, l, req)}
	if d := allow(t, l, req); d.Allowed || d.Next != time.Microsecond {
		t.Fatalf("with 1 kept and 2 held: %+v, want denied, next 1µs (holds may be released at any moment)", d)
	}
	if _, err := settle(t, l, pending[0], 0); err != nil {
		t.Fatal(err)
	}
	d := allow(t, l, req)
	if !d.Allowed {
		t.Fatalf("after a release: %+v, want allowed", d)
	}
	if _, err := settle(t, l, d, 0); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Minute + time.Second) // pending[1]'s hold has passed its time: the next
	if d := allow(t, l, req); !d.Allowed { // admission counts it as charged
		t.Fatalf("with 1 charged and an expired hold: %+v, want allowed", d)
	}
	// The response outlived its hold, which a decision committed as its cost (1): settled to 0
	// now, it is given back all the same.
	if got, err := settle(t, l, pending[1], 0); err != nil || !got[0] {
		t.Fatalf("settle of an expired hold: %v, %v; want settled", got, err)
	}
	if u, _ := strconv.ParseFloat(srv.Do("HGET", "rl:{bob}:login:tb", "u").(string), 64); u < 0.949 || u > 0.951 {
		t.Fatalf("used after the late settle to 0: %v, want 0.95 (1 kept, less 61 s of refill)", u)
	}
	if ttl := srv.Do("PTTL", "rl:{bob}:login:tb").(int64); ttl < 2_390_000 { // 1.95 used at the last admission: 2340 s to drain, and the hold left of 1 minute
		t.Fatalf("TTL %dms: the bucket must outlive what it holds and owes", ttl)
	}
}

// TestHoldOutlivesTheBucketsTTL: a hold of 10 minutes on a bucket that would be full again in a
// second keeps the bucket alive until it can be settled.
func TestHoldOutlivesTheBucketsTTL(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	d := allow(t, l, limiter.Request{Zone: tb("fast", 10, 10), Key: "k", Cost: 5, Hold: 10 * time.Minute})
	if ttl := srv.Do("PTTL", "rl:{k}:fast:tb").(int64); ttl < 600_000 {
		t.Fatalf("TTL %dms, want at least the hold's 10 minutes", ttl)
	}
	allow(t, l, limiter.Request{Zone: tb("fast", 10, 10), Key: "k", Cost: 1}) // a plain charge keeps it too
	if ttl := srv.Do("PTTL", "rl:{k}:fast:tb").(int64); ttl < 599_000 {
		t.Fatalf("TTL %dms after a plain charge, want at least the hold's time left", ttl)
	}
	if got, err := settle(t, l, d, 7); err != nil || !got[0] {
		t.Fatalf("settle: %v, %v", got, err)
	}
}

// TestSlidingWindowCountStatus: a sliding window's entries are its charge: settled to 0 they
// are removed, settled to the cost they stay (with no Redis call).
func TestSlidingWindowCountStatus(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	req := limiter.Request{Zone: sw("login", 3, time.Hour), Key: "eve", Cost: 1, Hold: 10 * time.Minute}
	for range 5 {
		if _, err := settle(t, l, allow(t, l, req), 0); err != nil {
			t.Fatal(err)
		}
	}
	if n := srv.Do("ZCARD", "rl:{eve}:login:sw"); n != int64(0) {
		t.Fatalf("entries after 5 released: %v, want 0", n)
	}
	for i := range 3 {
		if got, err := settle(t, l, allow(t, l, req), 1); err != nil || !got[0] {
			t.Fatalf("keep %d: %v, %v", i, got, err)
		}
	}
	if d := allow(t, l, req); d.Allowed {
		t.Fatalf("4th kept: %+v, want denied", d)
	}
}

// TestClusterHeldZoneAcrossSlots: on Redis Cluster, a request whose zones are in two hash slots,
// one of them held until after the response: the admission commits the other zone at once and
// leaves the held one held (no 5 s expiry); Settle then charges the reported amount; a denial
// by the other slot releases the held zone too.
func TestClusterHeldZoneAcrossSlots(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	perNode := clientsOn(t, c, 1)
	alice, bob := perNode[0][0], perNode[1][0]
	noRefill := 1000 / (limiter.MaxWindow.Seconds() / 2)
	za, zb := tb("held", 1000, noRefill), tb("plain", 2, noRefill/500)
	l := clusterLimiter(t, c, limiter.Options{})
	reqs := []limiter.Request{{Zone: za, Key: alice, Cost: 100, Hold: time.Hour}, {Zone: zb, Key: bob, Cost: 1}}
	d := allow(t, l, reqs...)
	if !d.Allowed || d.Held == nil {
		t.Fatalf("first request: %+v, want allowed with a hold", d)
	}
	heldKey, plainKey := limiter.StateKey("rl:", za, alice), limiter.StateKey("rl:", zb, bob)
	if h := c.Nodes[0].Do("HGET", heldKey, "h"); h != "100" {
		t.Fatalf("held zone after admission: h = %v, want 100 held", h)
	}
	if h := c.Nodes[1].Do("HGET", plainKey, "h"); h != nil {
		t.Fatalf("plain zone after admission: h = %v, want committed", h)
	}
	if got, err := l.Settle(context.Background(), d.Held, []int64{250, 0}); err != nil || !got[0] {
		t.Fatalf("settle: %v, %v", got, err)
	}
	if u := c.Nodes[0].Do("HGET", heldKey, "u"); !strings.HasPrefix(u.(string), "250") && !strings.HasPrefix(u.(string), "249.99") {
		t.Fatalf("held zone after settle: u = %v, want 250", u)
	}
	allow(t, l, reqs[1]) // the plain zone is now empty
	before, _ := strconv.ParseFloat(c.Nodes[0].Do("HGET", heldKey, "u").(string), 64)
	if d := allow(t, l, reqs...); d.Allowed || d.Zone != 1 {
		t.Fatalf("with the plain zone empty: %+v, want denied by it", d)
	}
	h := c.Nodes[0].Do("HGET", heldKey, "h")
	if u, _ := strconv.ParseFloat(c.Nodes[0].Do("HGET", heldKey, "u").(string), 64); h != nil || u > before || u < before-0.01 {
		t.Fatalf("held zone after a denial: h %v u %v, want released and u %v", h, u, before)
	}
}

// TestSettleOnBatcherUnderConcurrency: settlements ride the decisions' Batcher, mixed into
// their batches: 300 concurrent requests of cost 1, settled to 0, 1 or 2 in turn, leave the
// bucket charged exactly the sum, and every settlement finds its hold.
func TestSettleOnBatcherUnderConcurrency(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client()
	p := limiter.NewBatcher(rdb, 2)
	t.Cleanup(p.Close)
	l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Batcher: p})
	z := tb("pipe", 1000, 1000/(limiter.MaxWindow.Seconds()/2))
	var wg sync.WaitGroup
	for i := range 300 {
		wg.Go(func() {
			d, err := l.Allow(context.Background(), []limiter.Request{{Zone: z, Key: "k", Cost: 1, Hold: time.Minute}})
			if err != nil || !d.Allowed {
				t.Errorf("request %d: %+v, %v", i, d, err)
				return
			}
			if got, err := l.Settle(context.Background(), d.Held, []int64{int64(i % 3)}); err != nil || !got[0] {
				t.Errorf("settle %d: %v, %v", i, got, err)
			}
		})
	}
	wg.Wait()
	u, _ := strconv.ParseFloat(srv.Do("HGET", "rl:{k}:pipe:tb", "u").(string), 64)
	if u < 299.99 || u > 300 || srv.Do("HGET", "rl:{k}:pipe:tb", "h") != nil {
		t.Fatalf("used %v, holds %v: want 300 (100 × 0 + 100 × 1 + 100 × 2) and none left", u, srv.Do("HGET", "rl:{k}:pipe:tb", "h"))
	}
}
