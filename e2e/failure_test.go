package e2e_test

// Redis faults never take a site down, and nothing is lost or double-counted: Caddy in process
// against real redis-server processes that the tests restart, flush, kill and stall; the only
// stand-in for Redis is redistest.StartGarbage, whose point is a Redis that answers garbage.

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ratelimitredis "github.com/rate-limit-redis/caddy-rate-limit-redis"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

// scriptCached reports whether srv's script cache holds decide.lua.
func scriptCached(t *testing.T, srv *redistest.Server) bool {
	t.Helper()
	sum := sha1.Sum([]byte(lua.Decide))
	v, ok := srv.Do("SCRIPT", "EXISTS", hex.EncodeToString(sum[:])).([]any)
	if !ok || len(v) != 1 {
		t.Fatalf("SCRIPT EXISTS replied %#v", v)
	}
	return v[0] == int64(1)
}

// TestRecoveryAfterRedisLosesStateOrScripts: after a Redis restart (state and script cache
// gone), SCRIPT FLUSH (scripts gone, state kept) or FLUSHALL (state gone, scripts kept), the very
// first request is decided exactly by Redis: no failure (fail_mode closed would make one a 503),
// no degraded answer, and the count is exactly what the surviving state implies.
func TestRecoveryAfterRedisLosesStateOrScripts(t *testing.T) {
	for _, tc := range []struct {
		event        string
		cause        func(*redistest.Server)
		scriptCached bool // after the event
		stateKept    bool
	}{
		{"restart", (*redistest.Server).Restart, false, false},
		{"SCRIPT FLUSH", func(s *redistest.Server) { s.Do("SCRIPT", "FLUSH") }, false, true},
		{"FLUSHALL", func(s *redistest.Server) { s.Do("FLUSHALL") }, true, false},
	} {
		t.Run(tc.event, func(t *testing.T) {
			srv := redistest.Start(t)
			cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode closed
		capacity 3
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr))
			lc := caddytest.NewLoadClient(cs)
			cs.Get("/").Expect(t, "1st request", 200, "ok", "X-RateLimit-Remaining", "2")
			cs.Get("/").Expect(t, "2nd request", 200, "ok", "X-RateLimit-Remaining", "1")
			if !scriptCached(t, srv) {
				t.Fatal("decide.lua is not in the script cache after two decisions")
			}

			tc.cause(srv)
			if got := scriptCached(t, srv); got != tc.scriptCached {
				t.Fatalf("after %s the script cache holds decide.lua: %t, want %t", tc.event, got, tc.scriptCached)
			}

			// The first request after the event: no retry loop.
			r, err := lc.Get("/")
			if err != nil {
				t.Fatalf("first request after %s: %v", tc.event, err)
			}
			if r.Status == http.StatusServiceUnavailable {
				t.Fatalf("the first request after %s failed (503) instead of reconnecting; headers %v", tc.event, r.Header)
			}
			if tc.stateKept {
				r.Expect(t, "first request after "+tc.event, 200, "ok",
					"X-RateLimit-Remaining", "0", "X-RateLimit-Degraded", "")
				cs.Get("/").Expect(t, "second request after "+tc.event, 429, "",
					"X-RateLimit-Remaining", "0", "Retry-After", "3600", "X-RateLimit-Degraded", "")
			} else {
				r.Expect(t, "first request after "+tc.event, 200, "ok",
					"X-RateLimit-Remaining", "2", "X-RateLimit-Degraded", "")
			}
			if !scriptCached(t, srv) {
				t.Fatalf("decide.lua was not loaded again after %s", tc.event)
			}
		})
	}
}

// loadResult is one request sent by a load goroutine.
type loadResult struct {
	resp           caddytest.Response
	err            error
	decidedBefore  bool // the whole request happened before the kill began
	startedAfterIt bool // the request was sent after Redis was dead
}

