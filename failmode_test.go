package ratelimitredis

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestFailLocalEnforcesPerInstance: with fail_mode local and Redis down, the zone still holds
// on this instance (capacity 3: three requests pass, the fourth is a 429 with Retry-After), every
// response is marked degraded; when Redis is back, Redis decides again, from its own state.
func TestFailLocalEnforcesPerInstance(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode local
		capacity 3
		refill_rate 1/1h
	}
	respond "ok {http.rate_limit_redis.degraded}"`, srv.Addr))
	cs.get("/").expect(t, "redis up", 200, "ok false", "X-RateLimit-Remaining", "2", "X-RateLimit-Degraded", "")
	srv.Stop()
	for i := 1; i <= 3; i++ {
		cs.get("/").expect(t, "local "+strconv.Itoa(i), 200, "ok true",
			"X-RateLimit-Degraded", "true", "X-RateLimit-Limit", "3", "X-RateLimit-Remaining", strconv.Itoa(3-i))
	}
	cs.get("/").expect(t, "local, over the limit", 429, "",
		"X-RateLimit-Degraded", "true", "Retry-After", "3600", "X-RateLimit-Remaining", "0")

	srv.Restart() // empty: the client's bucket in Redis is full again
	waitFor(t, 2*time.Second, "Redis decides again", func() bool {
		return cs.get("/").header.Get("X-RateLimit-Degraded") == ""
	})
	cs.get("/").expect(t, "redis back", 200, "ok false", "X-RateLimit-Remaining", "1", "X-RateLimit-Degraded", "")
}

// TestCircuitBreakerStopsCallingRedis: while Redis fails every script call (out of memory), the
// breaker opens after breakerTrips consecutive failures; from then on requests get fail_mode
// without Redis seeing a call, counted as circuit_open. When Redis recovers, a probe closes the
// breaker and decisions come from Redis again.
func TestCircuitBreakerStopsCallingRedis(t *testing.T) {
	// Long enough that the requests below all meet the open breaker, whatever the machine's load.
	const breakerOpenFor = 3 * time.Second
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
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
	cs.get("/").expect(t, "healthy", 200, "ok")
	srv.Do("CONFIG", "SET", "maxmemory-policy", "noeviction")
	srv.Do("CONFIG", "SET", "maxmemory", "1") // every script that may write is refused: OOM

	openBefore := testutil.ToFloat64(metrics.backendFailures.WithLabelValues("circuit_open"))
	errorsBefore := testutil.ToFloat64(metrics.backendFailures.WithLabelValues("oom"))
	for i := 0; i < breakerTrips; i++ {
		cs.get("/").expect(t, "failing "+strconv.Itoa(i), 503, "", "Retry-After", "1")
	}
	if got := testutil.ToFloat64(metrics.backendFailures.WithLabelValues("oom")) - errorsBefore; got != breakerTrips {
		t.Fatalf("oom failures = %v, want %d", got, breakerTrips)
	}
	calls := srv.ScriptCalls()
	const whileOpen = 20
	for i := 0; i < whileOpen; i++ {
		cs.get("/").expect(t, "breaker open", 503, "", "Retry-After", "1")
	}
	if got := srv.ScriptCalls(); got != calls {
		t.Fatalf("Redis saw %d script calls while the breaker was open, want 0", got-calls)
	}
	if got := testutil.ToFloat64(metrics.backendFailures.WithLabelValues("circuit_open")) - openBefore; got != whileOpen {
		t.Fatalf("circuit_open failures = %v, want %d", got, whileOpen)
	}

	srv.Do("CONFIG", "SET", "maxmemory", "0")
	waitFor(t, 2*breakerOpenFor, "the breaker closes after Redis recovers", func() bool {
		return cs.get("/").status == 200
	})
	cs.get("/").expect(t, "closed again", 200, "ok")
}

// TestCachedDenialHoldsWhileBreakerOpen: a client denied before Redis failed stays denied (from
// the deny cache) under fail_mode open, even once the breaker is open, while other clients are
// let through degraded.
func TestCachedDenialHoldsWhileBreakerOpen(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
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
	cs.get("/", "X-Client", "greedy").expect(t, "first", 200, "ok")
	cs.get("/", "X-Client", "greedy").expect(t, "denied", 429, "", "Retry-After", "3600")
	srv.Stop()
	for i := 0; i < breakerTrips+3; i++ { // trips the breaker, then meets it open
		cs.get("/", "X-Client", "other"+strconv.Itoa(i)).expect(t, "other client, redis down", 200, "ok", "X-RateLimit-Degraded", "true")
	}
	cs.get("/", "X-Client", "greedy").expect(t, "still denied from the cache", 429, "", "Retry-After", "3600", "X-RateLimit-Degraded", "")
}

// TestPerZoneFailMode: with Redis down, each zone gets its own fail_mode: the login zone
// (closed) answers 503, the api zone (the handler's open) lets requests through, the upload
// zone (local) is enforced in process. A request in several zones gets the strictest: closed
// over local over open. Each zone counts the result its own fail_mode gave, except that a
// refused request (503, or 429 of a local zone) counts only in the zones that refused it.
func TestPerZoneFailMode(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
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
	cs.get("/login").expect(t, "redis up", 200, "ok degraded=false", "X-RateLimit-Limit", "5")
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
		cs.get("/").expect(t, "/", 200, "ok degraded=true", "X-RateLimit-Degraded", "true", "Retry-After", "")
	}, map[string]float64{"failures": 1, "pz_api/fail_open": 1})
	step("the login zone alone fails closed", func() {
		// /login is in pz_api (open) and pz_login (closed): closed wins.
		cs.get("/login").expect(t, "/login", 503, "", "Retry-After", "1", "X-RateLimit-Degraded", "")
	}, map[string]float64{"failures": 1, "pz_login/fail_closed": 1})
	step("the api zone again, after the login zone's 503", func() {
		cs.get("/").expect(t, "/ again", 200, "ok degraded=true", "X-RateLimit-Degraded", "true")
	}, map[string]float64{"failures": 1, "pz_api/fail_open": 1})
	step("the upload zone is enforced in process; the api zone fails open", func() {
		for i := 1; i <= 2; i++ {
			cs.get("/upload").expect(t, "upload "+strconv.Itoa(i), 200, "ok degraded=true",
				"X-RateLimit-Degraded", "true", "X-RateLimit-Limit", "2", "X-RateLimit-Remaining", strconv.Itoa(2-i))
		}
		cs.get("/upload").expect(t, "upload 3", 429, "", "X-RateLimit-Degraded", "true", "Retry-After", "3600")
	}, map[string]float64{"failures": 3, "pz_upload/local": 2, "pz_api/fail_open": 2, "pz_upload/local_denied": 1})

	srv.Restart()
	waitFor(t, 5*time.Second, "Redis decides again", func() bool {
		return cs.get("/login").status == 200
	})
	cs.get("/upload").expect(t, "redis back", 200, "ok degraded=false", "X-RateLimit-Degraded", "", "X-RateLimit-Remaining", "1")
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
			cs := startCaddy(t, fmt.Sprintf(`
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
				cs.get("/").expect(t, "redis down", 200, "degraded=true", "X-RateLimit-Degraded", tc.want, "X-RateLimit-Limit", limit)
			}
		})
	}
}

