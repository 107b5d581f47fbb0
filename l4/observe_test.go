package l4_test

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func init() {
	caddy.RegisterModule(eventRecorder{})
}

// eventRecorder is a Caddy events handler for tests: it keeps the data of the events it gets.
type eventRecorder struct{}

var recorded struct {
	sync.Mutex
	data []map[string]any
}

func (eventRecorder) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "events.handlers.rate_limit_redis_l4_test", New: func() caddy.Module { return new(eventRecorder) }}
}

func (eventRecorder) Handle(_ context.Context, e caddy.Event) error {
	recorded.Lock()
	defer recorded.Unlock()
	recorded.data = append(recorded.data, e.Data)
	return nil
}

// TestRefusedConnectionObserved: a refused connection is counted in decisions_total with its
// zone and result, as a request is, and emits one rate_limit_redis_exceeded event with the
// client's address.
func TestRefusedConnectionObserved(t *testing.T) {
	srv := redistest.Start(t)
	recorded.Lock()
	recorded.data = nil
	recorded.Unlock()
	l4Port, metricsPort := freeport.Must(t), freeport.Must(t)
	cfg, err := json.Marshal(map[string]any{
		"admin":   map[string]any{"disabled": true},
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{"level": "ERROR"}}},
		"apps": map[string]any{
			"events": map[string]any{"subscriptions": []any{map[string]any{
				"events":   []string{"rate_limit_redis_exceeded"},
				"handlers": []any{map[string]any{"handler": "rate_limit_redis_l4_test"}},
			}}},
			"layer4": map[string]any{"servers": map[string]any{"ssh": map[string]any{
				"listen": []string{fmt.Sprintf("127.0.0.1:%d", l4Port)},
				"routes": []any{map[string]any{"handle": []any{
					map[string]any{"handler": "rate_limit_redis", "redis": map[string]any{"addresses": []string{srv.Addr}}, "timeout": "5s",
						"zones": []any{map[string]any{"name": "ssh_new", "capacity": 1, "refill_rate": 0.001}}},
					map[string]any{"handler": "echo"},
				}}},
			}}},
			"http": map[string]any{"servers": map[string]any{"metrics": map[string]any{
				"listen": []string{fmt.Sprintf("127.0.0.1:%d", metricsPort)},
				"routes": []any{map[string]any{"handle": []any{map[string]any{"handler": "metrics"}}}},
			}}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := caddytest.LoadServing(t, cfg); err != nil {
		t.Fatal(err)
	}
	// decisions returns the zone's decisions_total by result, read from Caddy's /metrics.
	decisions := func() map[string]string {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", metricsPort))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		out := map[string]string{}
		for _, line := range strings.Split(string(body), "\n") {
			for _, res := range []string{"allowed", "denied"} {
				if v, ok := strings.CutPrefix(line, `caddy_rate_limit_redis_decisions_total{result="`+res+`",zone="ssh_new"} `); ok {
					out[res] = v
				}
			}
		}
		return out
	}
	before := decisions()
	if _, ok := dial(t, l4Port, ""); !ok {
		t.Fatal("the first connection was refused")
	}
	for range 2 {
		if _, ok := dial(t, l4Port, ""); ok {
			t.Fatal("a connection over the bucket was admitted")
		}
	}
	redistest.WaitFor(t, 5*time.Second, "2 exceeded events", func() bool {
		recorded.Lock()
		defer recorded.Unlock()
		return len(recorded.data) == 2
	})
	recorded.Lock()
	if d := recorded.data[0]; d["zone"] != "ssh_new" || d["remote_ip"] != "127.0.0.1" || d["wait"] != 1000*time.Second {
		t.Errorf("exceeded event data %v, want zone ssh_new, remote_ip 127.0.0.1, wait 1000s", d)
	}
	recorded.Unlock()
	after := decisions()
	for res, n := range map[string]int{"allowed": 1, "denied": 2} {
		b, _ := strconv.Atoi(cmp.Or(before[res], "0"))
		a, err := strconv.Atoi(after[res])
		if err != nil || a-b != n {
			t.Errorf("decisions_total{zone=ssh_new,result=%s} went from %q to %q, want %d more", res, before[res], after[res], n)
		}
	}
}
