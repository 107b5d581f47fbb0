package e2e_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestReloadsUnderLoad: 100 config reloads while 4 goroutines send requests lose no decision and
// count none twice: every response is a 200 from one of the configs, decided by Redis, and the
// X-RateLimit-Remaining values of all responses are exactly capacity-1, capacity-2, … with no gap
// and no repeat, so every request the rate limiter counted was answered (a request retried after
// being counted would leave a gap). The reloads reuse the one Redis client (its connections survive
// every reload and their number never exceeds pool_size) and leak no connection: when Caddy stops,
// every connection it opened is closed.
//
// Caddy itself resets a few TCP connections at each reload (it binds a new SO_REUSEPORT socket
// per config and closes the old one, dropping the connections queued on it), with no rate
// limiter in the site too. So a request that got no response at all is sent again, at most
// twice more; the Remaining sequence proves that no such request had been counted.
func TestReloadsUnderLoad(t *testing.T) {
	const workers, maxPerWorker, reloads, poolSize, capacity = 4, 20_000, 100, 4, 100_000
	srv := redistest.Start(t)
	mon := newRedisMonitor(t, srv)
	site := func(body string) string {
		// One bucket (every request has the same client IP) refilling one token every 5 minutes,
		// more tokens than the load can take: each decision takes exactly one, and Remaining
		// numbers the decisions. The timeout is generous because this test is about reloads, not
		// timeouts: with the default 100ms, on 2 CPUs under -race, about one run in 40 saw one
		// decision time out (and go-redis drop its connection) while the whole process stalled
		// during a reload, requests that Redis decided taking up to 150ms at the same moment.
		return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
			pool_size %d
		}
		timeout 2s
		capacity %d
		refill_rate 1/5m
	}
	respond %q`, srv.Addr, poolSize, capacity, body)
	}
	idle := mon.connected() // before Caddy: the monitor alone (Caddy PINGs Redis at load)
	cs := caddytest.Start(t, site("a"))
	port, err := strconv.Atoi(strings.TrimPrefix(cs.Base, "http://127.0.0.1:"))
	if err != nil {
		t.Fatal(err)
	}
	lc := caddytest.NewLoadClient(cs)

	cs.Get("/").Expect(t, "warm-up", 200, "a", "X-RateLimit-Remaining", strconv.Itoa(capacity-1))
	warm := mon.others()
	t.Logf("connected_clients: %d before Caddy, %d after its first request (the monitor included)", idle, mon.connected())
	if len(warm) == 0 {
		t.Fatal("no connection to Redis after the first request")
	}

	var stop atomic.Bool
	var done, resent atomic.Int64
	var firstResent atomic.Value
	remaining := make([][]int, workers)
	failures := make([][]string, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < maxPerWorker && !stop.Load(); i++ {
				r, err := lc.Get("/")
				for attempt := 1; err != nil && attempt <= 2; attempt++ { // no response at all: Caddy's listener handover
					resent.Add(1)
					firstResent.CompareAndSwap(nil, err.Error())
					r, err = lc.Get("/")
				}
				done.Add(1)
				switch {
				case err != nil:
					failures[w] = append(failures[w], err.Error())
				case r.Status != 200 || (r.Body != "a" && r.Body != "b") || r.Header.Get("X-RateLimit-Degraded") != "":
					failures[w] = append(failures[w], fmt.Sprintf("%d %q, headers %v", r.Status, r.Body, r.Header))
				default:
					n, err := strconv.Atoi(r.Header.Get("X-RateLimit-Remaining"))
					if err != nil {
						failures[w] = append(failures[w], fmt.Sprintf("X-RateLimit-Remaining %q", r.Header.Get("X-RateLimit-Remaining")))
					} else {
						remaining[w] = append(remaining[w], n)
					}
				}
			}
		}()
	}
	t.Cleanup(func() { stop.Store(true); wg.Wait() }) // should the test fail midway

	maxConnected, body := 0, "a"
	for i := 1; i <= reloads; i++ {
		// Some requests complete between any two reloads: the reloads happen under load.
		n := done.Load()
		redistest.WaitFor(t, 5*time.Second, "no request completed between two reloads", func() bool { return done.Load() > n })
		body = "a"
		if i%2 == 1 {
			body = "b"
		}
		if err := cs.Load(site(body), port); err != nil {
			t.Fatalf("reload %d: %v", i, err)
		}
		maxConnected = max(maxConnected, mon.connected())
	}
	stop.Store(true)
	wg.Wait()
	after := mon.others()
	t.Logf("%d requests during %d reloads, %d sent again after no response (the first: %v); connected_clients at most %d; Caddy's connections %v before, %v after",
		done.Load(), reloads, resent.Load(), firstResent.Load(), maxConnected, warm, after)

	var failed []string
	for _, f := range failures {
		failed = append(failed, f...)
	}
	if len(failed) > 0 {
		t.Fatalf("%d of %d requests failed during the reloads; the first: %s", len(failed), done.Load(), failed[0])
	}
	all := slices.Concat(remaining...)
	slices.Sort(all)
	for i, n := range all {
		if want := capacity - 1 - len(all) + i; n != want {
			t.Fatalf("the responses' X-RateLimit-Remaining, sorted, are %d at index %d, want %d: a counted request was not answered, or one was counted twice", n, i, want)
		}
	}
	cs.Get("/").Expect(t, "after the reloads", 200, body, "X-RateLimit-Remaining", strconv.Itoa(capacity-2-len(all)))

	if maxConnected > idle+poolSize {
		t.Fatalf("connected_clients reached %d during the reloads, above %d (the monitor + pool_size %d)", maxConnected, idle+poolSize, poolSize)
	}
	for _, id := range warm {
		if !slices.Contains(after, id) {
			t.Fatalf("connection %d, open before the reloads, was closed by them (before %v, after %v): the client was not kept", id, warm, after)
		}
	}

	if err := caddy.Stop(); err != nil {
		t.Fatal(err)
	}
	redistest.WaitFor(t, 5*time.Second, "Caddy stopped but its Redis connections stay open", func() bool { return mon.connected() == idle })
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
	cs := caddytest.Start(t, site(2))
	if got := cs.Statuses(4, "/", "X-Key", "k"); got != "200 200 429 429" {
		t.Fatalf("capacity 2: %s", got)
	}
	cs.Reload(site(12))
	if got := cs.Statuses(11, "/", "X-Key", "k"); got != strings.TrimSpace(strings.Repeat("200 ", 10))+" 429" {
		t.Fatalf("raised to 12: %s, want exactly 10 more then 429", got)
	}
	cs.Reload(site(5))
	r := cs.Get("/", "X-Key", "k")
	// 12 used under capacity 5: 8 tokens must drain, at 1 per hour, before a cost of 1 fits.
	if ra, _ := strconv.Atoi(r.Header.Get("Retry-After")); r.Status != 429 || ra < 8*3600-2 || ra > 8*3600 {
		t.Fatalf("lowered to 5: %d Retry-After %q, want 429 after 8h", r.Status, r.Header.Get("Retry-After"))
	}
}

// redisMonitor reads a server's client connections over one connection of its own, which every
// count therefore includes exactly once.
type redisMonitor struct {
	t   *testing.T
	rdb *redis.Client
	id  int64 // the monitor's own client id
}

func newRedisMonitor(t *testing.T, srv *redistest.Server) *redisMonitor {
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, PoolSize: 1, MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	id, err := rdb.ClientID(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return &redisMonitor{t: t, rdb: rdb, id: id}
}

// connected is connected_clients of INFO clients, the monitor's connection included.
func (m *redisMonitor) connected() int {
	m.t.Helper()
	info, err := m.rdb.Info(context.Background(), "clients").Result()
	if err != nil {
		m.t.Fatal(err)
	}
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "connected_clients:"); ok {
			n, err := strconv.Atoi(v)
			if err != nil {
				m.t.Fatalf("INFO clients: %q", line)
			}
			return n
		}
	}
	m.t.Fatalf("INFO clients has no connected_clients:\n%s", info)
	return 0
}

// others is the ids of the server's client connections other than the monitor's.
func (m *redisMonitor) others() []int64 {
	m.t.Helper()
	list, err := m.rdb.ClientList(context.Background()).Result()
	if err != nil {
		m.t.Fatal(err)
	}
	var ids []int64
	for line := range strings.SplitSeq(strings.TrimSpace(list), "\n") {
		f, _, _ := strings.Cut(line, " ")
		v, ok := strings.CutPrefix(f, "id=")
		id, err := strconv.ParseInt(v, 10, 64)
		if !ok || err != nil {
			m.t.Fatalf("CLIENT LIST line %q", line)
		}
		if id != m.id {
			ids = append(ids, id)
		}
	}
	return ids
}
