package e2e_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestLoadWarnsRedisUnreachable loads a Caddyfile with fail_mode open, its log in a file, as
// `caddy run` would: with nothing listening at the Redis address, Caddy logs one warning at load
// naming the address, the error and what fail_mode open does, before any request (and requests
// then get 200 with X-RateLimit-Degraded); with a live Redis it logs that Redis was reached and
// no warning.
func TestLoadWarnsRedisUnreachable(t *testing.T) {
	live := redistest.Start(t)
	for _, c := range []struct {
		name, addr, want string
	}{
		{"unreachable", fmt.Sprintf("127.0.0.1:%d", freeport.Must(t)), "redis unreachable at load"},
		{"live", live.Addr, "redis reachable at load"},
	} {
		t.Run(c.name, func(t *testing.T) {
			logFile := filepath.Join(t.TempDir(), "caddy.log")
			port := freeport.Must(t)
			caddyfile := fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
	log {
		output file %s
		format json
		level DEBUG
	}
}
:%d {
	bind 127.0.0.1
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode open
		zone per_ip {
			algorithm token_bucket
			capacity 10
			refill_rate 1
		}
	}
	respond "ok"
}
`, logFile, port, c.addr)
			t.Cleanup(func() { _ = caddy.Stop() })
			if err := caddytest.LoadCaddyfile(t, caddyfile); err != nil {
				t.Fatal(err)
			}
			var lines []string
			deadline := time.Now().Add(10 * time.Second)
			for !strings.Contains(strings.Join(lines, "\n"), c.want) {
				if time.Now().After(deadline) {
					t.Fatalf("no %q in Caddy's log within 10s:\n%s", c.want, strings.Join(lines, "\n"))
				}
				time.Sleep(20 * time.Millisecond)
				b, _ := os.ReadFile(logFile)
				lines = strings.Split(string(b), "\n")
			}
			var warns []string
			for _, l := range lines {
				if strings.Contains(l, "redis unreachable at load") {
					warns = append(warns, l)
				}
			}
			if c.name == "live" {
				if len(warns) != 0 {
					t.Fatalf("Redis live, yet warned: %v", warns)
				}
				return
			}
			if len(warns) != 1 || !strings.Contains(warns[0], `"level":"warn"`) || !strings.Contains(warns[0], `"redis":["`+c.addr+`"]`) ||
				!strings.Contains(warns[0], "connection refused") || !strings.Contains(warns[0], "open admits every request") {
				t.Fatalf("want one warning naming %s, connection refused and what fail_mode open does: %v", c.addr, warns)
			}
			site := &caddytest.Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(port)}
			r := site.Get("/")
			if r.Status != 200 || r.Header.Get("X-RateLimit-Degraded") != "true" {
				t.Fatalf("a request with Redis unreachable: %d %v, want 200 with X-RateLimit-Degraded: true", r.Status, r.Header)
			}
		})
	}
}
