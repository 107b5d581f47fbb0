package limiter_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// recordingGate is an Options.Gate that records what Decide asks of it, and refuses with refuse
// while that is set.
type recordingGate struct {
	mu       sync.Mutex
	asked    int
	released []error
	deadline time.Time // ctx's deadline at the last ask
	refuse   error
}

func (g *recordingGate) gate(ctx context.Context, _ []limiter.Request) (func(error), error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.asked++
	g.deadline, _ = ctx.Deadline()
	if g.refuse != nil {
		return nil, g.refuse
	}
	return func(err error) {
		g.mu.Lock()
		defer g.mu.Unlock()
		g.released = append(g.released, err)
	}, nil
}

// counts returns how many times g was asked, and how many outcomes it was told.
func (g *recordingGate) counts() (asked, released int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.asked, len(g.released)
}

// TestDecideOrder: Decide answers from this instance's lease grant first, then from the deny
// cache, and only then asks Gate and calls Redis. A request that a grant and a remembered denial
// both cover is admitted from the grant; one only the denial covers is denied from the cache
// (Decision.Cached), without asking Gate. (Script calls are not counted here: the grants that
// successors replaced are returned in the background.)
func TestDecideOrder(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	g := new(recordingGate)
	counts := new(leaseCounts)
	l := limiter.New(srv.Client(), limiter.Options{
		KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Minute,
		Leases: true, LeaseMetrics: counts, Gate: g.gate,
	})
	t.Cleanup(func() { _ = l.ReturnLeases(context.Background()) })
	ctx := context.Background()
	// A fixed window: its grants are counted in the window, and a denial it decides is
	// remembered (a token bucket's grants are holds, and a denial that holds make is not).
	z := &limiter.Zone{Name: "api", Algorithm: limiter.FixedWindow, Limit: 50, Window: time.Hour,
		Lease: &limiter.Lease{Max: 10, TTL: time.Minute}}
	req := limiter.Request{Zone: z, Key: "alice", Cost: 1}
	// The same client and cost, its charge held until after the response: never spent from a
	// grant, always decided in Redis (or by the deny cache).
	held := limiter.Request{Zone: z, Key: "alice", Cost: 1, Hold: time.Minute}
	decide := func(r limiter.Request) limiter.Decision {
		t.Helper()
		d, err := l.Decide(ctx, []limiter.Request{r})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}

	// Redis decides through the gate until the client is hot enough for a grant, then the
	// grant admits with no gate to ask.
	fromGrant := false
	for i := 0; !fromGrant || counts.stranded.Load() == 0; i++ {
		if i == 20 {
			t.Fatalf("20 requests and no grant with tokens left (stranded %d)", counts.stranded.Load())
		}
		before, _ := g.counts()
		if d := decide(req); !d.Allowed {
			t.Fatalf("request %d: %+v, want admitted", i+1, d)
		}
		asksAnswered(t, l)
		asked, _ := g.counts()
		fromGrant = asked == before
	}

	// Fill the window in Redis, then have it deny the held request: a denial remembered for the
	// client's cost 1.
	st, err := l.State(ctx, z, "alice")
	if err != nil {
		t.Fatal(err)
	}
	if st.Remaining > 0 {
		if d := decide(limiter.Request{Zone: z, Key: "alice", Cost: st.Remaining, Hold: time.Minute}); !d.Allowed {
			t.Fatalf("taking the %d tokens left: %+v, want admitted", st.Remaining, d)
		}
	}
	before, _ := g.counts()
	if d := decide(held); d.Allowed || d.Cached {
		t.Fatalf("held request with the window full: %+v, want denied by Redis", d)
	}
	if asked, _ := g.counts(); asked != before+1 {
		t.Fatalf("Redis's denial asked the gate %d times, want 1", asked-before)
	}
	asksAnswered(t, l)

	// Both the grant and the remembered denial cover req: the grant comes first.
	before, _ = g.counts()
	if d := decide(req); !d.Allowed || d.Cached {
		t.Fatalf("request covered by a grant and a remembered denial: %+v, want admitted from the grant", d)
	}
	if asked, _ := g.counts(); asked != before {
		t.Fatalf("a request admitted from a grant asked the gate %d times, want 0", asked-before)
	}
	asksAnswered(t, l)

	// Only the denial covers the held request: the deny cache comes before the gate and Redis,
	// and answers while the gate refuses.
	g.mu.Lock()
	g.refuse = errors.New("circuit breaker open")
	g.mu.Unlock()
	if d := decide(held); d.Allowed || !d.Cached {
		t.Fatalf("held request after Redis's denial, gate refusing: %+v, want a cached denial", d)
	}
	if asked, _ := g.counts(); asked != before {
		t.Fatalf("a cached denial asked the gate %d times, want 0", asked-before)
	}
}