// TestFailLocalFloodEvictsNoOne (issue 29, finding 4; t_local_evict.sh and its control
// t_local_control.sh): Caddyfile.example's zones with fail_mode local and Redis down, 64
// buckets per zone instead of 65,536. One address spends its 3 login attempts; another sends
// 1,000 requests with fresh X-API-Keys (40 admitted by its ip zone, the rest 429). The login
// bucket stays spent: 429 x5, as in the control without the flood. (The login window is 1h
// rather than the script's 1m, so that no attempt comes back with the refill however long the
// flood takes.)
func TestFailLocalFloodEvictsNoOne(t *testing.T) {
	for _, flood := range []bool{false, true} {
		t.Run(fmt.Sprintf("flood=%t", flood), func(t *testing.T) {
			cs := startSites(t, "\t\ttrusted_proxies static 127.0.0.1/32", fmt.Sprintf(`
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
	respond "ok {http.rate_limit_redis.zone} degraded={http.rate_limit_redis.degraded}"`, freeLoopbackPort(t)))[0]
			if h := liveHandler(t); h.localKeys != 64 {
				t.Fatalf("local_keys %d, want 64", h.localKeys)
			}
			login := func() string {
				var codes []string
				for range 5 {
					codes = append(codes, strconv.Itoa(cs.get("/login", "X-Forwarded-For", "198.51.100.66").status))
				}
				return strings.Join(codes, " ")
			}
			if got := login(); got != "200 200 200 429 429" {
				t.Fatalf("login attempts: %s, want 200 200 200 429 429", got)
			}
			if flood {
				admitted := 0
				for i := range 1000 {
					r := cs.get("/", "X-Forwarded-For", "198.51.100.99", "X-API-Key", "fresh-"+strconv.Itoa(i))
					if r.status == 200 {
						admitted++
					} else if r.status != 429 {
						t.Fatalf("flood request %d: %d %q", i, r.status, r.body)
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
	cs := startCaddy(t, fmt.Sprintf(`
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
	cs.get("/", "X-API-Key", "alice").expect(t, "fail open", 200,
		"zone=api key=alice limit=5 remaining={http.rate_limit_redis.remaining} reset={http.rate_limit_redis.reset} retry={http.rate_limit_redis.retry_after} waited={http.rate_limit_redis.waited} degraded=true allowed=true",
		"X-RateLimit-Degraded", "true")
	cs.get("/login").expect(t, "fail closed", 503,
		"err zone=login key=127.0.0.1 limit=3 remaining={http.rate_limit_redis.remaining} degraded=true allowed=false",
		"Retry-After", "1")
}
