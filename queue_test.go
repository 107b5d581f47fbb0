package ratelimitredis

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestQueueAdminAndMetrics: with the one slot of a queue zone held and waiters of two classes,
// the admin API's state shows the waiters per class and the oldest wait, the queue_waiters gauge
// counts them per class, and a waiter that waits out max_wait counts as wait_timeout and
// observes its wait in queue_wait_seconds.
func TestQueueAdminAndMetrics(t *testing.T) {
	srv := redistest.Start(t)
	up := heldUpstream(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone q {
			key site
			algorithm concurrency
			limit 1
			max_wait 3s
			priority {http.request.header.X-Tier} {
				interactive
				batch share 20%%
			}
		}
	}
	reverse_proxy %s`, srv.Addr, up.URL))
	lc := caddytest.NewLoadClient(ac.Site)
	go func() { _, _ = lc.Get("/", "X-Tier", "interactive") }() // holds the slot
	redistest.WaitFor(t, 5*time.Second, "the slot taken", func() bool { n, _ := srv.Do("ZCARD", "rl:{site}:q:cc").(int64); return n == 1 })
	done := make(chan caddytest.Response, 3)
	for _, tier := range []string{"batch", "nonsense", "interactive"} { // nonsense: the last class
		go func() { r, _ := lc.Get("/", "X-Tier", tier); done <- r }()
	}
	redistest.WaitFor(t, 5*time.Second, "3 waiters", func() bool { n, _ := srv.Do("ZCARD", "rl:{site}:q:cc:ql").(int64); return n == 3 })
	time.Sleep(50 * time.Millisecond) // the oldest wait grows past 0
	st := adminJSON[[]adminapi.ClientState](t, ac, http.MethodGet, "/rate_limit_redis/state?zone=q&key=site", 200)
	if len(st) != 1 || st[0].Queue == nil || st[0].Queue.Waiting["interactive"] != 1 || st[0].Queue.Waiting["batch"] != 2 ||
		st[0].Queue.OldestWaitMs < 50 || st[0].Queue.OldestWaitMs > 3000 {
		t.Fatalf("state: %+v, want 1 interactive and 2 batch waiting, the oldest for 50ms to 3s", st)
	}
	reg := activeRegistry(t)
	for class, want := range map[string]float64{"interactive": 1, "batch": 2} {
		if got := metricValue(t, reg, "caddy_rate_limit_redis_queue_waiters", "zone", "q", "class", class); got != want {
			t.Fatalf("queue_waiters of %s: %v, want %v", class, got, want)
		}
	}
	before := metricValue(t, reg, metricDecisions, "zone", "q", "result", "wait_timeout")
	for range 3 {
		if r := <-done; r.Status != 429 {
			t.Fatalf("a waiter: %d, want 429 after max_wait", r.Status)
		}
	}
	if got := metricValue(t, reg, metricDecisions, "zone", "q", "result", "wait_timeout"); got != before+3 {
		t.Fatalf("wait_timeout: %v, want %v", got, before+3)
	}
	redistest.WaitFor(t, 5*time.Second, "the gauge back to 0", func() bool {
		return metricValue(t, reg, "caddy_rate_limit_redis_queue_waiters", "zone", "q", "class", "batch") == 0
	})
}
