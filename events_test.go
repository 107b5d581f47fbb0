package ratelimitredis

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func init() {
	caddy.RegisterModule(eventCounter{})
}

// eventCounter is a Caddy events handler for tests: it counts the events it receives by name,
// and keeps their data.
type eventCounter struct{}

var received struct {
	sync.Mutex
	counts map[string]int
	data   []map[string]any
}

func (eventCounter) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "events.handlers.rate_limit_redis_test_counter", New: func() caddy.Module { return new(eventCounter) }}
}

func (eventCounter) Handle(_ context.Context, e caddy.Event) error {
	received.Lock()
	defer received.Unlock()
	received.counts[e.Name()]++
	received.data = append(received.data, e.Data)
	return nil
}

func eventCount(name string) int {
	received.Lock()
	defer received.Unlock()
	return received.counts[name]
}

// eventSite resets the events received, and runs in Caddy one site whose handler has the one
// zone given (its JSON) and reports the named events to rate_limit_redis_test_counter.
func eventSite(t *testing.T, srv *redistest.Server, events []string, zone map[string]any) *caddytest.Site {
	t.Helper()
	received.Lock()
	received.counts, received.data = map[string]int{}, nil
	received.Unlock()
	addr := "127.0.0.1:" + strconv.Itoa(freeport.Must(t))
	cfg, _ := json.Marshal(map[string]any{
		"admin":   map[string]any{"disabled": true},
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{"level": "ERROR"}}},
		"apps": map[string]any{
			"events": map[string]any{"subscriptions": []any{map[string]any{
				"events":   events,
				"handlers": []any{map[string]any{"handler": "rate_limit_redis_test_counter"}},
			}}},
			"http": map[string]any{"servers": map[string]any{"s": map[string]any{
				"listen": []string{addr},
				"routes": []any{map[string]any{"handle": []any{
					// timeout: a loaded machine must not make a decision fail open (100ms by default: a
					// third request once got 200).
					map[string]any{"handler": "rate_limit_redis", "redis": map[string]any{"addresses": []string{srv.Addr}}, "timeout": "10s",
						"zones": []any{zone}},
					map[string]any{"handler": "static_response", "body": "ok"},
				}}},
			}}},
		},
	})
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := caddytest.LoadServing(t, cfg); err != nil {
		t.Fatal(err)
	}
	return &caddytest.Site{T: t, Base: "http://" + addr}
}

// TestEvents: a handler subscribed through Caddy's events app receives exactly one
// rate_limit_redis_exceeded event per denied request, with the client's address and the wait, and one rate_limit_redis_failing and one
// rate_limit_redis_recovered per Redis outage, however many requests it fails.
func TestEvents(t *testing.T) {
	srv := redistest.Start(t)
	cs := eventSite(t, srv, []string{EventExceeded, EventRedisFailing, EventRedisRecovered},
		map[string]any{"name": "api", "capacity": 2, "refill_rate": 0.001, "key": []string{"{http.request.header.X-Client}"}})
	if got := cs.Statuses(6, "/", "X-Client", "a"); got != "200 200 429 429 429 429" {
		t.Fatalf("got %s", got)
	}
	redistest.WaitFor(t, 5*time.Second, "4 exceeded events", func() bool { return eventCount(EventExceeded) == 4 })
	received.Lock()
	// refill_rate 0.001: the next token in 1000 s, Retry-After's value. remote_ip is sent though
	// log_key is off, as caddy-ratelimit's rate_limit_exceeded sends it.
	if d := received.data[0]; d["zone"] != "api" || fmt.Sprint(d["limit"]) != "2" || d["key"] != nil ||
		d["remote_ip"] != "127.0.0.1" || d["wait"] != 1000*time.Second {
		t.Errorf("exceeded event data %v, want zone api, limit 2, remote_ip 127.0.0.1, wait 1000s and no key (log_key off)", d)
	}
	received.Unlock()

	srv.Stop()
	for i := 0; i < 20; i++ { // fail_mode open: 200, degraded; the breaker opens after 5
		if r := cs.Get("/", "X-Client", strconv.Itoa(i)); r.Status != 200 {
			t.Fatalf("Redis down, request %d: %d, want 200 (fail_mode open)", i, r.Status)
		}
	}
	srv.Restart()
	redistest.WaitFor(t, 10*time.Second, "a decision by Redis again", func() bool {
		return cs.Get("/", "X-Client", "b").Header.Get("X-RateLimit-Degraded") == "" && eventCount(EventRedisRecovered) == 1
	})
	for _, c := range []struct {
		name string
		want int
	}{{EventExceeded, 4}, {EventRedisFailing, 1}, {EventRedisRecovered, 1}} {
		if got := eventCount(c.name); got != c.want {
			t.Errorf("%s: %d events, want %d", c.name, got, c.want)
		}
	}
}

// TestEventBlocked: a zone with block emits one rate_limit_redis_blocked event when its denial
// starts the block, with the block's length, and none for the requests the block then refuses,
// which decisions_total counts as blocked.
func TestEventBlocked(t *testing.T) {
	srv := redistest.Start(t)
	cs := eventSite(t, srv, []string{EventBlocked}, map[string]any{"name": "evblock", "capacity": 1, "refill_rate": 0.001, "block": "1h",
		"key": []string{"{http.request.header.X-Client}"}})
	blocked := metrics.decisions.WithLabelValues("evblock", resultBlocked.String())
	before := testutil.ToFloat64(blocked)
	if got := cs.Statuses(5, "/", "X-Client", "a"); got != "200 429 429 429 429" {
		t.Fatalf("got %s", got)
	}
	redistest.WaitFor(t, 5*time.Second, "a blocked event", func() bool { return eventCount(EventBlocked) == 1 })
	received.Lock()
	if d := received.data[0]; d["zone"] != "evblock" || fmt.Sprint(d["block_seconds"]) != "3600" || d["key"] != nil ||
		d["remote_ip"] != "127.0.0.1" || d["wait"] != time.Hour {
		t.Errorf("blocked event data %v, want zone evblock, block_seconds 3600, remote_ip 127.0.0.1, wait 1h and no key (log_key off)", d)
	}
	received.Unlock()
	if got := testutil.ToFloat64(blocked) - before; got != 3 {
		t.Errorf("decisions_total{result=\"blocked\"} rose by %v, want 3", got)
	}
	// Emitted before the response is written (deny): every event has arrived by now.
	if n := eventCount(EventBlocked); n != 1 {
		t.Errorf("%d blocked events, want 1", n)
	}
}