// TestDecideGate: a request neither a grant nor the deny cache covers asks Gate, within
// Options.Timeout. A refusal is Decide's error, and Redis is not called; otherwise Gate is told
// the call's outcome (nil, or its error) and ObserveCall how long it took, once per call.
func TestDecideGate(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	g := new(recordingGate)
	var observed []time.Duration
	l := limiter.New(srv.Client(), limiter.Options{
		KeyPrefix: "rl:", DenyCacheKeys: 100, Gate: g.gate, Timeout: time.Hour,
		ObserveCall: func(d time.Duration) { observed = append(observed, d) },
	})
	ctx := context.Background()
	req := []limiter.Request{{Zone: tb("api", 10, 1), Key: "alice", Cost: 1}}

	// The script loaded (NOSCRIPT, then EVAL), so that a decision is one script call.
	if _, err := l.Decide(ctx, []limiter.Request{{Zone: req[0].Zone, Key: "warm-up", Cost: 1}}); err != nil {
		t.Fatal(err)
	}
	refused := errors.New("circuit breaker open")
	g.refuse = refused
	calls := srv.ScriptCalls()
	if d, err := l.Decide(ctx, req); !errors.Is(err, refused) || d != (limiter.Decision{}) {
		t.Fatalf("gate refusing: %+v, %v; want the zero Decision and the gate's error", d, err)
	}
	if got := srv.ScriptCalls(); got != calls {
		t.Fatalf("a refused decision made %d script calls, want 0", got-calls)
	}
	if asked, released := g.counts(); asked != 2 || released != 1 || len(observed) != 1 {
		t.Fatalf("gate refusing: asked %d times, told %d outcomes, %d calls observed; want 2, 1, 1 (the warm-up's)", asked, released, len(observed))
	}

	g.refuse = nil
	start := time.Now()
	d, err := l.Decide(ctx, req)
	if err != nil || !d.Allowed {
		t.Fatalf("gate allowing: %+v, %v; want admitted", d, err)
	}
	if got := srv.ScriptCalls(); got != calls+1 {
		t.Fatalf("an allowed decision made %d script calls, want 1", got-calls)
	}
	if g.deadline.Before(start.Add(time.Hour)) || g.deadline.After(time.Now().Add(time.Hour)) {
		t.Fatalf("the gate was asked under a deadline of %v, want Timeout (1h) after the decision began (%v)", g.deadline, start)
	}

	// A concurrency zone's request without a Hold fails in the limiter, after the gate allowed it.
	bad := []limiter.Request{{Zone: &limiter.Zone{Name: "conc", Algorithm: limiter.Concurrency, Limit: 1}, Key: "alice", Cost: 1}}
	_, badErr := l.Decide(ctx, bad)
	if badErr == nil {
		t.Fatal("a concurrency zone's request without a Hold was decided")
	}
	if asked, released := g.counts(); asked != 4 || released != 3 || g.released[1] != nil || g.released[2] != badErr {
		t.Fatalf("gate asked %d times, told %v; want 4 asks, and nil, nil, %v", asked, g.released, badErr)
	}
	if len(observed) != 3 {
		t.Fatalf("%d calls observed, want 3: %v", len(observed), observed)
	}
}
