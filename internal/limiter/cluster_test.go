package limiter_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// clusterLimiter returns a Limiter on cluster c as the module builds one: a cluster client with
// the module's retry settings, and a Batcher.
func clusterLimiter(t *testing.T, c *redistest.Cluster, opts limiter.Options) *limiter.Limiter {
	t.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: -1, PoolSize: 32})
	t.Cleanup(func() { _ = cc.Close() })
	opts.KeyPrefix, opts.Cluster = "rl:", true
	opts.Batcher = limiter.NewBatcher(cc, 4)
	t.Cleanup(opts.Batcher.Close)
	return limiter.New(cc, opts)
}

// clientsOn returns n client keys whose slots each of c's nodes owns, n per node, in node order.
func clientsOn(t *testing.T, c *redistest.Cluster, n int) [][]string {
	t.Helper()
	keys := make([][]string, len(c.Nodes))
	for i, full := 0, 0; full < len(c.Nodes); i++ {
		k := "client-" + strconv.Itoa(i)
		slot := int(c.Nodes[0].Do("CLUSTER", "KEYSLOT", k).(int64))
		for j := range c.Nodes {
			if j*16384/len(c.Nodes) <= slot && slot < (j+1)*16384/len(c.Nodes) && len(keys[j]) < n {
				keys[j] = append(keys[j], k)
				if len(keys[j]) == n {
					full++
				}
			}
		}
	}
	return keys
}

// TestClusterExactUnderConcurrency: on a 3-primary cluster, 4 instances race 2,000 requests
// for each of 6 clients (2 on each primary), capacity/limit 100: each client gets exactly 100.
func TestClusterExactUnderConcurrency(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	perNode := clientsOn(t, c, 2)
	var clients []string
	for _, ks := range perNode {
		clients = append(clients, ks...)
	}
	noRefill := 100 / (limiter.MaxWindow.Seconds() / 2)
	for _, z := range []*limiter.Zone{tb("bucket", 100, noRefill), sw("window", 100, time.Hour)} {
		t.Run(z.Name, func(t *testing.T) {
			ls := make([]*limiter.Limiter, 4)
			for i := range ls {
				ls[i] = clusterLimiter(t, c, limiter.Options{DenyCacheKeys: limiter.DefaultDenyCacheKeys})
			}
			const requests = 2000
			admitted := make([]atomic.Int64, len(clients))
			var failed atomic.Int64
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := 0; i < requests*len(clients); i++ {
				wg.Add(1)
				go func(l *limiter.Limiter, client int) {
					defer wg.Done()
					<-start
					reqs := []limiter.Request{{Zone: z, Key: clients[client], Cost: 1}}
					if _, ok := l.Denied(reqs); ok {
						return
					}
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					defer cancel()
					d, err := l.Allow(ctx, reqs)
					if err != nil {
						failed.Add(1)
						return
					}
					if d.Allowed {
						admitted[client].Add(1)
					}
				}(ls[i%len(ls)], i%len(clients))
			}
			close(start)
			wg.Wait()
			if n := failed.Load(); n > 0 {
				t.Fatalf("%d decisions failed", n)
			}
			for i, k := range clients {
				if n := admitted[i].Load(); n != 100 {
					t.Errorf("client %s (node %d): admitted %d of %d, want exactly 100", k, i/2, n, requests)
				}
			}
			// Every client's state is on the node that owns its slot.
			for i, k := range clients {
				key := limiter.StateKey("rl:", z, k)
				if got := c.Nodes[i/2].Do("EXISTS", key).(int64); got != 1 {
					t.Errorf("key %s is not on node %d", key, i/2)
				}
			}
		})
	}
}

