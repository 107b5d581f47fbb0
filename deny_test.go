package ratelimitredis

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

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
			lc := startLoggedCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		%s
		deny_cache {
			max_age 1h # the third request is answered from the cache however slow the machine
		}
		zone lk {
			key {http.request.header.X-Client}
			capacity 1
			refill_rate 1/1h
		}
	}
	respond "ok"`, srv.Addr, option))
			lc.get("/", "X-Client", key).expect(t, "allowed", 200, "ok")
			lc.get("/", "X-Client", key).expect(t, "denied by Redis", 429, "")
			lc.get("/", "X-Client", key).expect(t, "denied from the deny cache", 429, "")
			srv.Stop() // failures are logged too: they must not hold the key either
			lc.get("/", "X-Client", "another-"+key).expect(t, "redis down", 200, "ok")

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
