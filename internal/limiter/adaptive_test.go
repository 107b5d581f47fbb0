package limiter_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// adaptiveZone is an adaptive concurrency zone of ceiling limit, min limit 2, buffer 25%, an
// update every 100ms and probes of 4 samples every minute.
func adaptiveZone(name string, limit int64) *limiter.Zone {
	return &limiter.Zone{Name: name, Algorithm: limiter.AdaptiveConcurrency, Limit: limit,
		Adaptive: &limiter.Adaptive{MinLimit: 2, Buffer: 0.25, UpdateInterval: 100 * time.Millisecond, ProbeInterval: time.Minute, ProbeSamples: 4}}
}

// adaptiveRun drives an adaptive zone's requests on a settable clock across two instances.
type adaptiveRun struct {
	t   *testing.T
	clk *clock
	ls  [2]*limiter.Limiter
	req limiter.Request
}

// round admits as many requests as the limit in force lets in (alternating instances), checks
// that the next is denied, lets latency pass, settles them all with that latency (failed ones
// as failures) and returns the limit in force the round's decisions read.
func (r *adaptiveRun) round(latency time.Duration, failed int) int64 {
	r.t.Helper()
	var held []limiter.Decision
	limit := int64(-1)
	for i := 0; ; i++ {
		reqs := []limiter.Request{r.req}
		d, err := r.ls[i%2].Decide(context.Background(), reqs)
		if err != nil {
			r.t.Fatalf("Decide: %v", err)
		}
		if d.Allowed && limit >= 0 && d.Limit != limit {
			r.t.Fatalf("the limit in force moved within a round: %d then %d", limit, d.Limit)
		}
		if !d.Allowed {
			if int64(len(held)) != limit {
				r.t.Fatalf("admitted %d, want the limit in force %d", len(held), limit)
			}
			break
		}
		if limit = d.Limit; reqs[0].Result.Learnt.Limit != limit {
			r.t.Fatalf("Result.Learnt.Limit %d, Decision.Limit %d", reqs[0].Result.Learnt.Limit, limit)
		}
		held = append(held, d)
	}
	r.clk.Advance(latency)
	for i, d := range held {
		d.Held.Sample(latency, i < failed)
		if _, err := r.ls[i%2].Settle(context.Background(), d.Held, nil); err != nil {
			r.t.Fatalf("settle: %v", err)
		}
	}
	return limit
}

// TestAdaptiveConcurrencyController: Envoy's gradient controller, one limit for two instances,
// as internal/limiter/adaptive.go states it. Before any sample the limit in force is the min
// limit; the first sample starts a probe that measures the minimum latency from the requests
// admitted after it; then each update interval's samples multiply the limit by clamp(min
// latency × 1.25 / their mean, 0.5, 2): × 1.25 at the minimum latency up to the ceiling, ×
// 0.625 at twice it, × 0.5 at worse; a window with a failure by at most 0.9; never under the
// min limit. A window counts only the requests admitted since it started (so that it measures
// the limit in force) and ends once half the limit of them have ended, an update interval on:
// each round here is one window, and the next round admits against what it taught. A lower
// ceiling applies at once; the state reader shows what the decisions read.
func TestAdaptiveConcurrencyController(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	r := &adaptiveRun{t: t, clk: clk}
	for i := range r.ls {
		r.ls[i] = limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	}
	z := adaptiveZone("up", 12)
	z.Prepare()
	r.req = limiter.Request{Zone: z, Key: "u", Cost: 1, Hold: time.Minute}
	const minRTT = 100 * time.Millisecond

	// The first sample starts the probe; its 4 samples come from the next two rounds.
	for k := range 3 {
		if got := r.round(minRTT, 0); got != 2 {
			t.Fatalf("round %d, before and during the probe: limit %d, want the min limit 2", k, got)
		}
	}
	want := 2.0
	step := func(what string, latency time.Duration, failed int, factor float64) {
		t.Helper()
		if got := r.round(latency, failed); got != int64(want) {
			t.Fatalf("%s: limit in force %d, want %d", what, got, int64(want))
		}
		want = math.Min(12, math.Max(2, want*factor))
	}
	for range 11 { // 2 × 1.25^k up to the ceiling of 12
		step("at the minimum latency", minRTT, 0, 1.25)
	}
	if want != 12 {
		t.Fatalf("the limit reached %v, want the ceiling 12", want)
	}
	step("at twice the minimum latency", 2*minRTT, 0, 0.625)
	step("at ten times it", 10*minRTT, 0, 0.5)
	step("with a failure", minRTT, 1, 0.9)
	for range 3 {
		step("at the minimum latency again", minRTT, 0, 1.25)
	}
	st, err := r.ls[1].State(context.Background(), z, "u")
	if err != nil {
		t.Fatal(err)
	}
	if st.Learnt.Limit != int64(want) || st.Learnt.MinLatency != minRTT || st.Learnt.Latency != minRTT {
		t.Fatalf("state: %+v, want the limit %d, min latency and latency %v", st.Learnt, int64(want), minRTT)
	}

	r.req.Zone = adaptiveZone("up", 3) // a reload that lowers the ceiling
	if got := r.round(minRTT, 0); got != 3 {
		t.Fatalf("after lowering the ceiling to 3: limit %d", got)
	}
}