// TestClusterCrossSlotDenialChargesNeither: a request with zones keyed by two clients in
// different slots (on different nodes) is decided per slot; when one slot denies, the zone of
// the other slot, which admitted, is refunded: neither is charged.
func TestClusterCrossSlotDenialChargesNeither(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	perNode := clientsOn(t, c, 1)
	alice, bob := perNode[0][0], perNode[1][0]         // on node 0 and node 1
	noRefill := 10 / (limiter.MaxWindow.Seconds() / 2) // no refill during the test
	for _, algo := range []string{"tb", "sw", "fw", "sc"} {
		t.Run(algo, func(t *testing.T) {
			za, zb := tb(algo+"-a", 10, noRefill), tb(algo+"-b", 1, noRefill/10)
			switch algo {
			case "sw":
				za, zb = sw(algo+"-a", 10, time.Hour), sw(algo+"-b", 1, time.Hour)
			case "fw":
				za, zb = fw(algo+"-a", 10, limiter.Month, nil), fw(algo+"-b", 1, limiter.Month, nil)
			case "sc":
				za, zb = sc(algo+"-a", 10, 24*time.Hour), sc(algo+"-b", 1, 24*time.Hour)
			}
			l := clusterLimiter(t, c, limiter.Options{})
			both := []limiter.Request{{Zone: za, Key: alice, Cost: 3}, {Zone: zb, Key: bob, Cost: 1}}

			d := allow(t, l, both...)
			if !d.Allowed {
				t.Fatalf("first request: %+v, want allowed", d)
			}
			before := zoneState(t, c.Nodes[0], limiter.StateKey("rl:", za, alice))
			d = allow(t, l, both...)
			if d.Allowed || d.Zone != 1 {
				t.Fatalf("second request: %+v, want denied by zone b", d)
			}
			if after := zoneState(t, c.Nodes[0], limiter.StateKey("rl:", za, alice)); after != before {
				t.Fatalf("zone a after the denied request: %s, want %s (refunded)", after, before)
			}
			// Zone a alone still has exactly 10 - 3 = 7 to give.
			n := 0
			for allow(t, l, both[0]).Allowed {
				n++
			}
			if n != 2 { // cost 3: 7 tokens admit two more
				t.Fatalf("zone a admitted %d more requests of cost 3, want 2", n)
			}
		})
	}
}

// zoneState renders a zone key's state: a token bucket's tokens (rounded to 0.001, so that a
// refill of microseconds does not show), or a window's entry count.
func zoneState(t *testing.T, s *redistest.Server, key string) string {
	t.Helper()
	switch s.Do("TYPE", key) {
	case "hash":
		if c, ok := s.Do("HGET", key, "c").(string); ok { // a sliding window counter
			return "count " + c
		}
		v, _ := strconv.ParseFloat(s.Do("HGET", key, "t").(string), 64)
		return fmt.Sprintf("tokens %.3f", v)
	case "string": // a fixed window
		return "window " + s.Do("GET", key).(string)
	case "zset":
		return fmt.Sprintf("entries %d", s.Do("ZCARD", key))
	default:
		return "absent"
	}
}

