package limiter

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

// A script call whose connection is lost after Redis ran it, before its reply was read, is
// never sent again by the client (go-redis's Redis Cluster client re-sent it on EOF, within its
// MaxRedirects): each decision and settlement runs once, and its caller gets the error (the
// handler then applies fail_mode, once).

// proxiedCluster returns a 3-primary cluster, a DropProxy in front of its first node, and a
// cluster client with the module's retry settings that reaches that node through the proxy.
func proxiedCluster(t *testing.T) (*redistest.Cluster, *redistest.DropProxy, *redis.ClusterClient) {
	t.Helper()
	c := redistest.StartCluster(t, 3)
	proxy := redistest.StartDropProxy(t, c.Nodes[0].Addr)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: -1, Dialer: proxy.Dial})
	t.Cleanup(func() { _ = cc.Close() })
	return c, proxy, cc
}

// clientOnNode returns the first client key "<prefix><i>" whose state key in zone z is in a slot
// of the i-th of n nodes (StartCluster's even split), skipping those in skip.
func clientOnNode(t *testing.T, z *Zone, prefix string, node, n int, skip map[string]bool) string {
	t.Helper()
	for i := 0; i < 10000; i++ {
		k := prefix + strconv.Itoa(i)
		s := hashSlot(StateKey("rl:", z, k))
		if !skip[k] && node*clusterSlots/n <= s && s < (node+1)*clusterSlots/n {
			skip[k] = true
			return k
		}
	}
	t.Fatalf("no client key on node %d", node)
	return ""
}

const clusterSlots = 16384

// applied is what zone z holds for client on srv: a token bucket's tokens used (u, rounded to
// 0.001, and whether a hold is left), a window counter's count, a sliding window's entries.
func applied(t *testing.T, srv *redistest.Server, z *Zone, client string) string {
	t.Helper()
	key := StateKey("rl:", z, client)
	switch z.Algorithm {
	case TokenBucket:
		u, _ := strconv.ParseFloat(srv.Do("HGET", key, "u").(string), 64)
		holds := 0
		for f := range srv.Do("HGETALL", key).(map[any]any) {
			if strings.HasPrefix(f.(string), "h:") {
				holds++
			}
		}
		return "u=" + strconv.FormatFloat(u, 'f', 3, 64) + " holds=" + strconv.Itoa(holds)
	case FixedWindow:
		v, _ := srv.Do("GET", key).(string)
		_, n, _ := strings.Cut(v, ":")
		return "count=" + n
	case SlidingWindowCounter:
		v, _ := srv.Do("HGET", key, "c").(string)
		return "count=" + v
	default:
		return "entries=" + strconv.FormatInt(srv.Do("ZCARD", key).(int64), 10)
	}
}

