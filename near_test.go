package ratelimitredis

import (
	"fmt"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestNearLimitAcrossInstances: 60 concurrent requests of one client through 3 instances to a
// zone of capacity 20 with near_limit 0.8 admit 20; near_limit_total{zone} counts exactly one
// crossing, and exactly one response's {http.rate_limit_redis.near_limit} names the zone, every
// other one's is empty.
func TestNearLimitAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	var mu sync.Mutex
	seen := map[string]int{}
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		v, _ := repl.GetString("http.rate_limit_redis.near_limit")
		mu.Lock()
		seen[v]++
		mu.Unlock()
		_, err := io.WriteString(w, "ok")
		return err
	})
	var urls []string
	for range 3 {
		z := &Zone{Name: "near", Key: []string{"{http.request.header.X-API-Key}"}, Capacity: NumberOf(20), RefillRate: NumberOf(1.0 / 3600), NearLimit: 0.8}
		_, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Timeout: caddy.Duration(10 * time.Second), Zones: []*Zone{z}}, next)
		urls = append(urls, s.URL)
	}
	before := testutil.ToFloat64(metrics.nearLimit.WithLabelValues("near"))
	statuses := map[int]int{}
	var wg sync.WaitGroup
	for i := range 60 {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, urls[i%3], nil)
			req.Header.Set("X-API-Key", "dana")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			mu.Lock()
			statuses[resp.StatusCode]++
			mu.Unlock()
		})
	}
	wg.Wait()
	if statuses[200] != 20 || statuses[429] != 40 {
		t.Fatalf("statuses %v, want 20 200s and 40 429s", statuses)
	}
	if seen["near"] != 1 || seen[""] != 19 {
		t.Fatalf("near_limit placeholders of the admitted requests %v, want near once and empty 19 times", seen)
	}
	if d := testutil.ToFloat64(metrics.nearLimit.WithLabelValues("near")) - before; d != 1 {
		t.Fatalf("near_limit_total{zone=near}: %v more, want 1", d)
	}
}

// TestNearLimitEvent: Caddy's events app delivers one rate_limit_redis_near_limit event per
// crossing: a client's 10 requests to a zone of capacity 10 with near_limit 0.8 emit one, at
// the 8th (remaining 2), with zone, limit, remaining and near_limit, and the key only with
// log_key; another client's crossing emits another.
func TestNearLimitEvent(t *testing.T) {
	srv := redistest.Start(t)
	cs := eventSite(t, srv, []string{EventNearLimit},
		map[string]any{"name": "api", "capacity": 10, "refill_rate": 0.001, "near_limit": 0.8, "key": []string{"{http.request.header.X-Client}"}})
	if got := cs.Statuses(11, "/", "X-Client", "a"); got != "200 200 200 200 200 200 200 200 200 200 429" {
		t.Fatalf("got %s", got)
	}
	// The events app runs its handlers in Emit, before the response: the counts are final.
	if n := eventCount(EventNearLimit); n != 1 {
		t.Fatalf("%d events, want 1", n)
	}
	received.Lock()
	d := received.data[0]
	received.Unlock()
	if got := fmt.Sprintf("%v %v %v %v %v %v", d["zone"], d["limit"], d["remaining"], d["near_limit"], d["dry_run"], d["key"]); got != "api 10 2 0.8 false <nil>" {
		t.Errorf("event data %v, want zone api, limit 10, remaining 2, near_limit 0.8, not dry_run, no key (log_key off)", d)
	}
	cs.Statuses(8, "/", "X-Client", "b")
	if n := eventCount(EventNearLimit); n != 2 {
		t.Fatalf("%d events after another client's crossing, want 2", n)
	}
}
