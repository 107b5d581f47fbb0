package ratelimitredis

// The decision and its failures (decide.go): fail modes per handler and per zone, the circuit
// breaker, the deny cache, dry run, replies of the wrong shape, a Redis over maxmemory, and a
// client gone before the decision.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestFailLocalEnforcesPerInstance: with fail_mode local and Redis down, the zone still holds
// on this instance (capacity 3: three requests pass, the fourth is a 429 with Retry-After), every
// response is marked degraded; when Redis is back, Redis decides again, from its own state.
func TestFailLocalEnforcesPerInstance(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode local
		capacity 3
		refill_rate 1/1h
	}
	respond "ok {http.rate_limit_redis.degraded}"`, srv.Addr))
	cs.Get("/").Expect(t, "redis up", 200, "ok false", "X-RateLimit-Remaining", "2", "X-RateLimit-Degraded", "")
	srv.Stop()
	for i := 1; i <= 3; i++ {
		cs.Get("/").Expect(t, "local "+strconv.Itoa(i), 200, "ok true",
			"X-RateLimit-Degraded", "true", "X-RateLimit-Limit", "3", "X-RateLimit-Remaining", strconv.Itoa(3-i))
	}
	cs.Get("/").Expect(t, "local, over the limit", 429, "",
		"X-RateLimit-Degraded", "true", "Retry-After", "3600", "X-RateLimit-Remaining", "0")

	srv.Restart() // empty: the client's bucket in Redis is full again
	redistest.WaitFor(t, 2*time.Second, "Redis decides again", func() bool {
		return cs.Get("/").Header.Get("X-RateLimit-Degraded") == ""
	})
	cs.Get("/").Expect(t, "redis back", 200, "ok false", "X-RateLimit-Remaining", "1", "X-RateLimit-Degraded", "")
}

// TestCircuitBreakerStopsCallingRedis: while Redis fails every script call (out of memory), the
// breaker opens after breakerTrips consecutive failures; from then on requests get fail_mode
// without Redis seeing a call, counted as circuit_open. When Redis recovers, a probe closes the
// breaker and decisions come from Redis again.
func TestCircuitBreakerStopsCallingRedis(t *testing.T) {
	// Long enough that the requests below all meet the open breaker, whatever the machine's load.
	const breakerOpenFor = 3 * time.Second
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis_tuned breaker_open_for=3s {
		redis {
			address %s
		}
		fail_mode closed
		capacity 100
		refill_rate 100
	}
	respond "ok"`, srv.Addr))
	if h := liveHandler(t); h.client.breakerOpenFor != breakerOpenFor {
		t.Fatalf("breaker open for %v, want %v", h.client.breakerOpenFor, breakerOpenFor)
	}
	cs.Get("/").Expect(t, "healthy", 200, "ok")
	srv.Do("CONFIG", "SET", "maxmemory-policy", "noeviction")
	srv.Do("CONFIG", "SET", "maxmemory", "1") // every script that may write is refused: OOM

	openBefore := testutil.ToFloat64(metrics.backendFailures.WithLabelValues("circuit_open"))
	errorsBefore := testutil.ToFloat64(metrics.backendFailures.WithLabelValues("oom"))
	for i := 0; i < breakerTrips; i++ {
		cs.Get("/").Expect(t, "failing "+strconv.Itoa(i), 503, "", "Retry-After", "1")
	}
	if got := testutil.ToFloat64(metrics.backendFailures.WithLabelValues("oom")) - errorsBefore; got != breakerTrips {
		t.Fatalf("oom failures = %v, want %d", got, breakerTrips)
	}
	calls := srv.ScriptCalls()
	const whileOpen = 20
	for i := 0; i < whileOpen; i++ {
		cs.Get("/").Expect(t, "breaker open", 503, "", "Retry-After", "1")
	}
	if got := srv.ScriptCalls(); got != calls {
		t.Fatalf("Redis saw %d script calls while the breaker was open, want 0", got-calls)
	}
	if got := testutil.ToFloat64(metrics.backendFailures.WithLabelValues("circuit_open")) - openBefore; got != whileOpen {
		t.Fatalf("circuit_open failures = %v, want %d", got, whileOpen)
	}

	srv.Do("CONFIG", "SET", "maxmemory", "0")
	redistest.WaitFor(t, 2*breakerOpenFor, "the breaker closes after Redis recovers", func() bool {
		return cs.Get("/").Status == 200
	})
	cs.Get("/").Expect(t, "closed again", 200, "ok")
}

