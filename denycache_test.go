package ratelimitredis

import (
	"fmt"
	"strconv"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestDenyCacheEndToEnd: with the deny cache (the default), a client over its limit is denied
// again with the same Retry-After and no Redis call, counted as a deny cache hit; with
// `deny_cache off` every denial is a Redis call.
func TestDenyCacheEndToEnd(t *testing.T) {
	for _, tc := range []struct {
		option    string
		wantCalls int // script calls for the 10 repeated denials
		wantHits  float64
	}{
		{"", 0, 10},
		{"deny_cache off", 10, 0},
	} {
		t.Run("deny_cache="+strconv.Quote(tc.option), func(t *testing.T) {
			srv := redistest.Start(t)
			cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		%s
		capacity 1
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr, tc.option))
			cs.get("/").expect(t, "first", 200, "ok")
			cs.get("/").expect(t, "denied by Redis", 429, "", "Retry-After", "3600", "X-RateLimit-Remaining", "0")
			calls := srv.ScriptCalls()
			hits := testutil.ToFloat64(metrics.denyCacheHits)
			for i := 0; i < 10; i++ {
				cs.get("/").expect(t, "denied again", 429, "", "Retry-After", "3600",
					"X-RateLimit-Limit", "1", "X-RateLimit-Remaining", "0", "X-RateLimit-Reset", "3600")
			}
			if got := srv.ScriptCalls() - calls; got != tc.wantCalls {
				t.Fatalf("%d script calls for 10 repeated denials, want %d", got, tc.wantCalls)
			}
			if got := testutil.ToFloat64(metrics.denyCacheHits) - hits; got != tc.wantHits {
				t.Fatalf("deny cache hits = %v, want %v", got, tc.wantHits)
			}
		})
	}
}
