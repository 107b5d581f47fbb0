package ratelimitredis

// Decision correctness and bounded work through the handler: what the November 2026 reviews
// found, each a property the module keeps.

import (
	"bytes"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

// reload loads site into the running Caddy of cs, on the same port, and returns once it serves
// alone (cs.load).
func (cs *caddyServer) reload(site string) {
	cs.t.Helper()
	port, err := strconv.Atoi(strings.TrimPrefix(cs.base, "http://127.0.0.1:"))
	if err != nil {
		cs.t.Fatal(err)
	}
	if err := cs.load(site, port); err != nil {
		cs.t.Fatalf("reload: %v", err)
	}
}

// statuses sends n requests and returns their status codes, space separated.
func (cs *caddyServer) statuses(n int, path string, header ...string) string {
	codes := make([]string, n)
	for i := range codes {
		codes[i] = strconv.Itoa(cs.get(path, header...).status)
	}
	return strings.Join(codes, " ")
}

// TestReloadChangesCapacityAtOnce: a reload that raises a token bucket's capacity gives an
// exhausted client the difference at once, and one that lowers it takes it away, with the deny
// cache on (a reload starts a new, empty one).
func TestReloadChangesCapacityAtOnce(t *testing.T) {
	srv := redistest.Start(t)
	site := func(capacity int) string {
		return fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		timeout 2s # a loaded machine must not make a decision fail: the test expects Redis's answers
		key {http.request.header.X-Key}
		capacity %d
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr, capacity)
	}
	cs := startCaddy(t, site(2))
	if got := cs.statuses(4, "/", "X-Key", "k"); got != "200 200 429 429" {
		t.Fatalf("capacity 2: %s", got)
	}
	cs.reload(site(12))
	if got := cs.statuses(11, "/", "X-Key", "k"); got != strings.TrimSpace(strings.Repeat("200 ", 10))+" 429" {
		t.Fatalf("raised to 12: %s, want exactly 10 more then 429", got)
	}
	cs.reload(site(5))
	r := cs.get("/", "X-Key", "k")
	// 12 used under capacity 5: 8 tokens must drain, at 1 per hour, before a cost of 1 fits.
	if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); r.status != 429 || ra < 8*3600-2 || ra > 8*3600 {
		t.Fatalf("lowered to 5: %d Retry-After %q, want 429 after 8h", r.status, r.header.Get("Retry-After"))
	}
}

// TestDenyCacheAnswersAsRedis: through Caddy, a cached denial of cost 1 gives a request of
// another cost the answer Redis gives it: a cost of 2 its own, longer Retry-After, a cost above
// the capacity no Retry-After.
func TestDenyCacheAnswersAsRedis(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		capacity 2
		refill_rate 1/1h
		cost {http.request.header.X-Cost}
	}
	respond "ok"`, srv.Addr))
	retry := func(cost string) (int, string) {
		r := cs.get("/", "X-Cost", cost)
		return r.status, r.header.Get("Retry-After")
	}
	for _, step := range []struct {
		cost, retry string
		status      int
	}{
		{"3", "", 429}, {"1", "", 200}, {"1", "", 200}, {"1", "3600", 429}, {"1", "3600", 429}, // the last one cached
		{"2", "7200", 429}, {"3", "", 429},
	} {
		if status, ra := retry(step.cost); status != step.status || (ra != step.retry && !(step.retry != "" && closeTo(ra, step.retry))) {
			t.Fatalf("cost %s: %d Retry-After %q, want %d %q", step.cost, status, ra, step.status, step.retry)
		}
	}
}

// closeTo reports whether two whole-second strings are within a second of each other.
func closeTo(a, b string) bool {
	x, err1 := strconv.Atoi(a)
	y, err2 := strconv.Atoi(b)
	return err1 == nil && err2 == nil && x-y <= 1 && y-x <= 1
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

// TestOverMemoryCountedAsOOM: Redis over maxmemory (noeviction) refuses each decision before it
// runs: a flood of fresh API keys cannot grow Redis past its limit, and the failures are counted
// under the reason oom.
func TestOverMemoryCountedAsOOM(t *testing.T) {
	srv := redistest.Start(t, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
	cs := startCaddy(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-API-Key}
		algorithm sliding_window
		limit 100
		window 24h
	}
	respond "ok"`, srv.Addr))
	oom := func() float64 { return testutil.ToFloat64(metrics.backendFailures.WithLabelValues("oom")) }
	start := oom()
	// Until Redis refuses, then as many again: the circuit breaker opens after 5 refusals, and
	// its probes meet OOM again.
	sent := 0
	for ; sent < 100_000 && oom()-start < breakerTrips; sent++ {
		cs.get("/", "X-API-Key", "key-"+strconv.Itoa(sent))
	}
	for i := 0; i < sent; i++ {
		cs.get("/", "X-API-Key", "more-"+strconv.Itoa(i))
	}
	if oom()-start < breakerTrips {
		t.Fatalf("%.0f decisions counted as oom after %d fresh keys, want at least %d", oom()-start, 2*sent, breakerTrips)
	}
	t.Logf("%d fresh keys; %.0f decisions refused with OOM", 2*sent, oom()-start)
	used := infoInt(t, srv, "memory", "used_memory")
	if max := int64(3 << 20); used > max+max/20 {
		t.Fatalf("used_memory %d, want at most about maxmemory %d", used, max)
	}
}

// infoInt reads an integer field of Redis INFO section.
func infoInt(t *testing.T, srv *redistest.Server, section, field string) int64 {
	t.Helper()
	for _, line := range strings.Split(srv.Do("INFO", section).(string), "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatalf("INFO %s: %s: %v", section, line, err)
			}
			return n
		}
	}
	t.Fatalf("INFO %s has no %s", section, field)
	return 0
}

// TestClientCostBounded: a client-chosen cost on a large sliding window log is bounded by
// max_cost (default 1000 there): a cost of 300,000 is answered at once, with no Retry-After,
// without holding Redis, and a login zone on the same Redis stays limited meanwhile.
func TestClientCostBounded(t *testing.T) {
	srv := redistest.Start(t, "--slowlog-log-slower-than", "10000") // 10ms
	cs := startCaddy(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		zone big {
			key {http.request.header.X-API-Key}
			algorithm sliding_window
			limit 300000
			window 1h
			cost {http.request.header.X-Cost}
		}
		zone login {
			match path /login
			algorithm sliding_window
			limit 3
			window 1m
		}
	}
	respond "ok"`, srv.Addr))
	start := time.Now()
	r := cs.get("/", "X-API-Key", "attacker", "X-Cost", "300000")
	if r.status != 429 || r.header.Get("Retry-After") != "" {
		t.Fatalf("cost 300000: %d Retry-After %q, want 429 without Retry-After", r.status, r.header.Get("Retry-After"))
	}
	t.Logf("cost 300000 answered in %v", time.Since(start))
	if r := cs.get("/", "X-API-Key", "attacker", "X-Cost", "1000"); r.status != 200 {
		t.Fatalf("cost 1000 (the default max_cost): %d, want 200", r.status)
	}
	if got := cs.statuses(4, "/login"); got != "200 200 200 429" {
		t.Fatalf("login zone: %s, want 200 200 200 429", got)
	}
	if n := srv.Do("SLOWLOG", "LEN").(int64); n != 0 {
		t.Fatalf("%d Redis calls slower than 10ms: %v", n, srv.Do("SLOWLOG", "GET"))
	}
}