// TestCachedDenialHoldsWhileBreakerOpen: a client denied before Redis failed stays denied (from
// the deny cache) under fail_mode open, even once the breaker is open, while other clients are
// let through degraded.
func TestCachedDenialHoldsWhileBreakerOpen(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode open
		key {http.request.header.X-Client}
		capacity 1
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr))
	cs.Get("/", "X-Client", "greedy").Expect(t, "first", 200, "ok")
	cs.Get("/", "X-Client", "greedy").Expect(t, "denied", 429, "", "Retry-After", "3600")
	srv.Stop()
	for i := 0; i < breakerTrips+3; i++ { // trips the breaker, then meets it open
		cs.Get("/", "X-Client", "other"+strconv.Itoa(i)).Expect(t, "other client, redis down", 200, "ok", "X-RateLimit-Degraded", "true")
	}
	cs.Get("/", "X-Client", "greedy").Expect(t, "still denied from the cache", 429, "", "Retry-After", "3600", "X-RateLimit-Degraded", "")
}

// TestPerZoneFailMode: with Redis down, each zone gets its own fail_mode: the login zone
// (closed) answers 503, the api zone (the handler's open) lets requests through, the upload
// zone (local) is enforced in process. A request in several zones gets the strictest: closed
// over local over open. Each zone counts the result its own fail_mode gave, except that a
// refused request (503, or 429 of a local zone) counts only in the zones that refused it.
func TestPerZoneFailMode(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode open
		zone pz_api {
			capacity 100
			refill_rate 10
		}
		zone pz_login {
			match path /login
			fail_mode closed
			algorithm sliding_window
			limit 5
			window 1m
		}
		zone pz_upload {
			match path /upload
			fail_mode local
			capacity 2
			refill_rate 1/1h
		}
	}
	respond "ok degraded={http.rate_limit_redis.degraded}"`, srv.Addr))
	reg := activeRegistry(t)
	zones := []string{"pz_api", "pz_login", "pz_upload"}
	cs.Get("/login").Expect(t, "redis up", 200, "ok degraded=false", "X-RateLimit-Limit", "5")
	srv.Stop()

	step := func(name string, do func(), want map[string]float64) {
		t.Helper()
		before := takeSnapshot(t, reg, zones...)
		do()
		after := takeSnapshot(t, reg, zones...)
		// Failures: a call, or the open breaker; how many of each depends on when the breaker
		// opens, so only their sum is checked.
		fails := after["failure/called"] + after["failure/circuit_open"] - before["failure/called"] - before["failure/circuit_open"]
		if fails != want["failures"] {
			t.Fatalf("%s: %v failures, want %v", name, fails, want["failures"])
		}
		delete(want, "failures")
		for _, k := range []string{"calls", "failure/called", "failure/circuit_open"} {
			before[k], after[k] = 0, 0
		}
		expectDeltas(t, name, before, after, want)
	}
	step("the api zone alone fails open", func() {
		cs.Get("/").Expect(t, "/", 200, "ok degraded=true", "X-RateLimit-Degraded", "true", "Retry-After", "")
	}, map[string]float64{"failures": 1, "pz_api/fail_open": 1})
	step("the login zone alone fails closed", func() {
		// /login is in pz_api (open) and pz_login (closed): closed wins.
		cs.Get("/login").Expect(t, "/login", 503, "", "Retry-After", "1", "X-RateLimit-Degraded", "")
	}, map[string]float64{"failures": 1, "pz_login/fail_closed": 1})
	step("the api zone again, after the login zone's 503", func() {
		cs.Get("/").Expect(t, "/ again", 200, "ok degraded=true", "X-RateLimit-Degraded", "true")
	}, map[string]float64{"failures": 1, "pz_api/fail_open": 1})
	step("the upload zone is enforced in process; the api zone fails open", func() {
		for i := 1; i <= 2; i++ {
			cs.Get("/upload").Expect(t, "upload "+strconv.Itoa(i), 200, "ok degraded=true",
				"X-RateLimit-Degraded", "true", "X-RateLimit-Limit", "2", "X-RateLimit-Remaining", strconv.Itoa(2-i))
		}
		cs.Get("/upload").Expect(t, "upload 3", 429, "", "X-RateLimit-Degraded", "true", "Retry-After", "3600")
	}, map[string]float64{"failures": 3, "pz_upload/local": 2, "pz_api/fail_open": 2, "pz_upload/local_denied": 1})

	srv.Restart()
	redistest.WaitFor(t, 5*time.Second, "Redis decides again", func() bool {
		return cs.Get("/login").Status == 200
	})
	cs.Get("/upload").Expect(t, "redis back", 200, "ok degraded=false", "X-RateLimit-Degraded", "", "X-RateLimit-Remaining", "1")
}

// TestDegradedHeaderOff: with degraded_header off, a response decided while Redis fails carries
// no X-RateLimit-Degraded (fail_mode open, and local with its rate limit headers), while the
// {http.rate_limit_redis.degraded} placeholder still says it. With it on (the default), the
// header is there.
func TestDegradedHeaderOff(t *testing.T) {
	for _, tc := range []struct {
		option, mode, want string
	}{
		{"", "open", "true"},
		{"degraded_header on", "open", "true"},
		{"degraded_header off", "open", ""},
		{"", "local", "true"},
		{"degraded_header off", "local", ""},
	} {
		t.Run(tc.mode+" "+tc.option, func(t *testing.T) {
			srv := redistest.Start(t)
			srv.Stop()
			cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode %s
		%s
		capacity 10
		refill_rate 1/1h
	}
	respond "degraded={http.rate_limit_redis.degraded}"`, srv.Addr, tc.mode, tc.option))
			limit := ""
			if tc.mode == "local" {
				limit = "10"
			}
			for i := 0; i < breakerTrips+2; i++ { // failed calls, then the open breaker
				cs.Get("/").Expect(t, "redis down", 200, "degraded=true", "X-RateLimit-Degraded", tc.want, "X-RateLimit-Limit", limit)
			}
		})
	}
}