// TestClusterLostConnectionRunsBatchOnce: a batch of 8 decisions (two clients in each of the four
// algorithms, cost 1) and the settlement of a held token bucket charge (reserved 5, settled to
// 2), sent as one pipeline round trip to a cluster node, whose connection is lost after Redis ran
// them all: every decision is charged exactly once (u 1, count 1, 1 entry), the settlement is
// applied once (u 2, no hold left), and every caller gets an error.
func TestClusterLostConnectionRunsBatchOnce(t *testing.T) {
	t.Parallel()
	c, proxy, cc := proxiedCluster(t)
	p := NewBatcher(cc, 1)
	t.Cleanup(p.Close)
	l := New(cc, Options{KeyPrefix: "rl:", Cluster: true, Batcher: p})
	noRefill := 10 / (MaxWindow.Seconds() / 2)
	zones := []*Zone{
		{Name: "tb", Algorithm: TokenBucket, Capacity: 10, RefillRate: noRefill},
		{Name: "fw", Algorithm: FixedWindow, Limit: 10, Window: time.Hour},
		{Name: "sc", Algorithm: SlidingWindowCounter, Limit: 10, Window: time.Hour},
		{Name: "sw", Algorithm: SlidingWindow, Limit: 10, Window: time.Hour},
	}
	used := map[string]bool{}
	var reqs []Request
	for _, z := range zones {
		if err := z.Validate(); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			reqs = append(reqs, Request{Zone: z, Key: clientOnNode(t, z, "c", 0, 3, used), Cost: 1})
		}
	}
	heldZone := &Zone{Name: "held", Algorithm: TokenBucket, Capacity: 10, RefillRate: noRefill}
	heldClient := clientOnNode(t, heldZone, "h", 0, 3, used)
	ctx := context.Background()
	d, err := l.Allow(ctx, []Request{{Zone: heldZone, Key: heldClient, Cost: 5, Hold: time.Minute}})
	if err != nil || !d.Allowed || d.Held == nil {
		t.Fatalf("the charge to settle: %+v, %v", d, err)
	}

	c.Nodes[0].Do("SCRIPT", "LOAD", lua.Settle) // so that the settlement runs in the lost batch

	// Take the batcher's one round trip, so that the decisions and the settlement queue up and
	// go together in the next batch.
	p.slots <- struct{}{}
	errs := make([]error, len(reqs)+1)
	var wg sync.WaitGroup
	for i, rq := range reqs {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			var d Decision
			d, errs[i] = l.Allow(ctx, []Request{rq})
			if errs[i] == nil {
				t.Errorf("decision %d (%s, %s) answered %+v after its connection was lost", i, rq.Zone.Name, rq.Key, d)
			}
		})
	}
	wg.Go(func() {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		_, errs[len(reqs)] = l.Settle(ctx, d.Held, []int64{2})
	})
	redistest.WaitFor(t, 10*time.Second, "the decisions and the settlement queued", func() bool {
		return len(p.queue) == len(reqs)+1
	})
	proxy.Arm("")
	p.lead(nil) // sends the queue as one batch, and gives the round trip back
	wg.Wait()

	if n := proxy.Dropped(); n != 1 {
		t.Fatalf("the proxy dropped %d connections after Redis ran the batch, want 1", n)
	}
	for i, err := range errs {
		if err == nil {
			t.Errorf("call %d of the lost batch returned no error", i)
		}
	}
	for _, rq := range reqs {
		want := map[Algorithm]string{TokenBucket: "u=1.000 holds=0", FixedWindow: "count=1", SlidingWindowCounter: "count=1", SlidingWindow: "entries=1"}[rq.Zone.Algorithm]
		if got := applied(t, c.Nodes[0], rq.Zone, rq.Key); got != want {
			t.Errorf("%s of %s after the lost batch: %s, want %s (charged once)", rq.Zone.Name, rq.Key, got, want)
		}
	}
	if got := applied(t, c.Nodes[0], heldZone, heldClient); got != "u=2.000 holds=0" {
		t.Errorf("the settled bucket: %s, want u=2.000 holds=0 (settled once)", got)
	}
}

// TestClusterLostReleaseRunsOnce: zones q (fixed window, limit 10) and ip (token bucket,
// capacity 1) of one request, keyed by clients in two slots on two nodes. Once ip is empty, each
// request is admitted by q, denied by ip, and q's count released. When the connection of one
// release is lost after Redis ran it, q's count is still the first request's 1 (the release was
// applied once), and the request is still denied.
func TestClusterLostReleaseRunsOnce(t *testing.T) {
	t.Parallel()
	c, proxy, cc := proxiedCluster(t)
	l := New(cc, Options{KeyPrefix: "rl:", Cluster: true})
	q := &Zone{Name: "q", Algorithm: FixedWindow, Limit: 10, Window: time.Hour}
	ip := &Zone{Name: "ip", Algorithm: TokenBucket, Capacity: 1, RefillRate: 1 / (MaxWindow.Seconds() / 2)}
	used := map[string]bool{}
	reqs := []Request{
		{Zone: q, Key: clientOnNode(t, q, "u", 0, 3, used), Cost: 1},
		{Zone: ip, Key: clientOnNode(t, ip, "ip", 1, 3, used), Cost: 1},
	}
	ctx := context.Background()
	for i := range 3 {
		if i == 2 {
			proxy.Arm("release")
		}
		d, err := l.Allow(ctx, reqs)
		if err != nil || d.Allowed != (i == 0) {
			t.Fatalf("request %d: %+v, %v; want allowed only the first", i+1, d, err)
		}
		if got := applied(t, c.Nodes[0], q, reqs[0].Key); got != "count=1" {
			t.Fatalf("q after request %d: %s, want count=1", i+1, got)
		}
	}
	if n := proxy.Dropped(); n != 1 {
		t.Fatalf("the proxy dropped %d connections after Redis ran a release, want 1", n)
	}
}
