package ratelimitredis

// The Redis client (redis_client.go): a reply lost after Redis ran the call is not sent again,
// a Redis Cluster's breaker per node and a reshard, a Sentinel failover.

import (
	"bytes"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

// clusterClientOf returns the shared Redis client (in the clients pool) of the cluster whose
// seeds are addrs.
func clusterClientOf(t *testing.T, addrs []string) *sharedClient {
	t.Helper()
	var found *sharedClient
	clients.Range(func(_, v any) bool {
		if c, ok := v.(*sharedClient); ok && c.cluster && slices.Equal(c.addrs, addrs) {
			found = c
		}
		return found == nil
	})
	if found == nil {
		t.Fatal("no shared cluster client for the test's cluster")
	}
	return found
}

// TestClusterBreakerPerNode: on a 3-primary Redis Cluster, one node stalled (SIGSTOP) fails
// only the decisions of its own slots. Its clients get fail_mode (closed: 503), first after the
// timeout, then at once when its circuit breaker has opened; meanwhile — even while its
// decisions are in flight — the clients of the other nodes get exact Redis decisions, and their
// breakers stay closed with no failure. A request whose zones are on a healthy node and on the
// stalled one fails at once without charging the healthy node. The logs name the node whose
// breaker opened. Once the node answers again, a probe closes its breaker.
func TestClusterBreakerPerNode(t *testing.T) {
	const breakerOpenFor = 2 * time.Second // no probe while the test looks at the open breaker
	c := redistest.StartCluster(t, 3)
	for _, n := range c.Nodes {
		// The other nodes keep serving their slots when they mark the stalled one as failed.
		n.Do("CONFIG", "SET", "cluster-require-full-coverage", "no")
	}
	lc := startLoggedCaddy(t, fmt.Sprintf(`
	rate_limit_redis_tuned breaker_open_for=2s {
		redis {
			address %s
		}
		fail_mode closed
		timeout 1s
		zone user {
			key {http.request.header.X-User}
			capacity 3
			refill_rate 1/24h
		}
		zone org {
			match header X-Org *
			key {http.request.header.X-Org}
			capacity 5
			refill_rate 1/24h
		}
	}
	respond "ok"`, strings.Join(c.Addrs(), " ")))
	shared := clusterClientOf(t, c.Addrs())

	// Two clients per node, by the slot of their hash tag.
	byNode := make(map[*redistest.Server][]string)
	for i := 0; len(byNode) < 3 || len(byNode[c.Nodes[0]])+len(byNode[c.Nodes[1]])+len(byNode[c.Nodes[2]]) < 6; i++ {
		u := "node-client-" + strconv.Itoa(i)
		n := c.NodeOf(int(c.Nodes[0].Do("CLUSTER", "KEYSLOT", u).(int64)))
		if len(byNode[n]) < 2 {
			byNode[n] = append(byNode[n], u)
		}
	}
	stalled := c.Nodes[1]
	var healthy []string
	for _, n := range c.Nodes {
		if n != stalled {
			healthy = append(healthy, byNode[n]...)
		}
	}
	for _, u := range append(slices.Clone(healthy), byNode[stalled]...) {
		lc.Get("/", "X-User", u).Expect(t, "redis up: "+u, 200, "ok", "X-RateLimit-Remaining", "2")
	}
	nodeBreaker := func(n *redistest.Server) *breaker {
		v, ok := shared.nodes.Load(n.Addr)
		if !ok {
			t.Fatalf("no breaker for node %s", n.Addr)
		}
		return v.(*redisNode).breaker
	}

	stalled.Pause()
	t.Cleanup(stalled.Resume) // before the cluster is stopped
	// The stalled node's clients: breakerTrips decisions in flight together, each waiting for
	// the timeout...
	sent := nodeBreaker(stalled).allowed.Load()
	load := caddytest.NewLoadClient(lc.Site)
	var wg sync.WaitGroup
	stalledStatus := make([]int, breakerTrips)
	for i := range breakerTrips {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := load.Get("/", "X-User", byNode[stalled][i%2])
			if err == nil {
				stalledStatus[i] = r.Status
			}
		}()
	}
	redistest.WaitFor(t, 900*time.Millisecond, "the stalled node's decisions are under way", func() bool {
		return nodeBreaker(stalled).allowed.Load() == sent+breakerTrips
	})
	// ... while the other nodes' clients are decided exactly, without waiting for them.
	start := time.Now()
	for _, u := range healthy {
		lc.Get("/", "X-User", u).Expect(t, "healthy node, stalled one in flight: "+u, 200, "ok", "X-RateLimit-Remaining", "1")
	}
	if d := time.Since(start); d >= time.Second {
		t.Errorf("the healthy nodes' %d decisions took %v: they waited for the stalled node", len(healthy), d)
	}
	wg.Wait()
	for i, s := range stalledStatus {
		if s != http.StatusServiceUnavailable {
			t.Fatalf("stalled node's request %d: status %d, want 503 (fail_mode closed)", i, s)
		}
	}
	if st := nodeBreaker(stalled).State(); st != gobreaker.StateOpen {
		t.Fatalf("the stalled node's breaker is %s, want open", st)
	}
	// Now at once: the open breaker answers.
	for _, u := range byNode[stalled] {
		start := time.Now()
		lc.Get("/", "X-User", u).Expect(t, "stalled node, breaker open: "+u, 503, "", "Retry-After", "1")
		if d := time.Since(start); d >= time.Second {
			t.Errorf("a decision for the open breaker's node took %v", d)
		}
	}
	// A request on a healthy node and on the stalled one: refused at once, nothing charged.
	lc.Get("/", "X-User", healthy[0], "X-Org", byNode[stalled][0]).Expect(t, "zones on two nodes, one open", 503, "", "Retry-After", "1")
	for _, u := range healthy {
		lc.Get("/", "X-User", u).Expect(t, "healthy node: "+u, 200, "ok", "X-RateLimit-Remaining", "0")
		lc.Get("/", "X-User", u).Expect(t, "healthy node, exhausted: "+u, 429, "", "X-RateLimit-Remaining", "0")
	}
	for _, n := range c.Nodes {
		b := nodeBreaker(n)
		if n == stalled {
			continue
		}
		if st, counts := b.State(), b.Counts(); st != gobreaker.StateClosed || counts.TotalFailures != 0 {
			t.Errorf("healthy node %s: breaker %s with %+v, want closed with no failure", n.Addr, st, counts)
		}
	}
	if st := shared.breaker.State(); st != gobreaker.StateClosed {
		t.Errorf("the cluster's slot map breaker is %s, want closed", st)
	}
	opened := withMsg(ours(lc.lines()), "redis failing: circuit breaker open; fail_mode applies without calling redis")
	if len(opened) != 1 || opened[0].fields["redis"] != stalled.Addr || opened[0].fields["cluster"] != strings.Join(c.Addrs(), ",") {
		t.Fatalf("breaker opening lines: %v; want one naming node %s", opened, stalled.Addr)
	}

	stalled.Resume()
	redistest.WaitFor(t, 2*breakerOpenFor+5*time.Second, "a probe closes the node's breaker once it answers", func() bool {
		return lc.Get("/", "X-User", byNode[stalled][0]).Status == http.StatusOK
	})
	if st := nodeBreaker(stalled).State(); st != gobreaker.StateClosed {
		t.Fatalf("the node's breaker is %s after it answered, want closed", st)
	}
	if len(withMsg(ours(lc.lines()), "redis answering again: circuit breaker closed")) != 1 {
		t.Error("no line says the node's breaker closed")
	}
}