// TestRedisKilledMidLoad: Redis killed (SIGKILL) while 4 goroutines send requests never takes
// the site down. With fail_mode open every response is 200 and every request sent after the kill
// is marked degraded; with fail_mode closed every response is 200 or 503 (Retry-After: 1), and
// every request sent after the kill is a 503. Once Redis is back, exact global limiting resumes
// within one second: a fresh zone of capacity 5 admits exactly 5 of 10 requests.
func TestRedisKilledMidLoad(t *testing.T) {
	const workers, maxPerWorker = 4, 20_000
	for _, mode := range []string{ratelimitredis.FailOpen, ratelimitredis.FailClosed} {
		t.Run(mode, func(t *testing.T) {
			srv := redistest.Start(t)
			cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode %s
		zone load {
			capacity 1000000
			refill_rate 1000000
		}
		zone verify {
			match header X-Phase verify
			key {http.request.header.X-Phase}
			capacity 5
			refill_rate 1/1h
		}
	}
	respond "ok"`, srv.Addr, mode))
			lc := caddytest.NewLoadClient(cs)

			var killing, killed, stop atomic.Bool
			var done, doneAfterKill atomic.Int64
			results := make([][]loadResult, workers)
			var wg sync.WaitGroup
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := 0; i < maxPerWorker && !stop.Load(); i++ {
						after := killed.Load()
						r, err := lc.Get("/")
						res := loadResult{resp: r, err: err, decidedBefore: !killing.Load(), startedAfterIt: after}
						results[w] = append(results[w], res)
						done.Add(1)
						if after {
							doneAfterKill.Add(1)
						}
					}
				}()
			}
			t.Cleanup(func() { stop.Store(true); wg.Wait() }) // should the test fail midway

			redistest.WaitFor(t, 10*time.Second, "the load sent fewer than 20 requests", func() bool { return done.Load() >= 20 })
			killing.Store(true)
			srv.Stop()
			killed.Store(true)
			redistest.WaitFor(t, 10*time.Second, "fewer than 40 requests sent after the kill", func() bool { return doneAfterKill.Load() >= 40 })
			stop.Store(true)
			wg.Wait()

			var total, before, after, degraded, unavailable int
			for _, rs := range results {
				for _, res := range rs {
					total++
					r := res.resp
					if res.err != nil {
						t.Fatalf("a request failed: %v", res.err)
					}
					deg := r.Header.Get("X-RateLimit-Degraded")
					if deg == "true" {
						degraded++
					}
					switch {
					case r.Status == 503:
						unavailable++
						if ra := r.Header.Get("Retry-After"); ra != "1" {
							t.Fatalf("a 503 has Retry-After %q, want 1", ra)
						}
					case r.Status != 200:
						t.Fatalf("a response is %d %q", r.Status, r.Body)
					}
					if mode == ratelimitredis.FailOpen && r.Status != 200 {
						t.Fatalf("fail_mode open: a response is %d", r.Status)
					}
					if res.decidedBefore {
						before++
						if r.Status != 200 || deg != "" || r.Header.Get("X-RateLimit-Limit") != "1000000" {
							t.Fatalf("a request completed before the kill was not decided by Redis: %d, headers %v", r.Status, r.Header)
						}
					}
					if res.startedAfterIt {
						after++
						if mode == ratelimitredis.FailOpen && deg != "true" {
							t.Fatalf("fail_mode open: a request sent after the kill is not degraded: headers %v", r.Header)
						}
						if mode == ratelimitredis.FailClosed && r.Status != 503 {
							t.Fatalf("fail_mode closed: a request sent after the kill is %d, want 503", r.Status)
						}
					}
				}
			}
			t.Logf("%d requests: %d decided before the kill, %d sent after it; %d degraded, %d 503",
				total, before, after, degraded, unavailable)
			if mode == ratelimitredis.FailOpen && degraded == 0 {
				t.Fatal("fail_mode open: no degraded response seen")
			}
			if mode == ratelimitredis.FailClosed && unavailable == 0 {
				t.Fatal("fail_mode closed: no 503 seen")
			}

			srv.Restart()
			redistest.WaitFor(t, time.Second, "Redis restarted but requests are still not decided by it", func() bool {
				r, err := lc.Get("/")
				return err == nil && r.Status == 200 && r.Header.Get("X-RateLimit-Degraded") == "" &&
					r.Header.Get("X-RateLimit-Limit") == "1000000"
			})
			for i := 1; i <= 10; i++ {
				step := "verify request " + strconv.Itoa(i)
				r, err := lc.Get("/", "X-Phase", "verify")
				if err != nil {
					t.Fatalf("%s: %v", step, err)
				}
				if i <= 5 {
					r.Expect(t, step, 200, "ok", "X-RateLimit-Limit", "5",
						"X-RateLimit-Remaining", strconv.Itoa(5-i), "X-RateLimit-Degraded", "")
				} else {
					r.Expect(t, step, 429, "", "X-RateLimit-Limit", "5",
						"X-RateLimit-Remaining", "0", "X-RateLimit-Degraded", "")
				}
			}
		})
	}
}

// hugeArrayChild names the environment variable that makes TestKnownBugGarbageArrayLengthKillsCaddy
// the child process it starts.
const hugeArrayChild = "RATELIMITREDIS_HUGE_ARRAY_CHILD"

// TestKnownBugGarbageArrayLengthKillsCaddy checks that a Redis reply declaring an array of 2^40
// elements (and then closing the connection) costs one failed decision, a 503 with fail_mode
// closed, not the process. It runs in a child process, since a failure is the process dying.
// It is skipped: the bug it names is not fixed.
func TestKnownBugGarbageArrayLengthKillsCaddy(t *testing.T) {
	if os.Getenv(hugeArrayChild) == "1" {
		addr := redistest.StartGarbage(t, "*1099511627776\r\n", true)
		cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode closed
		capacity 5
		refill_rate 1
	}
	respond "ok"`, addr))
		r, err := caddytest.NewLoadClient(cs).Get("/")
		fmt.Printf("child result: status=%d retry-after=%q err=%v\n", r.Status, r.Header.Get("Retry-After"), err)
		return
	}
	t.Skip("known bug: go-redis allocates a reply's declared array length before reading the elements, " +
		"so a reply declaring 2^40 elements kills the process (fatal error: runtime: out of memory); " +
		"remove this skip with the fix")
	if testing.Short() {
		t.Skip("runs Caddy: skipped with -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestKnownBugGarbageArrayLengthKillsCaddy$", "-test.count=1")
	cmd.Env = append(os.Environ(), hugeArrayChild+"=1")
	out, err := cmd.CombinedOutput()
	if strings.Contains(string(out), `child result: status=503 retry-after="1" err=<nil>`) && err == nil {
		return
	}
	tail := string(out)
	if len(tail) > 600 {
		tail = tail[:600]
	}
	if strings.Contains(string(out), "out of memory") {
		t.Fatalf("a Redis reply declaring a 2^40-element array killed the Caddy process (out of memory): %v\n%s", err, tail)
	}
	t.Fatalf("child process: %v\n%s", err, tail)
}

