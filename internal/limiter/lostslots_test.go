package limiter_test

import (
	"context"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestConcurrencyClusterFailureGivesSlotsBack: on a 3-primary Redis Cluster, a request with a
// concurrency zone keyed by a client on one node and a token bucket zone keyed by a client on
// another. The other node stalls (SIGSTOP) through the decision, which fails (its timeout). The
// slot the healthy node admitted is given back at once, as after a denial there, although the
// request's deadline was spent waiting for the stalled node; the client is admitted again as soon
// as the node is back. And the other way round: the concurrency zone on the stalled node, whose
// decision the node runs when it resumes, taking a slot no request holds: Refresh gives it back.
func TestConcurrencyClusterFailureGivesSlotsBack(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	for _, n := range c.Nodes {
		n.Do("CONFIG", "SET", "cluster-require-full-coverage", "no") // the others serve while one stalls
	}
	perNode := clientsOn(t, c, 2)
	const hold = 30 * time.Second
	zc, zt := cc("conc", 1), tb("bucket", 100, 0.001)
	l := clusterLimiter(t, c, limiter.Options{CallTimeout: time.Second})
	decide := func(slotClient, bucketClient string, timeout time.Duration) (limiter.Decision, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		return l.Allow(ctx, []limiter.Request{{Zone: zc, Key: slotClient, Cost: 1, Hold: hold}, {Zone: zt, Key: bucketClient, Cost: 1}})
	}
	slots := func(node int, client string) int64 {
		return c.Nodes[node].Do("ZCARD", limiter.StateKey("rl:", zc, client)).(int64)
	}

	t.Run("the healthy node's slot", func(t *testing.T) {
		k, u := perNode[0][0], perNode[1][0] // the slot on node 0, the bucket on node 1
		d, err := decide(k, u, 5*time.Second)
		if err != nil || !d.Allowed {
			t.Fatalf("before the stall: %+v, %v; want admitted", d, err)
		}
		settleAll(t, l, d)
		c.Nodes[1].Pause()
		t.Cleanup(c.Nodes[1].Resume)
		if d, err := decide(k, u, 100*time.Millisecond); err == nil {
			t.Fatalf("with the bucket's node stalled: %+v, want an error", d)
		}
		failed := time.Now()
		c.Nodes[1].Resume()
		redistest.WaitFor(t, 2*time.Second, "the healthy node's slot given back (hold_max is 30s)", func() bool { return slots(0, k) == 0 })
		t.Logf("the healthy node's slot given back %v after the decision failed", time.Since(failed).Round(time.Millisecond))
		d, err = decide(k, perNode[1][1], 5*time.Second)
		if err != nil || !d.Allowed {
			t.Fatalf("after the stall: %+v, %v; want admitted", d, err)
		}
		settleAll(t, l, d)
	})

	t.Run("the stalled node's slot", func(t *testing.T) {
		k, u := perNode[2][0], perNode[0][1]  // the slot on node 2, the bucket on node 0
		d, err := decide(k, u, 5*time.Second) // a connection to node 2, as under traffic
		if err != nil || !d.Allowed {
			t.Fatalf("before the stall: %+v, %v; want admitted", d, err)
		}
		settleAll(t, l, d)
		c.Nodes[2].Pause()
		t.Cleanup(c.Nodes[2].Resume)
		if d, err := decide(k, u, 100*time.Millisecond); err == nil {
			t.Fatalf("with the slot's node stalled: %+v, want an error", d)
		}
		c.Nodes[2].Resume()
		redistest.WaitFor(t, 2*time.Second, "the stalled node runs the decision it was sent", func() bool { return slots(2, k) == 1 })
		redistest.WaitFor(t, 5*time.Second, "Refresh gives the slot back", func() bool {
			_, _ = l.Refresh(context.Background())
			return slots(2, k) == 0
		})
		if n := l.LostSlots(); n != 0 {
			t.Fatalf("lost slots after the slot was given back: %d, want 0", n)
		}
	})
}

// TestConcurrencyLostSlotNeverTaken: a decision that failed before it was sent (its context
// ended first) took no slot; its slot is kept as lost, and given up after two refreshes in a row
// that find it absent, not sooner (a Redis that answered the first may not yet have run what
// was already written to it).
func TestConcurrencyLostSlotNeverTaken(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := l.Allow(ctx, []limiter.Request{{Zone: cc("conc", 1), Key: "alice", Cost: 1, Hold: time.Minute}}); err == nil {
		t.Fatal("a decision with its context ended succeeded")
	}
	for i, want := range []int{1, 1, 0} {
		if n := l.LostSlots(); n != want {
			t.Fatalf("after %d refreshes: %d lost slots, want %d", i, n, want)
		}
		if _, err := l.Refresh(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

// TestConcurrencyDroppedSlotGivenBack: a slot whose settlement is not sent (Drop: the handler's
// circuit breaker is open at the end of the response) is given back by the next Refresh, not
// left to its deadline.
func TestConcurrencyDroppedSlotGivenBack(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	z := cc("conc", 1)
	d := allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1, Hold: time.Hour})
	if !d.Allowed {
		t.Fatalf("%+v, want admitted", d)
	}
	l.Drop(d.Held)
	if l.LiveSlots() != 0 || l.LostSlots() != 1 {
		t.Fatalf("after Drop: %d slots kept alive, %d lost; want 0, 1", l.LiveSlots(), l.LostSlots())
	}
	if _, err := l.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := srv.Do("ZCARD", limiter.StateKey("rl:", z, "alice")); n != int64(0) || l.LostSlots() != 0 {
		t.Fatalf("after a Refresh: %v slots in Redis, %d lost; want 0, 0", n, l.LostSlots())
	}
}
