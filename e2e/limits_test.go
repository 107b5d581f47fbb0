package e2e_test

import (
	"fmt"
	"strconv"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func TestEndToEndTokenBucket(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		headers both
		capacity 3
		refill_rate 1/1h
	}
	respond "ok {http.rate_limit_redis.allowed} {http.rate_limit_redis.zone} {http.rate_limit_redis.remaining}"
	handle_errors {
		respond "limited zone={http.rate_limit_redis.zone} key={http.rate_limit_redis.key} limit={http.rate_limit_redis.limit} remaining={http.rate_limit_redis.remaining} retry={http.rate_limit_redis.retry_after} degraded={http.rate_limit_redis.degraded}" {err.status_code}
	}`, srv.Addr))

	// One token per hour: the bucket is full again 3600s per missing token after each request
	// (X-RateLimit-Reset), and its next token is always 3600s away (RateLimit's t).
	for i := 1; i <= 3; i++ {
		rem := strconv.Itoa(3 - i)
		reset := strconv.Itoa(3600 * i)
		cs.Get("/").Expect(t, "request "+strconv.Itoa(i), 200, "ok true default "+rem,
			"X-RateLimit-Limit", "3", "X-RateLimit-Remaining", rem, "X-RateLimit-Reset", reset,
			"RateLimit-Policy", `"default";q=3;w=10800`, "RateLimit", `"default";r=`+rem+`;t=3600`,
			"Retry-After", "")
	}
	cs.Get("/").Expect(t, "4th request", 429,
		"limited zone=default key=127.0.0.1 limit=3 remaining=0 retry=3600 degraded=false",
		"Retry-After", "3600", "X-RateLimit-Limit", "3", "X-RateLimit-Remaining", "0", "X-RateLimit-Reset", "10800",
		"RateLimit", `"default";r=0;t=3600`)
}

func TestEndToEndZonesFromDesign(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone api {
			key {http.request.header.X-API-Key} {client_ip}
			capacity 100
			refill_rate 10
		}
		zone login {
			match path /login
			key {client_ip}
			algorithm sliding_window
			limit 5
			window 1m
		}
	}
	respond "ok"
	handle_errors {
		respond "{http.rate_limit_redis.zone}" {err.status_code}
	}`, srv.Addr))

	// /login: the login zone (5/min) decides, having the least remaining share.
	for i := 1; i <= 5; i++ {
		cs.Get("/login").Expect(t, "login "+strconv.Itoa(i), 200, "ok",
			"X-RateLimit-Limit", "5", "X-RateLimit-Remaining", strconv.Itoa(5-i))
	}
	r := cs.Get("/login")
	r.Expect(t, "6th login", 429, "login", "X-RateLimit-Limit", "5", "X-RateLimit-Remaining", "0")
	if ra, _ := strconv.Atoi(r.Header.Get("Retry-After")); ra < 59 || ra > 60 {
		t.Fatalf("Retry-After = %q, want the ~60s until the first login leaves the window", r.Header.Get("Retry-After"))
	}
	// The api zone was charged 5 tokens, not 6: the denied login charged no zone.
	cs.Get("/").Expect(t, "api by IP", 200, "ok", "X-RateLimit-Limit", "100", "X-RateLimit-Remaining", "94")
	// An API key is its own client.
	cs.Get("/", "X-API-Key", "k1").Expect(t, "api by key", 200, "ok", "X-RateLimit-Remaining", "99")
	if v := srv.Do("HGET", "rl:{k1}:api:tb", "t"); v == nil {
		t.Fatal("no bucket under the API key's hash tag")
	}
}

func TestEndToEndDryRun(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		dry_run
		capacity 1
		refill_rate 1/1h
	}
	respond "allowed={http.rate_limit_redis.allowed} retry={http.rate_limit_redis.retry_after}"`, srv.Addr))
	cs.Get("/").Expect(t, "first", 200, "allowed=true retry=0", "X-RateLimit-Remaining", "0")
	cs.Get("/").Expect(t, "over the limit, dry run", 200, "allowed=false retry=3600",
		"X-RateLimit-Remaining", "0", "Retry-After", "")
}

// TestEndToEndSlidingWindowCounter: a sliding window counter zone through Caddy admits its
// limit and then denies, with a Retry-After.
func TestEndToEndSlidingWindowCounter(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		algorithm sliding_window_counter
		limit 2
		window 1h
	}
	respond "ok"`, srv.Addr))
	if got := cs.Statuses(3, "/"); got != "200 200 429" {
		t.Fatalf("got %s, want 200 200 429", got)
	}
	if ra, err := strconv.Atoi(cs.Get("/").Header.Get("Retry-After")); err != nil || ra < 1 || ra > 7200 {
		t.Fatalf("Retry-After %d, %v: want the wait until the estimate falls below the limit", ra, err)
	}
}

// TestDenyCacheAnswersAsRedis: through Caddy, a cached denial of cost 1 gives a request of
// another cost the answer Redis gives it: a cost of 2 its own, longer Retry-After, a cost above
// the capacity no Retry-After.
func TestDenyCacheAnswersAsRedis(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		capacity 2
		refill_rate 1/1h
		cost {http.request.header.X-Cost}
	}
	respond "ok"`, srv.Addr))
	retry := func(cost string) (int, string) {
		r := cs.Get("/", "X-Cost", cost)
		return r.Status, r.Header.Get("Retry-After")
	}
	for _, step := range []struct {
		cost, retry string
		status      int
	}{
		{"3", "", 429}, {"1", "", 200}, {"1", "", 200}, {"1", "3600", 429}, {"1", "3600", 429}, // the last one cached
		{"2", "7200", 429}, {"3", "", 429},
	} {
		if status, ra := retry(step.cost); status != step.status || (ra != step.retry && !(step.retry != "" && closeTo(ra, step.retry))) {
			t.Fatalf("cost %s: %d Retry-After %q, want %d %q", step.cost, status, ra, step.status, step.retry)
		}
	}
}

// closeTo reports whether two whole-second strings are within a second of each other.
func closeTo(a, b string) bool {
	x, err1 := strconv.Atoi(a)
	y, err2 := strconv.Atoi(b)
	return err1 == nil && err2 == nil && x-y <= 1 && y-x <= 1
}