// TestFailLocalFloodEvictsNoOne (t_local_evict.sh and its control
// t_local_control.sh): Caddyfile.example's zones with fail_mode local and Redis down, 64
// buckets per zone instead of 65,536. One address spends its 3 login attempts; another sends
// 1,000 requests with fresh X-API-Keys (40 admitted by its ip zone, the rest 429). The login
// bucket stays spent: 429 x5, as in the control without the flood. (The login window is 1h
// rather than the script's 1m, so that no attempt comes back with the refill however long the
// flood takes.)
func TestFailLocalFloodEvictsNoOne(t *testing.T) {
	for _, flood := range []bool{false, true} {
		t.Run(fmt.Sprintf("flood=%t", flood), func(t *testing.T) {
			cs := caddytest.StartSites(t, "\t\ttrusted_proxies static 127.0.0.1/32", fmt.Sprintf(`
	rate_limit_redis_tuned local_keys=64 {
		redis {
			address 127.0.0.1:%d
		}
		fail_mode local
		zone api {
			key {http.request.header.X-API-Key} {client_ip}
			capacity 5
			refill_rate 1/10s
		}
		zone ip {
			key {client_ip}
			capacity 40
			refill_rate 1/2s
		}
		zone login {
			match path /login /login/*
			key {client_ip}
			algorithm sliding_window
			limit 3
			window 1h
		}
	}
	respond "ok {http.rate_limit_redis.zone} degraded={http.rate_limit_redis.degraded}"`, freeport.Must(t)))[0]
			if h := liveHandler(t); h.localKeys != 64 {
				t.Fatalf("local_keys %d, want 64", h.localKeys)
			}
			login := func() string {
				var codes []string
				for range 5 {
					codes = append(codes, strconv.Itoa(cs.Get("/login", "X-Forwarded-For", "198.51.100.66").Status))
				}
				return strings.Join(codes, " ")
			}
			if got := login(); got != "200 200 200 429 429" {
				t.Fatalf("login attempts: %s, want 200 200 200 429 429", got)
			}
			if flood {
				admitted := 0
				for i := range 1000 {
					r := cs.Get("/", "X-Forwarded-For", "198.51.100.99", "X-API-Key", "fresh-"+strconv.Itoa(i))
					if r.Status == 200 {
						admitted++
					} else if r.Status != 429 {
						t.Fatalf("flood request %d: %d %q", i, r.Status, r.Body)
					}
				}
				if admitted != 40 {
					t.Fatalf("the flood: %d admitted, want 40 (its ip zone's capacity)", admitted)
				}
			}
			if got := login(); got != "429 429 429 429 429" {
				t.Fatalf("login attempts after (flood %t): %s, want 429 x5", flood, got)
			}
		})
	}
}

