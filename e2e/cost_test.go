package e2e_test

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func TestEndToEndCostPlaceholder(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		capacity 10
		refill_rate 1/1h
		cost {http.request.header.X-Cost}
	}
	respond "ok"`, srv.Addr))
	cs.Get("/", "X-Cost", "4").Expect(t, "cost 4", 200, "ok", "X-RateLimit-Remaining", "6")
	cs.Get("/").Expect(t, "no cost header counts 1", 200, "ok", "X-RateLimit-Remaining", "5")
	for _, bad := range []string{"abc", "0", "-3", "1.5", "NaN", "99999999999999999999"} {
		cs.Get("/", "X-Cost", bad).Expect(t, "cost "+bad, 400, "")
	}
	cs.Get("/", "X-Cost", "11").Expect(t, "cost above capacity", 429, "", "Retry-After", "", "X-RateLimit-Remaining", "5")
	cs.Get("/", "X-Cost", "5").Expect(t, "bad costs charged nothing", 200, "ok", "X-RateLimit-Remaining", "0")
}

// TestAbuseCostPlaceholder: every kind of hostile cost, end to end, with the statuses of DESIGN
// §5: empty counts as 1; anything but a positive integer is 400; a cost above the zone's
// capacity or limit is 429 without Retry-After. None of them charges the zone.
func TestAbuseCostPlaceholder(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.StartSites(t, "", fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone tb {
			match path /tb
			cost {http.request.header.X-Cost}
			capacity 10
			refill_rate 1/1h
		}
		zone sw {
			match path /sw
			cost {http.request.header.X-Cost}
			algorithm sliding_window
			limit 10
			window 1h
		}
	}
	respond "ok"`, srv.Addr))[0]

	bad := []string{"-1", "0", "-0", "00", "NaN", "nan", "Inf", "+Inf", "1e3", "0x10", "1.0", "1,000", "abc", "٣",
		"3 3", "+", "-", "99999999999999999999", "-9223372036854775808", "{http.request.header.X-Cost}"}
	for _, path := range []string{"/tb", "/sw"} {
		cs.Get(path, "X-Cost", "").Expect(t, path+" empty cost counts 1", 200, "ok", "X-RateLimit-Remaining", "9")
		cs.Get(path).Expect(t, path+" no cost header counts 1", 200, "ok", "X-RateLimit-Remaining", "8")
		cs.Get(path, "X-Cost", "+2").Expect(t, path+" cost +2", 200, "ok", "X-RateLimit-Remaining", "6")
		for _, cost := range bad {
			cs.Get(path, "X-Cost", cost).Expect(t, fmt.Sprintf("%s cost %q", path, cost), 400, "", "Retry-After", "", "X-RateLimit-Remaining", "")
		}
		// Decided by Redis, again and again: a huge cost once made the script's retry after
		// overflow, a bad_response that failed open and, five times over, opened the circuit
		// breaker for every client.
		for range 3 {
			for _, cost := range []string{"11", "9007199254740993", "9223372036854775807"} {
				cs.Get(path, "X-Cost", cost).Expect(t, fmt.Sprintf("%s cost %s above the quota", path, cost), 429, "",
					"Retry-After", "", "X-RateLimit-Remaining", "6", "X-RateLimit-Degraded", "")
			}
		}
		// Nothing above was charged: 6 left, so 7 waits (with Retry-After) and 6 passes.
		r := cs.Get(path, "X-Cost", "7")
		r.Expect(t, path+" cost 7 of 6 left", 429, "", "X-RateLimit-Remaining", "6")
		if ra, _ := strconv.Atoi(r.Header.Get("Retry-After")); ra < 1 {
			t.Fatalf("%s: Retry-After %q on a denial that waiting cures", path, r.Header.Get("Retry-After"))
		}
		cs.Get(path, "X-Cost", "6").Expect(t, path+" cost 6 of 6 left", 200, "ok", "X-RateLimit-Remaining", "0", "X-RateLimit-Degraded", "")
	}
}

// TestClientCostBounded: a client-chosen cost on a large sliding window log is bounded by
// max_cost (default 1000 there): a cost of 300,000 is answered at once, with no Retry-After,
// writing no entry, a cost of 1000 writes 1000, and a login zone on the same Redis stays
// limited meanwhile.
func TestClientCostBounded(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		zone big {
			key {http.request.header.X-API-Key}
			algorithm sliding_window
			limit 300000
			window 1h
			cost {http.request.header.X-Cost}
		}
		zone login {
			match path /login
			algorithm sliding_window
			limit 3
			window 1m
		}
	}
	respond "ok"`, srv.Addr))
	start := time.Now()
	r := cs.Get("/", "X-API-Key", "attacker", "X-Cost", "300000")
	if r.Status != 429 || r.Header.Get("Retry-After") != "" {
		t.Fatalf("cost 300000: %d Retry-After %q, want 429 without Retry-After", r.Status, r.Header.Get("Retry-After"))
	}
	t.Logf("cost 300000 answered in %v", time.Since(start))
	state := "rl:{attacker}:big:sw"
	if n := srv.Do("ZCARD", state); n != int64(0) {
		t.Fatalf("cost 300000 wrote %v entries, want none", n)
	}
	if r := cs.Get("/", "X-API-Key", "attacker", "X-Cost", "1000"); r.Status != 200 {
		t.Fatalf("cost 1000 (the default max_cost): %d, want 200", r.Status)
	}
	if n := srv.Do("ZCARD", state); n != int64(1000) {
		t.Fatalf("cost 1000 wrote %v entries, want 1000", n)
	}
	if got := cs.Statuses(4, "/login"); got != "200 200 200 429" {
		t.Fatalf("login zone: %s, want 200 200 200 429", got)
	}
}
