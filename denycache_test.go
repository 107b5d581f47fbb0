package ratelimitredis

import (
	"fmt"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestDenyCacheEndToEnd: with the deny cache on, a client over its limit is denied again with
// the same figures (less the time elapsed) and no Redis call, counted as a deny cache hit; with
// `deny_cache off` every denial is a Redis call. max_age is 1h here, so that the 10 repeated
// denials fall within it however slow the machine; TestDenyCacheOnByDefault checks the default.
// Retry-After and X-RateLimit-Reset are 3600s less the time since the first request at most
// (less twice that from the cache, whose times count from the denying call's sending): exactly
// 3600 on a machine that answers the 12 requests within half a second.
func TestDenyCacheEndToEnd(t *testing.T) {
	for _, tc := range []struct {
		name, option string
		wantCalls    int // script calls for the 10 repeated denials
		wantHits     float64
	}{
		{"on", "deny_cache {\n\t\t\tmax_age 1h\n\t\t}", 0, 10},
		{"off", "deny_cache off", 10, 0},
	} {
		t.Run("deny_cache="+tc.name, func(t *testing.T) {
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
			a := srv.Time()
			cs.get("/").expect(t, "first", 200, "ok")
			cs.get("/").expect(t, "denied by Redis", 429, "", "X-RateLimit-Remaining", "0")
			calls := srv.ScriptCalls()
			hits := testutil.ToFloat64(metrics.denyCacheHits)
			for i := 0; i < 10; i++ {
				r := cs.get("/")
				lo := int(math.Ceil((3600*time.Second - 2*srv.Time().Sub(a)).Seconds()))
				r.expect(t, "denied again", 429, "", "X-RateLimit-Limit", "1", "X-RateLimit-Remaining", "0")
				for _, h := range []string{"Retry-After", "X-RateLimit-Reset"} {
					if got, err := strconv.Atoi(r.header.Get(h)); err != nil || got < lo || got > 3600 {
						t.Fatalf("denied again: %s %q, want %d to 3600", h, r.header.Get(h), lo)
					}
				}
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

// TestDenyCacheOnByDefault: with no deny_cache option, a denial repeated within the default
// max_age (1s) of the denying call is answered from the cache, with no Redis call. The cache
// counts from the call's sending, which comes after c: a repeat answered before c+1s must be a
// hit. A loaded machine may take longer than that over the pair; then the pair is tried again
// (the entry had expired, as it should), until a pair fits in the second, for 30s at most.
func TestDenyCacheOnByDefault(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		capacity 1
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr))
	cs.get("/").expect(t, "first", 200, "ok")
	deadline := time.Now().Add(30 * time.Second)
	for {
		c := time.Now()
		calls := srv.ScriptCalls()
		cs.get("/").expect(t, "denied", 429, "")
		fromRedis := srv.ScriptCalls() == calls+1
		calls, hits := srv.ScriptCalls(), testutil.ToFloat64(metrics.denyCacheHits)
		cs.get("/").expect(t, "denied again", 429, "")
		hit := srv.ScriptCalls() == calls && testutil.ToFloat64(metrics.denyCacheHits) == hits+1
		if hit {
			return
		}
		if fromRedis && time.Since(c) < limiter.DefaultDenyCacheMaxAge {
			t.Fatalf("a denial repeated within %v of sending the request Redis denied: Redis called, want the deny cache (max_age %v by default)",
				time.Since(c), limiter.DefaultDenyCacheMaxAge)
		}
		if time.Now().After(deadline) {
			t.Fatal("no denial pair within the default max_age in 30s")
		}
	}
}
