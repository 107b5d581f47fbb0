package ratelimitredis

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestLogKey: the handler logs one debug line per denial (from Redis or from the deny cache)
// with the zone, limit, remaining, retry_after and how it was decided; the client key is in it
// only with log_key, and no other line of the handler ever holds it.
func TestLogKey(t *testing.T) {
	const key = "client-key-Zq7wX" // appears nowhere but in the requests' X-Client header
	for _, logKey := range []bool{false, true} {
		t.Run("log_key="+strconv.FormatBool(logKey), func(t *testing.T) {
			option := ""
			if logKey {
				option = "log_key"
			}
			srv := redistest.Start(t)
			newFakeClock(t) // the handler's clock stands still: the third request is within max_age
			lc := startLoggedCaddy(t, fmt.Sprintf(`
	rate_limit_redis_tuned clock=%s {
		redis {
			address %s
		}
		%s
		zone lk {
			key {http.request.header.X-Client}
			capacity 1
			refill_rate 1/1h
		}
	}
	respond "ok"`, t.Name(), srv.Addr, option))
			lc.Get("/", "X-Client", key).Expect(t, "allowed", 200, "ok")
			lc.Get("/", "X-Client", key).Expect(t, "denied by Redis", 429, "")
			lc.Get("/", "X-Client", key).Expect(t, "denied from the deny cache", 429, "")
			srv.Stop() // failures are logged too: they must not hold the key either
			lc.Get("/", "X-Client", "another-"+key).Expect(t, "redis down", 200, "ok")

			lines := ours(lc.lines())
			denials := withMsg(lines, "rate limited")
			if len(denials) != 2 {
				t.Fatalf("%d denial lines, want 2: %v", len(denials), lines)
			}
			if len(withMsg(lines, "rate limit decision failed")) != 1 {
				t.Fatalf("no failure line among %v", lines)
			}
			for i, l := range denials {
				f := l.fields
				if f["level"] != "debug" || f["zone"] != "lk" || f["limit"] != 1.0 || f["remaining"] != 0.0 ||
					f["retry_after"] != 3600.0 || f["cached"] != (i == 1) || f["dry_run"] != false {
					t.Errorf("denial line %s", l.raw)
				}
				if got, want := f["key"], map[bool]any{false: nil, true: key}[logKey]; got != want {
					t.Errorf("denial line: key %v, want %v: %s", got, want, l.raw)
				}
			}
			for _, l := range lines {
				if l.fields["msg"] != "rate limited" && strings.Contains(l.raw, key) {
					t.Errorf("a line of the handler holds the client key: %s", l.raw)
				}
				if !logKey && strings.Contains(l.raw, key) {
					t.Errorf("without log_key, a line of the handler holds the client key: %s", l.raw)
				}
			}
		})
	}
}

// TestShouldRetry: a 429 whose Retry-After is over a minute, or whose wait cannot end (a cost
// above the quota), says X-Should-Retry: false, through handle_errors and without it; a wait
// of a minute or less, an allowed request, and a zone whose no_retry_over is off or longer
// than the wait do not; the handler's no_retry_over is every zone's unless a zone has its own.
func TestShouldRetry(t *testing.T) {
	srv := redistest.Start(t)
	zone := func(name, numbers, extra string) string {
		return fmt.Sprintf(`
		zone %s {
			match path /%s
			key {http.request.header.X-Client}
			%s
			%s
		}`, name, name, numbers, extra)
	}
	sites := caddytest.StartSites(t, "", fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}%s%s%s%s%s%s
	}
	respond "ok"
	handle_errors 429 {
		respond "limited" 429
	}`, srv.Addr,
		zone("hour", "capacity 1\n\t\t\trefill_rate 1/1h", ""),
		zone("minute", "capacity 1\n\t\t\trefill_rate 1/1m", ""),
		zone("short", "capacity 1\n\t\t\trefill_rate 1/30s", ""),
		zone("longer", "capacity 1\n\t\t\trefill_rate 1/1h", "no_retry_over 2h"),
		zone("off", "capacity 1\n\t\t\trefill_rate 1/1h", "no_retry_over off"),
		zone("big", "capacity 5\n\t\t\trefill_rate 1", "cost {http.request.header.X-Cost}")),
		fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key_prefix bare:
		no_retry_over 10s%s%s
	}
	respond "ok"`, srv.Addr,
			zone("short", "capacity 1\n\t\t\trefill_rate 1/30s", ""),
			zone("own", "capacity 1\n\t\t\trefill_rate 1/30s", "no_retry_over 1m")))
	errorRoutes, bare := sites[0], sites[1]
	for _, tc := range []struct {
		name      string
		cs        *caddytest.Site
		path      string
		retry     string // the 429's Retry-After
		noRetry   bool
		costAbove bool // the second request's cost is above the quota
	}{
		{"an hour", errorRoutes, "/hour", "3600", true, false},
		{"a minute", errorRoutes, "/minute", "60", false, false},
		{"30s", errorRoutes, "/short", "30", false, false},
		{"an hour, no_retry_over 2h", errorRoutes, "/longer", "3600", false, false},
		{"an hour, no_retry_over off", errorRoutes, "/off", "3600", false, false},
		{"a cost above the quota", errorRoutes, "/big", "", true, true},
		{"30s, the handler's no_retry_over 10s", bare, "/short", "30", true, false},
		{"30s, the zone's no_retry_over 1m", bare, "/own", "30", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := "c-" + strings.ReplaceAll(tc.name, " ", "-")
			tc.cs.Get(tc.path, "X-Client", client).Expect(t, "allowed", 200, "ok", "X-Should-Retry", "")
			cost := "1"
			if tc.costAbove {
				cost = "6"
			}
			body := "limited"
			if tc.cs == bare {
				body = ""
			}
			want := map[bool]string{true: "false"}[tc.noRetry]
			tc.cs.Get(tc.path, "X-Client", client, "X-Cost", cost).Expect(t, "denied", 429, body,
				"Retry-After", tc.retry, "X-Should-Retry", want)
		})
	}
}