// TestFailOpenClosedPlaceholders: when Redis fails and fail_mode open or closed answers, nothing
// is decided, but the zone, its client key and its configured limit are known, and their
// placeholders are set: the first zone's under open, the first closed zone's for a 503 of
// closed. remaining, reset, retry_after and waited are not set (Caddy leaves an unknown
// placeholder as it is written), as docs/responses.md says.
func TestFailOpenClosedPlaceholders(t *testing.T) {
	srv := redistest.Start(t)
	srv.Stop()
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone api {
			key {http.request.header.X-API-Key} {client_ip}
			capacity 5
			refill_rate 1
		}
		zone login {
			match path /login
			key {client_ip}
			fail_mode closed
			algorithm sliding_window
			limit 3
			window 1m
		}
	}
	respond "zone={http.rate_limit_redis.zone} key={http.rate_limit_redis.key} limit={http.rate_limit_redis.limit} remaining={http.rate_limit_redis.remaining} reset={http.rate_limit_redis.reset} retry={http.rate_limit_redis.retry_after} waited={http.rate_limit_redis.waited} degraded={http.rate_limit_redis.degraded} allowed={http.rate_limit_redis.allowed}"
	handle_errors {
		respond "err zone={http.rate_limit_redis.zone} key={http.rate_limit_redis.key} limit={http.rate_limit_redis.limit} remaining={http.rate_limit_redis.remaining} degraded={http.rate_limit_redis.degraded} allowed={http.rate_limit_redis.allowed}" {err.status_code}
	}`, srv.Addr))
	cs.Get("/", "X-API-Key", "alice").Expect(t, "fail open", 200,
		"zone=api key=alice limit=5 remaining={http.rate_limit_redis.remaining} reset={http.rate_limit_redis.reset} retry={http.rate_limit_redis.retry_after} waited={http.rate_limit_redis.waited} degraded=true allowed=true",
		"X-RateLimit-Degraded", "true")
	cs.Get("/login").Expect(t, "fail closed", 503,
		"err zone=login key=127.0.0.1 limit=3 remaining={http.rate_limit_redis.remaining} degraded=true allowed=false",
		"Retry-After", "1")
}

// TestDryRunExactlyAsEnforced sends the same requests to two handlers that differ only in
// dry_run (and their zone names, so that their metrics are apart): an enforcing one under
// /enforced and a dry-run one under /dry. The dry run decides, charges, heads, reports and counts
// every request exactly as enforcement does (denials as dry_run_denied); it only never rejects:
// each request reaches the next handler with 200, and no Retry-After is sent.
func TestDryRunExactlyAsEnforced(t *testing.T) {
	srv := redistest.Start(t)
	newFakeClock(t) // the cached denials below stay within max_age: the handlers' clock stands still
	handler := func(prefix, dryRun string) string {
		return fmt.Sprintf(`rate_limit_redis_tuned clock=%s {
			redis {
				address %s
			}
			key_prefix %s:
			headers both%s
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
		}`, t.Name(), srv.Addr, prefix, dryRun, prefix, prefix)
	}
	const report = `allowed={http.rate_limit_redis.allowed} zone={http.rate_limit_redis.zone} key={http.rate_limit_redis.key} limit={http.rate_limit_redis.limit} remaining={http.rate_limit_redis.remaining} reset={http.rate_limit_redis.reset} retry={http.rate_limit_redis.retry_after} degraded={http.rate_limit_redis.degraded}`
	cs := caddytest.Start(t, fmt.Sprintf(`
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
		en := cs.Get("/enforced"+step.path, hdr...)
		dr := cs.Get("/dry"+step.path, hdr...)
		if en.Status != step.enforced {
			t.Fatalf("%s: enforced status %d %q, want %d", step.name, en.Status, en.Body, step.enforced)
		}
		if dr.Status != 200 {
			t.Fatalf("%s: dry run status %d %q, want 200", step.name, dr.Status, dr.Body)
		}
		// Everything the dry run reports, with its zone names, equals what enforcement reports.
		drBody := strings.ReplaceAll(dr.Body, "zone=dr_", "zone=en_")
		if drBody != en.Body {
			t.Fatalf("%s: dry run reports %q, enforcement %q", step.name, dr.Body, en.Body)
		}
		wantHeaders := rateLimitHeaders(en.Header)
		delete(wantHeaders, "Retry-After")
		if got := rateLimitHeaders(dr.Header); !maps.Equal(got, wantHeaders) {
			t.Fatalf("%s: dry run headers %v, want enforcement's without Retry-After: %v", step.name, got, wantHeaders)
		}
		if step.enforced == 429 && !strings.HasPrefix(drBody, "allowed=false") {
			t.Fatalf("%s: dry run reports %q, want allowed=false", step.name, dr.Body)
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
		expect func(t *testing.T, cs *caddytest.Site)
	}{
		{"closed", func(t *testing.T, cs *caddytest.Site) {
			for i := 0; i < 3; i++ {
				cs.Get("/").Expect(t, "redis down", 200, "allowed=false degraded=true retry={http.rate_limit_redis.retry_after}",
					"Retry-After", "", "X-RateLimit-Degraded", "", "X-RateLimit-Limit", "")
			}
		}},
		{"local", func(t *testing.T, cs *caddytest.Site) {
			cs.Get("/").Expect(t, "local, admitted", 200, "allowed=true degraded=true retry=0",
				"X-RateLimit-Degraded", "true", "X-RateLimit-Remaining", "0", "Retry-After", "")
			cs.Get("/").Expect(t, "local, would be denied", 200, "allowed=false degraded=true retry=3600",
				"X-RateLimit-Degraded", "true", "X-RateLimit-Remaining", "0", "X-RateLimit-Limit", "1", "Retry-After", "")
		}},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			srv := redistest.Start(t)
			srv.Stop()
			cs := caddytest.Start(t, fmt.Sprintf(`
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

// TestDenyCacheEndToEnd: with the deny cache on, a client over its limit is denied again with
// the same figures (less the time elapsed) and no Redis call, counted as a deny cache hit; with
// `deny_cache off` every denial is a Redis call. The handler's Go-side clock stands still, so
// the 10 repeated denials fall within the default max_age; TestDenyCacheOnByDefault checks its
// end. Retry-After and X-RateLimit-Reset are 3600s less the time since the first request at most
// (less twice that from the cache, whose times count from the denying call's sending): exactly
// 3600 on a machine that answers the 12 requests within half a second.
func TestDenyCacheEndToEnd(t *testing.T) {
	for _, tc := range []struct {
		name, option string
		wantCalls    int // script calls for the 10 repeated denials
		wantHits     float64
	}{
		{"on", "", 0, 10},
		{"off", "deny_cache off", 10, 0},
	} {
		t.Run("deny_cache="+tc.name, func(t *testing.T) {
			srv := redistest.Start(t)
			newFakeClock(t)
			cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis_tuned clock=%s {
		redis {
			address %s
		}
		%s
		capacity 1
		refill_rate 1/1h
	}
	respond "ok"`, t.Name(), srv.Addr, tc.option))
			a := srv.Time()
			cs.Get("/").Expect(t, "first", 200, "ok")
			cs.Get("/").Expect(t, "denied by Redis", 429, "", "X-RateLimit-Remaining", "0")
			calls := srv.ScriptCalls()
			hits := testutil.ToFloat64(metrics.denyCacheHits)
			for i := 0; i < 10; i++ {
				r := cs.Get("/")
				lo := int(math.Ceil((3600*time.Second - 2*srv.Time().Sub(a)).Seconds()))
				r.Expect(t, "denied again", 429, "", "X-RateLimit-Limit", "1", "X-RateLimit-Remaining", "0")
				for _, h := range []string{"Retry-After", "X-RateLimit-Reset"} {
					if got, err := strconv.Atoi(r.Header.Get(h)); err != nil || got < lo || got > 3600 {
						t.Fatalf("denied again: %s %q, want %d to 3600", h, r.Header.Get(h), lo)
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
// max_age (1s) of the denying call is answered from the cache, with no Redis call, and one
// repeated max_age after that call is sent to Redis again. The handler's Go-side clock is a
// fake one that only the test moves, so the ages are exact.
func TestDenyCacheOnByDefault(t *testing.T) {
	srv := redistest.Start(t)
	clk := newFakeClock(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis_tuned clock=%s {
		redis {
			address %s
		}
		capacity 1
		refill_rate 1/1h
	}
	respond "ok"`, t.Name(), srv.Addr))
	cs.Get("/").Expect(t, "first", 200, "ok")
	denied := func(step string, wantCalls, wantHits float64) {
		t.Helper()
		calls, hits := srv.ScriptCalls(), testutil.ToFloat64(metrics.denyCacheHits)
		cs.Get("/").Expect(t, step, 429, "")
		if got := float64(srv.ScriptCalls() - calls); got != wantCalls {
			t.Fatalf("%s: %v script calls, want %v", step, got, wantCalls)
		}
		if got := testutil.ToFloat64(metrics.denyCacheHits) - hits; got != wantHits {
			t.Fatalf("%s: %v deny cache hits, want %v", step, got, wantHits)
		}
	}
	denied("denied by Redis", 1, 0)
	clk.Advance(limiter.DefaultDenyCacheMaxAge - time.Microsecond)
	denied("denied again just within max_age", 0, 1)
	clk.Advance(time.Microsecond)
	denied("denied again at max_age", 1, 0)
	denied("denied again within the new max_age", 0, 1)
}

// TestOverMemoryCountedAsOOM: Redis over maxmemory (noeviction) refuses each decision before it
// runs: a flood of fresh API keys cannot grow Redis past its limit, and the failures are counted
// under the reason oom.
func TestOverMemoryCountedAsOOM(t *testing.T) {
	srv := redistest.Start(t, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
	cs := caddytest.Start(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-API-Key}
		algorithm sliding_window
		limit 100
		window 24h
	}
	respond "ok"`, srv.Addr))
	oom := func() float64 { return testutil.ToFloat64(metrics.backendFailures.WithLabelValues("oom")) }
	start := oom()
	// Until Redis refuses, then as many again: the circuit breaker opens after 5 refusals, and
	// its probes meet OOM again.
	sent := 0
	for ; sent < 100_000 && oom()-start < breakerTrips; sent++ {
		cs.Get("/", "X-API-Key", "key-"+strconv.Itoa(sent))
	}
	for i := 0; i < sent; i++ {
		cs.Get("/", "X-API-Key", "more-"+strconv.Itoa(i))
	}
	if oom()-start < breakerTrips {
		t.Fatalf("%.0f decisions counted as oom after %d fresh keys, want at least %d", oom()-start, 2*sent, breakerTrips)
	}
	t.Logf("%d fresh keys; %.0f decisions refused with OOM", 2*sent, oom()-start)
	used := infoInt(t, srv, "memory", "used_memory")
	if max := int64(3 << 20); used > max+max/20 {
		t.Fatalf("used_memory %d, want at most about maxmemory %d", used, max)
	}
}

// TestGarbageRepliesFailureReason: the limiter turns a reply of the wrong shape into an error
// that failureReason calls bad_response (and a connection closed mid-reply into redis_error),
// with no panic.
func TestGarbageRepliesFailureReason(t *testing.T) {
	zone := &limiter.Zone{Name: "z", Algorithm: limiter.TokenBucket, Capacity: 5, RefillRate: 1}
	if err := zone.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range garbageReplies {
		t.Run(tc.name, func(t *testing.T) {
			rdb := redis.NewClient(&redis.Options{Addr: redistest.StartGarbage(t, tc.reply, tc.hangUp), MaxRetries: -1, DisableIdentity: true})
			t.Cleanup(func() { _ = rdb.Close() })
			l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:"})
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			var err error
			panicked := func() (p any) {
				defer func() { p = recover() }()
				_, err = l.Decide(ctx, []limiter.Request{{Zone: zone, Key: "k", Cost: 1}})
				return nil
			}()
			var got string
			switch {
			case panicked != nil:
				got = fmt.Sprintf("a panic: %v", panicked)
			case err == nil:
				got = "no error"
			case ctx.Err() != nil:
				got = fmt.Sprintf("a hang (%v)", err)
			case string(failureReason(err)) != tc.reason:
				got = fmt.Sprintf("reason %s (%v)", failureReason(err), err)
			case tc.reason == "bad_response" && !errors.Is(err, limiter.ErrBadResponse):
				got = fmt.Sprintf("an error not wrapping ErrBadResponse (%v)", err)
			default:
				return
			}
			t.Fatalf("got %s, want an error of reason %s", got, tc.reason)
		})
	}
}

// TestClientGoneIsNotARedisFailure: a request whose client disconnected before the decision ends
// with 499, and neither applies fail_mode nor counts as a failure in the circuit breaker.
func TestClientGoneIsNotARedisFailure(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{
		Redis:    &RedisConfig{Addresses: []string{srv.Addr}},
		FailMode: FailOpen,
		Zones:    []*Zone{{Name: "z", Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
	})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r := httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx)
	_, err, nextCalled := serve(h, r)
	var he caddyhttp.HandlerError
	if !errors.As(err, &he) || he.StatusCode != 499 || nextCalled {
		t.Fatalf("got err %v (next called: %t), want a 499 HandlerError and no fail-open", err, nextCalled)
	}
	if c := h.client.breaker.Counts(); c.TotalFailures != 0 {
		t.Fatalf("a client that went away counted as a Redis failure: %+v", c)
	}
	// The same handler with a live request decides normally.
	w, err, nextCalled := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
	if err != nil || !nextCalled || w.Header().Get("X-RateLimit-Remaining") != "4" {
		t.Fatalf("live request: err %v, next %t, remaining %q; want allowed with 4 left", err, nextCalled, w.Header().Get("X-RateLimit-Remaining"))
	}
}

// infoInt reads an integer field of Redis INFO section.
func infoInt(t *testing.T, srv *redistest.Server, section, field string) int64 {
	t.Helper()
	for _, line := range strings.Split(srv.Do("INFO", section).(string), "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatalf("INFO %s: %s: %v", section, line, err)
			}
			return n
		}
	}
	t.Fatalf("INFO %s has no %s", section, field)
	return 0
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

// garbageReplies are script replies of the wrong shape for a request of one zone (whose right
// reply is an array of 6 integers: allowed, then allowed, remaining, retry after, reset, next), and the
// failureReason each must give.
var garbageReplies = []struct {
	name   string
	reply  string
	hangUp bool   // close the connection after the reply
	reason string // failureReason of the limiter's error
}{
	{name: "simple string", reply: "+OK\r\n", reason: "bad_response"},
	{name: "integer", reply: ":7\r\n", reason: "bad_response"},
	{name: "nil", reply: "$-1\r\n", reason: "bad_response"},
	{name: "array too short", reply: "*1\r\n:1\r\n", reason: "bad_response"},
	{name: "array too long", reply: "*7\r\n:1\r\n:1\r\n:4\r\n:0\r\n:0\r\n:0\r\n:0\r\n", reason: "bad_response"},
	{name: "bulk string for an integer", reply: "*6\r\n:1\r\n:1\r\n$1\r\n4\r\n:0\r\n:0\r\n:0\r\n", reason: "bad_response"},
	{name: "allowed out of range", reply: "*6\r\n:5\r\n:1\r\n:4\r\n:0\r\n:0\r\n:0\r\n", reason: "bad_response"},
	{name: "negative remaining", reply: "*6\r\n:1\r\n:1\r\n:-4\r\n:0\r\n:0\r\n:0\r\n", reason: "bad_response"},
	{name: "nested arrays", reply: "*6\r\n*1\r\n:1\r\n:1\r\n:4\r\n:0\r\n:0\r\n:0\r\n", reason: "bad_response"},
	{name: "error inside the array", reply: "*6\r\n:1\r\n-ERR nope\r\n:4\r\n:0\r\n:0\r\n:0\r\n", reason: "bad_response"},
	{name: "RESP3 double", reply: ",1.5\r\n", reason: "bad_response"},
	{name: "RESP3 map", reply: "%1\r\n+allowed\r\n:1\r\n", reason: "bad_response"},
	// A length that is declared but never delivered is a broken connection, not a reply.
	{name: "huge array length, connection closed", reply: "*1000000\r\n", hangUp: true, reason: "redis_error"},
	// go-redis panics (makeslice: len out of range) on it; the limiter turns that into a bad reply.
	{name: "array length beyond memory, connection closed", reply: "*35184372088832\r\n", hangUp: true, reason: "bad_response"},
	// The same for a bulk string: go-redis allocates its declared length (over 2^48 bytes).
	{name: "bulk string length beyond memory, connection closed", reply: "$1000000000000000\r\n", hangUp: true, reason: "bad_response"},
}

// TestGarbageRepliesApplyFailMode: a Redis whose script replies have the wrong shape is a Redis
// failure: fail_mode open answers 200 marked degraded, fail_mode closed 503 with Retry-After: 1;
// never a panic (which would drop the connection), never a hung request.
func TestGarbageRepliesApplyFailMode(t *testing.T) {
	for _, tc := range garbageReplies {
		for _, mode := range []string{FailOpen, FailClosed} {
			t.Run(tc.name+"/"+mode, func(t *testing.T) {
				addr := redistest.StartGarbage(t, tc.reply, tc.hangUp)
				cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode %s
		capacity 5
		refill_rate 1
	}
	respond "degraded={http.rate_limit_redis.degraded}"
	handle_errors {
		respond "err degraded={http.rate_limit_redis.degraded}" {err.status_code}
	}`, addr, mode))
				lc := caddytest.NewLoadClient(cs)
				for i := range 2 { // the second on a pooled connection, unless the first was dropped
					step := "request " + strconv.Itoa(i+1)
					r, err := lc.Get("/")
					if err != nil {
						t.Fatalf("%s: %v", step, err)
					}
					if mode == FailOpen {
						r.Expect(t, step, 200, "degraded=true", "X-RateLimit-Degraded", "true",
							"X-RateLimit-Limit", "", "Retry-After", "")
					} else {
						r.Expect(t, step, 503, "err degraded=true", "Retry-After", "1",
							"X-RateLimit-Limit", "", "X-RateLimit-Degraded", "")
					}
				}
			})
		}
	}
}