// TestStalledRedisFailsFast: a stalled Redis (SIGSTOP: connections open, nothing answered) with
// timeout 100ms and fail_mode closed answers every request 503 with Retry-After: 1, not a hang;
// once Redis continues, requests are decided by Redis again. It logs the latency seen during the
// stall and asserts no bound on it.
func TestStalledRedisFailsFast(t *testing.T) {
	const stalled = 50
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		timeout 100ms
		fail_mode closed
		capacity 1000
		refill_rate 1000
	}
	respond "ok"`, srv.Addr))
	lc := caddytest.NewLoadClient(cs)
	cs.Get("/").Expect(t, "before the stall", 200, "ok", "X-RateLimit-Limit", "1000")

	srv.Pause()
	latencies := make([]time.Duration, 0, stalled)
	for i := 1; i <= stalled; i++ {
		step := "stalled request " + strconv.Itoa(i)
		start := time.Now()
		r, err := lc.Get("/")
		latencies = append(latencies, time.Since(start))
		if err != nil {
			srv.Resume()
			t.Fatalf("%s: %v", step, err)
		}
		r.Expect(t, step, 503, "", "Retry-After", "1", "X-RateLimit-Limit", "")
	}
	srv.Resume()
	t.Logf("latency of the first stalled requests, in order: %v", latencies[:8])
	slices.Sort(latencies)
	pct := func(p int) time.Duration { return latencies[(len(latencies)*p+99)/100-1] }
	t.Logf("latency of %d requests during the stall (timeout 100ms): min %v, p50 %v, p90 %v, p99 %v, max %v",
		len(latencies), latencies[0], pct(50), pct(90), pct(99), latencies[len(latencies)-1])

	redistest.WaitFor(t, 5*time.Second, "Redis resumed but requests are still not decided by it", func() bool {
		r, err := lc.Get("/")
		return err == nil && r.Status == 200 && r.Header.Get("X-RateLimit-Limit") == "1000"
	})
}

func TestEndToEndFailModes(t *testing.T) {
	for _, tc := range []struct {
		mode   string
		status int
		body   string
		hdrs   []string
	}{
		{"open", 200, "degraded=true allowed=true", []string{"X-RateLimit-Degraded", "true", "Retry-After", ""}},
		{"closed", 503, "err degraded=true allowed=false", []string{"Retry-After", "1", "X-RateLimit-Degraded", ""}},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			srv := redistest.Start(t)
			srv.Stop() // Caddy must start while Redis is down
			cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode %s
		capacity 10
		refill_rate 1
	}
	respond "degraded={http.rate_limit_redis.degraded} allowed={http.rate_limit_redis.allowed}"
	handle_errors {
		respond "err degraded={http.rate_limit_redis.degraded} allowed={http.rate_limit_redis.allowed}" {err.status_code}
	}`, srv.Addr, tc.mode))
			for i := 0; i < 3; i++ {
				cs.Get("/").Expect(t, "redis down", tc.status, tc.body, tc.hdrs...)
			}
			srv.Restart()
			// Redis is back: the next request is decided by Redis again (pooled connections
			// to the dead server are replaced on use).
			redistest.WaitFor(t, 5*time.Second, "Redis decides again after it came back", func() bool {
				return cs.Get("/").Header.Get("X-RateLimit-Limit") == "10"
			})
			cs.Get("/").Expect(t, "redis back", 200, "degraded=false allowed=true", "X-RateLimit-Degraded", "", "X-RateLimit-Limit", "10")
		})
	}
}
