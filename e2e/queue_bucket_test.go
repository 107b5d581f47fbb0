package e2e_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// bucketQueueZone is a site-wide token bucket of 1 token refilled at 2/s whose requests wait
// in its queue: interactive first, batch guaranteed 20% of the grants.
const bucketQueueZone = `zone upstream {
				key site
				capacity 1
				refill_rate 2
				max_wait 30s
				priority {http.request.header.X-Tier} {
					interactive
					batch share 20%
				}
			}`

// TestQueueTokenBucketPriorityAcrossInstances: three instances, one site-wide token bucket of 1
// token at 2/s with a queue. 10 batch requests come first (one is served, the rest wait), then
// 5 interactive ones, each entering the queue in turn, spread over the instances. Every request
// is answered 200, those that waited with X-RateLimit-Waited; the 5 interactive requests start
// before the batch requests that arrived before them but b1 to b3 (granted while the others
// entered, or for batch's share); and the 15 requests start no faster than the bucket refills:
// the last at least 7 s (14 tokens at 2/s) after the first.
func TestQueueTokenBucketPriorityAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	var mu sync.Mutex
	type start struct {
		seq string
		at  time.Time
	}
	var started []start
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		started = append(started, start{r.Header.Get("X-Seq"), time.Now()})
		mu.Unlock()
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(upstream.Close)
	cs := caddytest.Start(t, caddytest.Instances(srv.Addr, bucketQueueZone, upstream.URL))
	waiters := limiter.StateKey("rl:", &limiter.Zone{Name: "upstream", Algorithm: limiter.TokenBucket}, "site") + ":ql"
	lc := caddytest.NewLoadClient(cs)
	var wg sync.WaitGroup
	failed := make(chan string, 15)
	for i := range 15 {
		seq, tier := "b"+strconv.Itoa(i), "batch"
		if i >= 10 {
			seq, tier = "i"+strconv.Itoa(i-10), "interactive"
		}
		wg.Go(func() {
			r, err := lc.Get(fmt.Sprintf("/i%d/", 1+i%3), "X-Seq", seq, "X-Tier", tier)
			if err != nil || r.Status != 200 {
				failed <- fmt.Sprintf("%s: %v %+v, want 200", seq, err, r)
			} else if w, err := strconv.Atoi(r.Header.Get("X-RateLimit-Waited")); i > 0 && (err != nil || w <= 0) {
				failed <- fmt.Sprintf("%s: X-RateLimit-Waited %q, want the wait (ms)", seq, r.Header.Get("X-RateLimit-Waited"))
			}
		})
		redistest.WaitFor(t, 5*time.Second, seq+" served or queued", func() bool {
			mu.Lock()
			n := len(started)
			mu.Unlock()
			q, _ := srv.Do("ZCARD", waiters).(int64)
			return int(q)+n == i+1
		})
	}
	wg.Wait()
	close(failed)
	for f := range failed {
		t.Error(f)
	}
	if len(started) != 15 {
		t.Fatalf("%d requests started, want 15", len(started))
	}
	var order []string
	for _, s := range started {
		order = append(order, s.seq)
	}
	t.Logf("start order: %v", order)
	last := slices.Index(order, "b4")
	for k := range 5 {
		if i := slices.Index(order, "i"+strconv.Itoa(k)); i > last {
			t.Fatalf("i%d started after b4: %v", k, order)
		}
	}
	if span := started[14].at.Sub(started[0].at); span < 7*time.Second-50*time.Millisecond {
		t.Fatalf("15 requests started within %v: faster than 1 token and 2/s", span)
	}
}

// TestQueueTokenBucketRedisPausedAndReload: a token bucket queue (1 token at 2/s) with three
// waiters survives a Redis pause (SIGSTOP) of 1s and a config reload: every request is answered
// 200 within max_wait, the waiters' set is empty at the end, and the bucket holds no
// reservation (no hold left).
func TestQueueTokenBucketRedisPausedAndReload(t *testing.T) {
	srv := redistest.Start(t)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("ok")) }))
	t.Cleanup(upstream.Close)
	site := fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone one {
			key site
			capacity 1
			refill_rate 2
			max_wait 20s
			priority {http.request.header.X-Tier} {
				interactive
				batch
			}
		}
	}
	reverse_proxy %s`, srv.Addr, upstream.URL)
	cs := caddytest.Start(t, site)
	bucket := limiter.StateKey("rl:", &limiter.Zone{Name: "one", Algorithm: limiter.TokenBucket}, "site")
	lc := caddytest.NewLoadClient(cs)
	answers := make(chan caddytest.Response, 4)
	go func() { r, _ := lc.Get("/"); answers <- r }()
	if r := <-answers; r.Status != 200 {
		t.Fatalf("first request: %d %q, want 200", r.Status, r.Body)
	}
	for i := range 3 {
		go func() { r, _ := lc.Get("/", "X-Tier", "batch"); answers <- r }()
		redistest.WaitFor(t, 5*time.Second, "request queued", func() bool { return zcard(srv, bucket+":ql") == int64(i+1) })
	}
	srv.Pause()
	time.Sleep(time.Second) // the pause under test
	srv.Resume()
	cs.Reload(site + "\n# reloaded")
	for range 3 {
		if r := <-answers; r.Status != 200 {
			t.Fatalf("a waiter: %d %q, want 200", r.Status, r.Body)
		}
	}
	redistest.WaitFor(t, 5*time.Second, "no waiter and no reservation left", func() bool {
		fields, _ := srv.Do("HKEYS", bucket).([]any)
		for _, f := range fields {
			if s, _ := f.(string); s == "h" || strings.HasPrefix(s, "h:") {
				return false
			}
		}
		return zcard(srv, bucket+":ql") == 0
	})
}