// TestClusterReshardingKeepsExactCounts: one client's 24 zones (24 keys in the client's slot),
// each with capacity 30, are hammered while the slot migrates to another node two keys at a time
// (ASK redirections during the migration, MOVED after it); each zone admits exactly 30.
func TestClusterReshardingKeepsExactCounts(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	const zones, capacity = 24, 30
	const client = "alice"
	slot := int(c.Nodes[0].Do("CLUSTER", "KEYSLOT", client).(int64))
	from := c.NodeOf(slot)
	to := c.Nodes[0]
	if to == from {
		to = c.Nodes[1]
	}
	noRefill := capacity / (limiter.MaxWindow.Seconds() / 2)
	zs := make([]*limiter.Zone, zones)
	for i := range zs {
		zs[i] = tb("z"+strconv.Itoa(i), capacity, noRefill)
	}
	ls := []*limiter.Limiter{clusterLimiter(t, c, limiter.Options{}), clusterLimiter(t, c, limiter.Options{})}
	// Every zone's key exists before the migration starts, so that there is something to move.
	for _, z := range zs {
		if !allow(t, ls[0], limiter.Request{Zone: z, Key: client, Cost: 1}).Allowed {
			t.Fatal("first request denied")
		}
	}
	admitted := make([]atomic.Int64, zones)
	for i := range admitted {
		admitted[i].Store(1)
	}
	var failed, decided atomic.Int64
	var errMu sync.Mutex
	var firstErr error
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; ; i += 8 {
				select {
				case <-stop:
					return
				default:
				}
				zone := i % zones
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				d, err := ls[w%2].Allow(ctx, []limiter.Request{{Zone: zs[zone], Key: client, Cost: 1}})
				cancel()
				decided.Add(1)
				if err != nil {
					failed.Add(1)
					errMu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					errMu.Unlock()
					continue
				}
				if d.Allowed {
					admitted[zone].Add(1)
				}
			}
		}(w)
	}
	// Migrate while decisions run: each batch of 2 keys waits for 50 more decisions.
	c.MoveSlot(slot, from, to, 2, func() {
		target := decided.Load() + 50
		for deadline := time.Now().Add(10 * time.Second); decided.Load() < target && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
	})
	// Keep going after the migration until every zone has met its limit.
	deadline := time.Now().Add(30 * time.Second)
	for {
		done := true
		for i := range admitted {
			done = done && admitted[i].Load() >= capacity
		}
		if done || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	after := decided.Load()
	for decided.Load() < after+int64(4*zones) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond) // a few more rounds past the limit
	}
	close(stop)
	wg.Wait()
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d of %d decisions failed during the resharding; first: %v", n, decided.Load(), firstErr)
	}
	for i, z := range zs {
		if n := admitted[i].Load(); n != capacity {
			t.Errorf("zone %s admitted %d times, want exactly %d", z.Name, n, capacity)
		}
	}
	if got := to.Do("EXISTS", limiter.StateKey("rl:", zs[0], client)).(int64); got != 1 {
		t.Fatalf("after the resharding, the state is not on the new owner")
	}
	t.Logf("%d decisions; the limits were all met after %d; slot %d moved from %s to %s", decided.Load(), after, slot, from.Addr, to.Addr)
}

// TestClusterTryAgainDuringMigration: a request of two zones of one client whose slot is being
// migrated, one of its two keys moved already: Redis refuses the call with TRYAGAIN (it runs
// nothing); the limiter sends it again (go-redis no longer does: see limiter/script.go) until the
// migration has moved the other key, and the request is admitted, each zone charged once.
func TestClusterTryAgainDuringMigration(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	const client = "alice"
	slot := int(c.Nodes[0].Do("CLUSTER", "KEYSLOT", client).(int64))
	from := c.NodeOf(slot)
	to := c.Nodes[0]
	if to == from {
		to = c.Nodes[1]
	}
	noRefill := 10 / (limiter.MaxWindow.Seconds() / 2)
	za, zb := tb("a", 10, noRefill), tb("b", 10, noRefill)
	l := clusterLimiter(t, c, limiter.Options{Now: newClock().Now}) // a still clock: no refill
	both := []limiter.Request{{Zone: za, Key: client, Cost: 1}, {Zone: zb, Key: client, Cost: 1}}
	allow(t, l, both...) // both keys exist, to be migrated one at a time
	type result struct {
		d   limiter.Decision
		err error
	}
	done := make(chan result, 1)
	started := false
	c.MoveSlot(slot, from, to, 1, func() {
		if started {
			return
		}
		started = true
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			d, err := l.Allow(ctx, both)
			done <- result{d, err}
		}()
		redistest.WaitFor(t, 10*time.Second, "the call refused with TRYAGAIN", func() bool { return from.Errors("TRYAGAIN") > 0 })
	})
	r := <-done
	if r.err != nil || !r.d.Allowed {
		t.Fatalf("the request during the migration: %+v, %v; want admitted", r.d, r.err)
	}
	for _, z := range []*limiter.Zone{za, zb} {
		if u := to.Do("HGET", limiter.StateKey("rl:", z, client), "u"); u != "2" {
			t.Errorf("zone %s on the new owner: u = %v, want 2 (charged once by each request)", z.Name, u)
		}
	}
}
