package ratelimitredis

import (
	"fmt"
	"maps"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestDryRunExactlyAsEnforced sends the same requests to two handlers that differ only in
// dry_run (and their zone names, so that their metrics are apart): an enforcing one under
// /enforced and a dry-run one under /dry. The dry run decides, charges, heads, reports and counts
// every request exactly as enforcement does (denials as dry_run_denied); it only never rejects:
// each request reaches the next handler with 200, and no Retry-After is sent.
func TestDryRunExactlyAsEnforced(t *testing.T) {
	srv := redistest.Start(t)
	handler := func(prefix, dryRun string) string {
		return fmt.Sprintf(`rate_limit_redis {
			redis {
				address %s
			}
			key_prefix %s:
			headers both%s
			deny_cache {
				max_age 1h # the cached denials below must not expire on a slow machine
			}
			zone %s_api {
				key {http.request.header.X-Client}
				capacity 3
				refill_rate 1/1h
				cost {http.request.header.X-Cost}
			}
			zone %s_login {
				match path /login
				key {http.request.header.X-Client}
				algorithm sliding_window
				limit 1
				window 1h
			}
		}`, srv.Addr, prefix, dryRun, prefix, prefix)
	}
	const report = `allowed={http.rate_limit_redis.allowed} zone={http.rate_limit_redis.zone} key={http.rate_limit_redis.key} limit={http.rate_limit_redis.limit} remaining={http.rate_limit_redis.remaining} reset={http.rate_limit_redis.reset} retry={http.rate_limit_redis.retry_after} degraded={http.rate_limit_redis.degraded}`
	cs := startCaddy(t, fmt.Sprintf(`
	handle_path /enforced/* {
		%s
		respond "%s"
	}
	handle_path /dry/* {
		%s
		respond "%s"
	}
	handle_errors {
		respond "%s" {err.status_code}
	}`, handler("en", ""), report, handler("dr", "\n\t\t\tdry_run"), report, report))
	reg := activeRegistry(t)
	zones := []string{"en_api", "en_login", "dr_api", "dr_login"}
	before := takeSnapshot(t, reg, zones...)

	// The client's requests: api has 3 tokens, login 1 slot.
	for _, step := range []struct {
		name, path, cost string
		enforced         int // the enforcing handler's status
	}{
		{"login, allowed by both zones", "/login", "", 200},
		{"login again: denied by login, api not charged", "/login", "", 429},
		{"login again: denied from the deny cache", "/login", "", 429},
		{"a cost above the quota: denied, no Retry-After even enforced", "/", "4", 429},
		{"a bad cost: 400 enforced, no decision", "/", "x", 400},
		{"two tokens", "/", "2", 200},
		{"no token left: denied by api", "/", "", 429},
		{"denied by api from the deny cache", "/", "", 429},
	} {
		hdr := []string{"X-Client", "c1"}
		if step.cost != "" {
			hdr = append(hdr, "X-Cost", step.cost)
		}
		en := cs.get("/enforced"+step.path, hdr...)
		dr := cs.get("/dry"+step.path, hdr...)
		if en.status != step.enforced {
			t.Fatalf("%s: enforced status %d %q, want %d", step.name, en.status, en.body, step.enforced)
		}
		if dr.status != 200 {
			t.Fatalf("%s: dry run status %d %q, want 200", step.name, dr.status, dr.body)
		}
		// Everything the dry run reports, with its zone names, equals what enforcement reports.
		drBody := strings.ReplaceAll(dr.body, "zone=dr_", "zone=en_")
		if drBody != en.body {
			t.Fatalf("%s: dry run reports %q, enforcement %q", step.name, dr.body, en.body)
		}
		wantHeaders := rateLimitHeaders(en.header)
		delete(wantHeaders, "Retry-After")
		if got := rateLimitHeaders(dr.header); !maps.Equal(got, wantHeaders) {
			t.Fatalf("%s: dry run headers %v, want enforcement's without Retry-After: %v", step.name, got, wantHeaders)
		}
		if step.enforced == 429 && !strings.HasPrefix(drBody, "allowed=false") {
			t.Fatalf("%s: dry run reports %q, want allowed=false", step.name, dr.body)
		}
	}

	// The same charges: every key of one has its twin in the other, with the same state.
	keys := srv.Client().Keys(t.Context(), "en:*").Val()
	if len(keys) != 2 {
		t.Fatalf("the enforcing handler wrote keys %v, want a bucket and a window", keys)
	}
	for _, k := range keys {
		twin := "dr:" + strings.Replace(strings.TrimPrefix(k, "en:"), ":en_", ":dr_", 1)
		if got, want := redisState(t, srv, twin), redisState(t, srv, k); got != want {
			t.Errorf("Redis %s is %s, but %s is %s", twin, got, k, want)
		}
	}

	want := map[string]float64{
		"en_api/allowed": 2, "en_login/allowed": 1, "en_login/denied": 2, "en_api/denied": 3,
		"dr_api/allowed": 2, "dr_login/allowed": 1, "dr_login/dry_run_denied": 2, "dr_api/dry_run_denied": 3,
		"cache_hit": 4, "calls": 10, // 5 Redis calls each: not the cached denials, not the bad cost
	}
	expectDeltas(t, "metrics", before, takeSnapshot(t, reg, zones...), want)
}

// TestDryRunRedisDown: with Redis down, dry_run reports what the failure mode would do without
// doing it. fail_mode closed: the request goes on with 200, {http.rate_limit_redis.allowed} is
// false as for the 503 it would have been, and no header is sent (the 503 would carry only
// Retry-After). fail_mode local: the in-process limiter's denial is reported (allowed=false,
// its headers and X-RateLimit-Degraded) but not enforced.
func TestDryRunRedisDown(t *testing.T) {
	for _, tc := range []struct {
		mode   string
		expect func(t *testing.T, cs *caddyServer)
	}{
		{"closed", func(t *testing.T, cs *caddyServer) {
			for i := 0; i < 3; i++ {
				cs.get("/").expect(t, "redis down", 200, "allowed=false degraded=true retry={http.rate_limit_redis.retry_after}",
					"Retry-After", "", "X-RateLimit-Degraded", "", "X-RateLimit-Limit", "")
			}
		}},
		{"local", func(t *testing.T, cs *caddyServer) {
			cs.get("/").expect(t, "local, admitted", 200, "allowed=true degraded=true retry=0",
				"X-RateLimit-Degraded", "true", "X-RateLimit-Remaining", "0", "Retry-After", "")
			cs.get("/").expect(t, "local, would be denied", 200, "allowed=false degraded=true retry=3600",
				"X-RateLimit-Degraded", "true", "X-RateLimit-Remaining", "0", "X-RateLimit-Limit", "1", "Retry-After", "")
		}},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			srv := redistest.Start(t)
			srv.Stop()
			cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		dry_run
		fail_mode %s
		capacity 1
		refill_rate 1/1h
	}
	respond "allowed={http.rate_limit_redis.allowed} degraded={http.rate_limit_redis.degraded} retry={http.rate_limit_redis.retry_after}"`, srv.Addr, tc.mode))
			tc.expect(t, cs)
		})
	}
}

// rateLimitHeaders returns the rate limit headers of h (Retry-After included), as name: value.
func rateLimitHeaders(h http.Header) map[string]string {
	m := make(map[string]string)
	for _, name := range []string{"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "X-RateLimit-Degraded", "RateLimit", "RateLimit-Policy", "Retry-After"} {
		if v := h.Values(name); len(v) > 0 {
			m[name] = strings.Join(v, ", ")
		}
	}
	// The zone names differ between the two handlers: compare them as one.
	for k, v := range m {
		m[k] = strings.ReplaceAll(v, `"dr_`, `"en_`)
	}
	return m
}

// redisState describes the state of a limiter key without its timestamps: a token bucket's
// whole tokens when last written, a window's entry count.
func redisState(t *testing.T, srv *redistest.Server, key string) string {
	t.Helper()
	switch typ := srv.Do("TYPE", key); typ {
	case "zset":
		return fmt.Sprintf("window of %v entries", srv.Do("ZCARD", key))
	case "hash":
		tokens, err := strconv.ParseFloat(fmt.Sprint(srv.Do("HGET", key, "t")), 64)
		if err != nil {
			t.Fatalf("bucket %s: %v", key, err)
		}
		return fmt.Sprintf("bucket of %v tokens", math.Floor(tokens))
	default:
		return fmt.Sprintf("%v", typ)
	}
}
