package ratelimitredis

import (
	"fmt"
	"strconv"
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
	saved := breakerOpenFor
	breakerOpenFor = 3 * time.Second
	t.Cleanup(func() { breakerOpenFor = saved })
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode closed
		capacity 100
		refill_rate 100
	}
	respond "ok"`, srv.Addr))
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
