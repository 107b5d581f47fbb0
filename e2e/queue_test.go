package e2e_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// queueZone is a site-wide queue in front of an upstream that serves 4 requests at a time:
// interactive first, batch guaranteed 20% of the slots.
const queueZone = `zone upstream {
				key site
				algorithm concurrency
				limit 4
				max_wait 30s
				priority {http.request.header.X-Tier} {
					interactive
					batch share 20%
				}
			}`

// upstreamLog is an upstream that records the order in which requests start (their X-Seq) and
// the most it ever serves at once, and serves each for 200 ms once open is closed.
type upstreamLog struct {
	mu       sync.Mutex
	started  []string
	now, max int
	open     chan struct{}
}

func (u *upstreamLog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.started = append(u.started, r.Header.Get("X-Seq"))
	u.now++
	u.max = max(u.max, u.now)
	u.mu.Unlock()
	<-u.open
	time.Sleep(200 * time.Millisecond) // the upstream's work
	u.mu.Lock()
	u.now--
	u.mu.Unlock()
	_, _ = w.Write([]byte("ok"))
}

// TestQueuePriorityAcrossInstances: three instances, one site-wide concurrency zone of limit 4
// with a queue. 40 batch requests come first (4 are served, 36 wait), then 10 interactive
// ones, each entering the queue in turn, spread over the instances. The upstream never serves
// more than 4 at once; every request is answered 200 within max_wait, those that waited with
// X-RateLimit-Waited; the 10 interactive requests start before all but 2 of the 36 batch
// requests waiting ahead of them (batch's 20% of the first 12 grants, interleaved), and the batch
// requests start in the order they arrived, whichever instance each came through.
func TestQueuePriorityAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	up := &upstreamLog{open: make(chan struct{})}
	upstream := httptest.NewServer(up)
	t.Cleanup(upstream.Close)
	cs := caddytest.Start(t, caddytest.Instances(srv.Addr, queueZone, upstream.URL))
	waiters := limiter.StateKey("rl:", &limiter.Zone{Name: "upstream", Algorithm: limiter.Concurrency}, "site") + ":ql"
	lc := caddytest.NewLoadClient(cs)
	type answer struct {
		seq string
		r   caddytest.Response
		err error
	}
	answers := make(chan answer, 50)
	var wg sync.WaitGroup
	send := func(seq, tier string, i int) {
		wg.Go(func() {
			r, err := lc.Get(fmt.Sprintf("/i%d/", 1+i%3), "X-Seq", seq, "X-Tier", tier)
			answers <- answer{seq, r, err}
		})
	}
	for i := range 50 {
		seq, tier := "b"+strconv.Itoa(i), "batch"
		if i >= 40 {
			seq, tier = "i"+strconv.Itoa(i-40), "interactive"
		}
		send(seq, tier, i)
		if i < 4 { // served at once: waits for the upstream to see it
			redistest.WaitFor(t, 5*time.Second, seq+" at the upstream", func() bool {
				up.mu.Lock()
				defer up.mu.Unlock()
				return len(up.started) == i+1
			})
			continue
		}
		redistest.WaitFor(t, 5*time.Second, seq+" in the queue", func() bool {
			n, _ := srv.Do("ZCARD", waiters).(int64)
			return n == int64(i-3)
		})
	}
	close(up.open)
	wg.Wait()
	close(answers)
	for a := range answers {
		if a.err != nil || a.r.Status != 200 {
			t.Fatalf("%s: %v %+v, want 200", a.seq, a.err, a.r)
		}
		waited, err := strconv.Atoi(a.r.Header.Get("X-RateLimit-Waited"))
		if a.seq >= "b4" && a.seq[0] == 'b' || a.seq[0] == 'i' {
			if err != nil || waited <= 0 || waited > 30000 {
				t.Errorf("%s: X-RateLimit-Waited %q, want the wait (ms): %v", a.seq, a.r.Header.Get("X-RateLimit-Waited"), a.r.Header)
			}
		}
	}
	if up.max != 4 {
		t.Fatalf("the upstream served up to %d at once, want 4", up.max)
	}
	t.Logf("start order: %v", up.started)
	checkQueueOrder(t, up.started)
}

// checkQueueOrder checks the upstream's start order: b0..b3 first; then the 46 waiters, 4 at
// a time (a group ends together, 200 ms later), so that the order within a group is the
// instances' race. The first 12 grants (3 groups) are the 10 interactive requests and 2 batch
// ones (interactive first, batch owed floor(20% × n) of n grants: the 5th and the 10th); the
// batch requests start in their arrival order, but for the race within a group of 4.
func checkQueueOrder(t *testing.T, started []string) {
	t.Helper()
	if len(started) != 50 {
		t.Fatalf("%d requests started, want 50: %v", len(started), started)
	}
	interactive := 0
	for _, seq := range started[4:16] {
		if seq[0] == 'i' {
			interactive++
		}
	}
	if interactive != 10 {
		t.Fatalf("%d interactive requests among the first 12 grants, want 10 (and 2 batch): %v", interactive, started)
	}
	k := 0
	for _, seq := range started {
		if seq[0] != 'b' {
			continue
		}
		if n, _ := strconv.Atoi(seq[1:]); n < k-3 || n > k+3 {
			t.Fatalf("batch %s started as the %dth batch request: not in arrival order (%v)", seq, k+1, started)
		}
		k++
	}
}