// TestClusterReshardFailsOnlyTheMovingSlot: a slot holding a client's two keys (a token bucket
// zone's, made before 5,000 other keys of the slot, and a fixed window zone's, made after them)
// moves to another node under load, by the commands `redis-cli --cluster reshard` sends
// (SETSLOT IMPORTING and MIGRATING, MIGRATE … KEYS 10 at a time, SETSLOT NODE): the two keys move
// about two seconds apart, and the client's two-key decisions meanwhile get TRYAGAIN until they
// give up (their timeout, or 10 sends), then fail_mode (closed: 503). That is the slot's state, not the node's: a bystander client in
// another slot of the same node gets Redis's decision every time (no 503: neither the node's
// circuit breaker counts a failure, nor do its decisions wait behind the re-sent ones), and the
// moving client is never admitted more than Redis counts.
func TestClusterReshardFailsOnlyTheMovingSlot(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode closed
		timeout 1s # a loaded machine must not fail the bystander: the test expects Redis's answers
		zone tb {
			match path /both /tbonly
			key {http.request.header.X-K}
			capacity 100000
			refill_rate 1
		}
		zone fw {
			match path /both
			key {http.request.header.X-K}
			algorithm fixed_window
			limit 100000
			window 24h
		}
	}
	respond "ok"`, strings.Join(c.Addrs(), " ")))
	shared := clusterClientOf(t, c.Addrs())
	keySlot := func(k string) int { return int(c.Nodes[0].Do("CLUSTER", "KEYSLOT", k).(int64)) }
	const moving = "mover"
	slot := keySlot(moving)
	from := c.NodeOf(slot)
	to := c.Nodes[0]
	if to == from {
		to = c.Nodes[1]
	}
	bystander := ""
	for i := 0; bystander == ""; i++ {
		if k := "bystander-" + strconv.Itoa(i); keySlot(k) != slot && c.NodeOf(keySlot(k)) == from {
			bystander = k
		}
	}
	// The token bucket's key first, then the padding, then the fixed window's key: a migration
	// moves a slot's newest keys first, so the two keys move at either end of it.
	cs.Get("/tbonly", "X-K", moving).Expect(t, "the token bucket's key", 200, "ok")
	pad := from.Client()
	for i := 0; i < 5000; i += 500 {
		p := pad.Pipeline()
		for j := i; j < i+500; j++ {
			p.Set(t.Context(), "{"+moving+"}:pad:"+strconv.Itoa(j), "x", 0)
		}
		if _, err := p.Exec(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	cs.Get("/both", "X-K", moving).Expect(t, "the fixed window's key", 200, "ok")

	type answer struct {
		at     time.Time
		status int
	}
	var mu sync.Mutex
	answers := map[string][]answer{}
	var bystanderSent atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	lc := caddytest.NewLoadClient(cs)
	for _, k := range []string{moving, moving, bystander} {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				r, err := lc.Get("/both", "X-K", k)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				answers[k] = append(answers[k], answer{time.Now(), r.Status})
				mu.Unlock()
				if k == bystander {
					bystanderSent.Add(1)
				}
			}
		})
	}
	failures := func() (f [2]float64) {
		for i, reason := range []string{"redis_error", "timeout"} {
			f[i] = testutil.ToFloat64(metrics.backendFailures.WithLabelValues(reason))
		}
		return f
	}
	before := failures()
	start := time.Now()
	c.MoveSlot(slot, from, to, 10, func() {
		// Each batch waits for a bystander's decision: the migration runs under its load.
		next := bystanderSent.Load() + 1
		for deadline := time.Now().Add(time.Second); bystanderSent.Load() < next && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
	})
	moved := time.Now()
	time.Sleep(200 * time.Millisecond) // a few decisions after the move too
	close(stop)
	wg.Wait()

	if n := from.Errors("TRYAGAIN"); n == 0 {
		t.Fatal("no call was refused with TRYAGAIN: the client's two keys were never split")
	}
	count := func(k string) (codes map[int]int, first, last time.Duration) {
		codes = map[int]int{}
		for _, a := range answers[k] {
			codes[a.status]++
			if a.status != 200 {
				if first == 0 {
					first = a.at.Sub(start)
				}
				last = a.at.Sub(start)
			}
		}
		return codes, first, last
	}
	byCodes, _, _ := count(bystander)
	movCodes, first, last := count(moving)
	after := failures()
	t.Logf("migration of %d keys: %v; moving client %v (not 200 from %v to %v; backend failures: redis_error %v, timeout %v); bystander %v",
		5002, moved.Sub(start).Round(time.Millisecond), movCodes, first.Round(time.Millisecond), last.Round(time.Millisecond),
		after[0]-before[0], after[1]-before[1], byCodes)
	if byCodes[200] != len(answers[bystander]) || byCodes[200] < 10 {
		t.Errorf("bystander (slot %d on the source node, not moved): %v; want only 200s", keySlot(bystander), byCodes)
	}
	if movCodes[200]+movCodes[503] != len(answers[moving]) {
		t.Errorf("moving client: %v; want 200 or 503 (fail_mode closed)", movCodes)
	}
	v, ok := shared.nodes.Load(from.Addr)
	if !ok {
		t.Fatalf("no breaker for the source node %s", from.Addr)
	}
	if b := v.(*redisNode).breaker; b.State() != gobreaker.StateClosed || b.Counts().TotalFailures != 0 {
		t.Errorf("the source node's breaker: %s with %+v; want closed with no failure counted", b.State(), b.Counts())
	}
	// Counted in Redis: every admitted request, and a 503 whose call, sent again, ran just after
	// its timeout (a lost reply: charged once, never admitted).
	fw := limiter.StateKey(DefaultKeyPrefix, &limiter.Zone{Name: "fw", Algorithm: limiter.FixedWindow}, moving)
	fwv := to.Do("GET", fw)
	_, counted, _ := strings.Cut(fmt.Sprint(fwv), ":")
	if n, _ := strconv.Atoi(counted); n < movCodes[200]+1 || n > movCodes[200]+1+movCodes[503] {
		t.Errorf("the moving client's fixed window on the new owner: %v; want a count of %d (admitted) to %d (and its 503s)",
			fwv, movCodes[200]+1, movCodes[200]+1+movCodes[503])
	}
}

// TestDroppedReplyAppliedOnce: with the module's client settings, a decision whose connection
// drops after Redis ran it is applied exactly once (go-redis does not send it again): the call
// fails, fail_mode applies, and the sliding window's first request is not locked out by its own
// entry. The same holds for a Redis Cluster release.
func TestDroppedReplyAppliedOnce(t *testing.T) {
	srv := redistest.Start(t)
	srv.Do("SCRIPT", "LOAD", lua.Decide)
	var armed atomic.Bool
	var dropped atomic.Int32
	rdb := droppingClient(t, resolvedRedis{Addresses: []string{srv.Addr}, DialTimeout: time.Second}, scriptSHA(lua.Decide), &armed, &dropped)
	p := limiter.NewBatcher(rdb, roundTrips)
	t.Cleanup(p.Close)
	l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Batcher: p})
	for _, z := range []*limiter.Zone{
		{Name: "bucket", Algorithm: limiter.TokenBucket, Capacity: 10, RefillRate: 10 / limiter.MaxWindow.Seconds()},
		{Name: "window", Algorithm: limiter.SlidingWindow, Limit: 1, Window: time.Hour},
	} {
		armed.Store(true)
		before := dropped.Load()
		_, err := l.Decide(context.Background(), []limiter.Request{{Zone: z, Key: "bob", Cost: 1}})
		if err == nil || dropped.Load() != before+1 {
			t.Fatalf("%s: Allow with a dropped reply: %v (dropped %d), want an error", z.Name, err, dropped.Load()-before)
		}
		st, err := l.State(context.Background(), z, "bob")
		if err != nil {
			t.Fatal(err)
		}
		if want := z.Quota() - 1; st.Remaining != want {
			t.Fatalf("%s: %d remaining after one dropped decision, want %d: applied exactly once", z.Name, st.Remaining, want)
		}
	}

	// A release whose reply is lost, on a Redis Cluster: applied once.
	c := redistest.StartCluster(t, 1)
	c.Nodes[0].Do("SCRIPT", "LOAD", lua.Settle)
	crdb := droppingClient(t, resolvedRedis{Addresses: c.Addrs(), Cluster: true, DialTimeout: time.Second}, scriptSHA(lua.Settle), &armed, &dropped)
	cl := limiter.New(crdb, limiter.Options{KeyPrefix: "rl:", Cluster: true})
	a := &limiter.Zone{Name: "a", Algorithm: limiter.TokenBucket, Capacity: 10, RefillRate: 10 / limiter.MaxWindow.Seconds()}
	b := &limiter.Zone{Name: "b", Algorithm: limiter.SlidingWindow, Limit: 1, Window: time.Hour}
	mustDecide := func(reqs ...limiter.Request) limiter.Decision {
		d, err := cl.Decide(context.Background(), reqs)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	mustDecide(limiter.Request{Zone: b, Key: "org1", Cost: 1})  // org1 at its limit
	mustDecide(limiter.Request{Zone: a, Key: "alice", Cost: 6}) // 4 left
	armed.Store(true)
	before := dropped.Load()
	if d := mustDecide(limiter.Request{Zone: a, Key: "alice", Cost: 3}, limiter.Request{Zone: b, Key: "org1", Cost: 1}); d.Allowed {
		t.Fatalf("cross-slot request: %+v, want denied by zone b", d)
	}
	if dropped.Load() != before+1 {
		t.Fatal("the release's reply was not dropped")
	}
	st, err := cl.State(context.Background(), a, "alice")
	if err != nil {
		t.Fatal(err)
	}
	if st.Tokens < 3.99 || st.Tokens > 4.01 {
		t.Fatalf("zone a after a release whose reply was lost: %.3f tokens, want 4: released exactly once", st.Tokens)
	}
}

// TestSentinelFailover: a handler on a Sentinel-monitored primary keeps deciding while the
// primary is killed under load: decisions fail (fail_mode closed: 503) until the Sentinels
// promote the replica, then resume on it with no restart or reload. Replication is asynchronous,
// so the failover may lose the last writes the primary acknowledged; the test measures that loss
// from the replica's state and shows the new primary admits exactly what it holds: over-admission
// is exactly the writes the failover lost, never more.
func TestSentinelFailover(t *testing.T) {
	ss := redistest.StartSentinels(t, time.Second)
	const capacity = 400
	h := provisioned(t, &Handler{
		Redis:    &RedisConfig{Addresses: ss.Addrs(), Sentinel: ss.Master},
		FailMode: FailClosed,
		Timeout:  caddy.Duration(200 * time.Millisecond),
		Zones:    []*Zone{{Name: "z", Capacity: NumberOf(capacity), RefillRate: NumberOf(capacity / (limiter.MaxWindow.Seconds() / 2))}},
	})
	// serve's requests carry no client IP: all count under the zone's key for an empty client key.
	key := limiter.StateKey(DefaultKeyPrefix, &h.Zones[0].lz, "")

	var admitted, denied, failed atomic.Int64
	var killed atomic.Bool
	var recoveredAt atomic.Int64 // unix ns of the first decision started after the kill that Redis decided
	const workers = 4
	iterations := make([]atomic.Int64, workers)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				// Only a decision started after the kill tells that the new primary answers: one
				// under way at the kill may have had its reply from the old primary.
				afterKill := killed.Load()
				_, err, next := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
				var he caddyhttp.HandlerError
				switch {
				case err == nil && next:
					admitted.Add(1)
				case errors.As(err, &he) && he.StatusCode == 429:
					denied.Add(1)
				case errors.As(err, &he) && he.StatusCode == 503:
					failed.Add(1)
				default:
					t.Errorf("unexpected outcome: err %v, next %t", err, next)
				}
				if afterKill && (err == nil || he.StatusCode == 429) {
					recoveredAt.CompareAndSwap(0, time.Now().UnixNano())
				}
				iterations[w].Add(1)
			}
		}(w)
	}
	defer func() { close(stop); wg.Wait() }()

	redistest.WaitFor(t, 10*time.Second, "150 admitted requests", func() bool { return admitted.Load() >= 150 })
	ss.Primary.Stop() // SIGKILL
	killAt := time.Now()
	killed.Store(true)
	// Every worker finishes the decision it had under way at the kill: from then on, admitted
	// counts only what the new primary admits.
	var at [workers]int64
	for w := range at {
		at[w] = iterations[w].Load()
	}
	redistest.WaitFor(t, 5*time.Second, "the workers to move past the kill", func() bool {
		for w := range at {
			if iterations[w].Load() < at[w]+2 {
				return false
			}
		}
		return true
	})
	admittedByOld := admitted.Load()
	if recoveredAt.Load() != 0 {
		t.Fatal("decisions succeeded before the Sentinels could promote the replica")
	}
	tokens, err := ss.Replica.Client().HGet(context.Background(), key, "t").Float64()
	if err != nil {
		t.Fatalf("reading the bucket %s on the replica: %v (keys: %v)", key, err, ss.Replica.Do("KEYS", "*"))
	}
	onReplica := int64(math.Floor(tokens + 1e-9)) // what the new primary will have to give

	redistest.WaitFor(t, 30*time.Second, "decisions to resume and the bucket to run out", func() bool {
		return recoveredAt.Load() != 0 && denied.Load() >= 10
	})
	close(stop)
	wg.Wait()
	stop = make(chan struct{})

	recovery := time.Duration(recoveredAt.Load() - killAt.UnixNano())
	lost := admittedByOld - (capacity - onReplica) // acknowledged by the old primary, never replicated
	t.Logf("Sentinel failover: decisions resumed %.2fs after the primary was killed (down-after-milliseconds 1000); "+
		"%d admitted before the kill; lost by asynchronous replication: %d (negative: charges whose replies the kill cut off); %d failed (503) meanwhile",
		recovery.Seconds(), admittedByOld, lost, failed.Load())
	if after := admitted.Load() - admittedByOld; after != onReplica {
		t.Fatalf("the new primary admitted %d, want exactly the %d tokens it held", after, onReplica)
	}
	if over := admitted.Load() - capacity; over != lost {
		t.Fatalf("over-admission %d, want exactly the %d writes the failover lost", over, lost)
	}
	if role := ss.Replica.Do("ROLE").([]any)[0]; role != "master" {
		t.Fatalf("the replica's role is %v after the failover, want master", role)
	}
}

// dropConn wraps a connection: after it writes a command carrying marker while armed, its next
// Read waits for Redis to have run the command, then fails as a dropped connection does.
type dropConn struct {
	net.Conn
	marker  []byte
	armed   *atomic.Bool
	drop    bool
	dropped *atomic.Int32
}

func (c *dropConn) Write(b []byte) (int, error) {
	if bytes.Contains(b, c.marker) && c.armed.CompareAndSwap(true, false) {
		c.drop = true
	}
	return c.Conn.Write(b)
}

func (c *dropConn) Read(b []byte) (int, error) {
	if c.drop {
		c.drop = false
		time.Sleep(50 * time.Millisecond) // Redis has run the script by now
		c.dropped.Add(1)
		_ = c.Conn.Close()
		return 0, io.EOF
	}
	return c.Conn.Read(b)
}

// droppingClient is the module's go-redis client for r, whose connections drop once after the
// command carrying marker is sent, when armed.
func droppingClient(t *testing.T, r resolvedRedis, marker string, armed *atomic.Bool, dropped *atomic.Int32) redis.UniversalClient {
	t.Helper()
	opts, err := r.options()
	if err != nil {
		t.Fatal(err)
	}
	opts.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &dropConn{Conn: c, marker: []byte(marker), armed: armed, dropped: dropped}, nil
	}
	rdb := redis.NewUniversalClient(opts)
	t.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

func scriptSHA(src string) string { h := sha1.Sum([]byte(src)); return hex.EncodeToString(h[:]) }
