package ratelimitredis

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// stallInstances starts n instances of a concurrency zone "stall" (limit, hold_max 30s, timeout
// 100ms, fail_mode closed) on srv, each with a Redis client of its own, as separate Caddy
// processes have (handlers of one process with one Redis config share one client and its round
// trip: a pool_size of its own makes another). Each has decided one request, so that it holds a
// connection to Redis, as under traffic.
func stallInstances(t *testing.T, srv *redistest.Server, n int, limit int64, next func(http.ResponseWriter, *http.Request) error) []*httptest.Server {
	t.Helper()
	var out []*httptest.Server
	for i := range n {
		_, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}, PoolSize: 10 + i},
			Timeout: caddy.Duration(100 * time.Millisecond), FailMode: FailClosed,
			Zones: []*Zone{slotZone("stall", limit, 30*time.Second)}}, next)
		out = append(out, s)
		if code := statusOf(t, s.URL+"/warm", "Bearer warm"); code != 200 {
			t.Fatalf("instance %d's first request: %d, want 200", i, code)
		}
	}
	return out
}

// statusOf sends a GET of client key (its Authorization) to url on a connection of its own, and
// returns the status.
func statusOf(t *testing.T, url, key string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", key)
	req.Close = true
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Error(err)
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// stall stops srv (SIGSTOP) for d, running during while it is stopped.
func stall(t *testing.T, srv *redistest.Server, d time.Duration, during func()) {
	t.Helper()
	srv.Pause()
	t.Cleanup(srv.Resume) // a paused server is resumed before it is stopped
	start := time.Now()
	during()
	time.Sleep(d - time.Since(start)) // the stall's length: what the test is about, not a wait for an outcome
	srv.Resume()
}

// readmitted waits until the client "Bearer k" of the stall zone is admitted by base again after
// Redis resumed at resumed, and then until its slot set in Redis is empty (nothing of it is in
// flight): each within 5 s, far less than its hold_max of 30 s.
func readmitted(t *testing.T, srv *redistest.Server, base string, resumed time.Time) {
	t.Helper()
	redistest.WaitFor(t, 5*time.Second, "the client admitted again after the stall (hold_max is 30s)", func() bool {
		return statusOf(t, base+"/again", "Bearer k") == 200
	})
	admitted := time.Since(resumed)
	key := slotKey("stall")
	redistest.WaitFor(t, 5*time.Second, "the client's slot set empty with nothing in flight", func() bool {
		return srv.Do("ZCARD", key).(int64) == 0
	})
	t.Logf("after Redis resumed: admitted again at %v, no slot left at %v",
		admitted.Round(time.Millisecond), time.Since(resumed).Round(time.Millisecond))
}

// TestConcurrencyStallGivesSlotsBack: Redis stalls (SIGSTOP) for 0.5 s. A decision that was on
// the wire then (the request got 503, fail_mode closed) is run by Redis when it resumes, and
// takes a slot no request holds; a settlement that times out then (the response has ended)
// leaves its slot. Each instance gives such slots back once Redis answers again, by their
// nonces: the client is admitted again within seconds of the resume, not after hold_max (30 s),
// and its slot set is empty once nothing of it is in flight. With 1 and 3 instances, each with
// a client of its own, and limit 1 slot per instance, so that one slot stranded per instance
// denies the client.
func TestConcurrencyStallGivesSlotsBack(t *testing.T) {
	for _, n := range []int{1, 3} {
		t.Run(fmt.Sprintf("decisions, %d instances", n), func(t *testing.T) {
			srv := redistest.Start(t)
			ins := stallInstances(t, srv, n, int64(n), func(http.ResponseWriter, *http.Request) error { return nil })
			var mu sync.Mutex
			codes := map[int]int{}
			stall(t, srv, 500*time.Millisecond, func() {
				var wg sync.WaitGroup
				for _, s := range ins {
					for range 2 {
						wg.Go(func() {
							c := statusOf(t, s.URL+"/x", "Bearer k")
							mu.Lock()
							codes[c]++
							mu.Unlock()
						})
					}
				}
				wg.Wait()
			})
			resumed := time.Now()
			if codes[503] != 2*n {
				t.Fatalf("requests during the stall: %v, want %d × 503 (fail_mode closed)", codes, 2*n)
			}
			readmitted(t, srv, ins[0].URL, resumed)
		})
		t.Run(fmt.Sprintf("settlements, %d instances", n), func(t *testing.T) {
			srv := redistest.Start(t)
			g := newSlowGate()
			ins := stallInstances(t, srv, n, int64(2*n), g.next)
			var done []chan struct{}
			for _, s := range ins {
				done = append(done, g.holdOne(t, s.URL), g.holdOne(t, s.URL))
			}
			if got := srv.Do("ZCARD", slotKey("stall")).(int64); got != int64(2*n) {
				t.Fatalf("slots with 2 requests in flight per instance: %d, want %d", got, 2*n)
			}
			stall(t, srv, 500*time.Millisecond, func() {
				close(g.release) // the responses end while Redis is stopped: their settlements time out
				for _, d := range done {
					<-d
				}
			})
			readmitted(t, srv, ins[0].URL, time.Now())
		})
	}
}