// queueSite is a site-wide queue of limit 1 (max_wait wait) in front of upstream.
func queueSite(redisAddr, wait, upstream string) string {
	return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone one {
			key site
			algorithm concurrency
			limit 1
			max_wait %s
		}
	}
	reverse_proxy %s`, redisAddr, wait, upstream)
}

// queueKeysOf returns the slots' key and the waiters' key of queueSite's zone.
func queueKeysOf() (slots, waiters string) {
	slots = limiter.StateKey("rl:", &limiter.Zone{Name: "one", Algorithm: limiter.Concurrency}, "site")
	return slots, slots + ":ql"
}

// gatedUpstream serves each request once a value is sent on release (or release is closed).
func gatedUpstream(t *testing.T) (url string, release chan struct{}) {
	release = make(chan struct{})
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(s.Close)
	return s.URL, release
}

// zcard is the number of members of the sorted set key.
func zcard(srv *redistest.Server, key string) int64 {
	n, _ := srv.Do("ZCARD", key).(int64)
	return n
}

// TestQueueWaitTimeoutAndHangUp: with the one slot held, a request waits max_wait (1s) and is
// refused 429 with Retry-After and X-RateLimit-Waited (at least 1000 ms), leaving the queue; a
// waiter whose client hangs up leaves the queue at once and takes no slot: the next request
// after the holder is admitted.
func TestQueueWaitTimeoutAndHangUp(t *testing.T) {
	srv := redistest.Start(t)
	up, release := gatedUpstream(t)
	cs := caddytest.Start(t, queueSite(srv.Addr, "1s", up))
	slots, waiters := queueKeysOf()
	holder := make(chan caddytest.Response, 1)
	go func() { r, _ := caddytest.NewLoadClient(cs).Get("/"); holder <- r }()
	redistest.WaitFor(t, 5*time.Second, "the holder's slot", func() bool { return zcard(srv, slots) == 1 })

	r := cs.Get("/")
	waited, _ := strconv.Atoi(r.Header.Get("X-RateLimit-Waited"))
	if r.Status != 429 || r.Header.Get("Retry-After") == "" || waited < 1000 {
		t.Fatalf("after max_wait: %d, Retry-After %q, X-RateLimit-Waited %q; want 429 with both, at least 1000",
			r.Status, r.Header.Get("Retry-After"), r.Header.Get("X-RateLimit-Waited"))
	}
	redistest.WaitFor(t, 5*time.Second, "the timed-out waiter gone from the queue", func() bool { return zcard(srv, waiters) == 0 })

	req, _ := http.NewRequest(http.MethodGet, cs.Base+"/", nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, err := caddytest.Client(5 * time.Second).Do(req.WithContext(ctx)); done <- err }()
	redistest.WaitFor(t, 5*time.Second, "a waiter", func() bool { return zcard(srv, waiters) == 1 })
	cancel()
	<-done
	redistest.WaitFor(t, 5*time.Second, "the departed waiter gone from the queue", func() bool { return zcard(srv, waiters) == 0 })
	release <- struct{}{}
	if r := <-holder; r.Status != 200 {
		t.Fatalf("holder: %d", r.Status)
	}
	redistest.WaitFor(t, 5*time.Second, "the holder's slot given back, to no one", func() bool { return zcard(srv, slots) == 0 })
	close(release)
	cs.Get("/").Expect(t, "a request after the holder", 200, "ok")
}

// TestQueueRedisPausedAndReload: waiters survive a Redis pause (SIGSTOP) of 1s and a config
// reload: each is answered once the slot comes back, no waiter is stranded past max_wait, and
// no slot is left taken.
func TestQueueRedisPausedAndReload(t *testing.T) {
	srv := redistest.Start(t)
	up, release := gatedUpstream(t)
	site := queueSite(srv.Addr, "20s", up)
	cs := caddytest.Start(t, site)
	slots, waiters := queueKeysOf()
	lc := caddytest.NewLoadClient(cs)
	answers := make(chan caddytest.Response, 4)
	for i := range 4 {
		go func() { r, _ := lc.Get("/"); answers <- r }()
		redistest.WaitFor(t, 5*time.Second, "request in", func() bool { return zcard(srv, slots)+zcard(srv, waiters) == int64(i+1) })
	}
	srv.Pause()
	time.Sleep(time.Second) // the pause under test
	srv.Resume()
	cs.Reload(site + "\n# reloaded")
	start := time.Now()
	close(release)
	for range 4 {
		r := <-answers
		if r.Status != 200 {
			t.Fatalf("a request: %d %q, want 200", r.Status, r.Body)
		}
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("the waiters were answered %v after the slot came back", took)
	}
	redistest.WaitFor(t, 5*time.Second, "no slot left taken and no waiter", func() bool {
		return zcard(srv, slots) == 0 && zcard(srv, waiters) == 0
	})
}
