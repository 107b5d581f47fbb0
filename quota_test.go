package ratelimitredis

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestEndToEndDailyQuota: a fixed window of 3 per UTC day through Caddy: the headers and the
// 429's Retry-After say the seconds to the next UTC midnight; the admin API shows the count and
// the window, and a reset gives the client its quota back.
func TestEndToEndDailyQuota(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		headers both
		zone daily {
			key {http.request.header.X-API-Key}
			algorithm fixed_window
			limit 3
			period day
		}
	}
	respond "ok"`, srv.Addr))
	toMidnight := func() int {
		now := time.Now().UTC()
		return int(now.Truncate(24*time.Hour).Add(24*time.Hour).Sub(now).Seconds() + 0.999)
	}
	if toMidnight() < 30 {
		time.Sleep(time.Duration(toMidnight()+1) * time.Second) // not across a midnight
	}
	near := func(step, header string, got string, want int) {
		t.Helper()
		if n, err := strconv.Atoi(got); err != nil || n < want-2 || n > want+1 {
			t.Fatalf("%s: %s %q, want %d (±1s): the seconds to the next UTC midnight", step, header, got, want)
		}
	}
	for i := 1; i <= 3; i++ {
		r := ac.get("/", "X-API-Key", "alice")
		if r.status != 200 || r.header.Get("X-RateLimit-Remaining") != strconv.Itoa(3-i) ||
			r.header.Get("RateLimit-Policy") != `"daily";q=3;w=86400` {
			t.Fatalf("request %d: %d %v", i, r.status, r.header)
		}
		near("request "+strconv.Itoa(i), "X-RateLimit-Reset", r.header.Get("X-RateLimit-Reset"), toMidnight())
	}
	r := ac.get("/", "X-API-Key", "alice")
	if r.status != 429 {
		t.Fatalf("4th request: %d, want 429", r.status)
	}
	near("4th request", "Retry-After", r.header.Get("Retry-After"), toMidnight())
	st := adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=daily&key=alice", 200)
	today := time.Now().UTC().Truncate(24 * time.Hour)
	if len(st) != 1 || st[0].Count == nil || *st[0].Count != 3 || st[0].Remaining != 0 || st[0].Algorithm != "fixed_window" ||
		st[0].WindowStart != today.Format(time.RFC3339Nano) || st[0].WindowEnd != today.Add(24*time.Hour).Format(time.RFC3339Nano) {
		t.Fatalf("state: %+v, want count 3 in today's window", st)
	}
	adminJSON[[]resetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=daily&key=alice", 200)
	if r := ac.get("/", "X-API-Key", "alice"); r.status != 200 || r.header.Get("X-RateLimit-Remaining") != "2" {
		t.Fatalf("after the reset: %d %v, want 200 with 2 left", r.status, r.header)
	}
}

// TestEndToEndSlidingWindowCounter: a sliding window counter zone through Caddy admits its
// limit and then denies, with a Retry-After.
func TestEndToEndSlidingWindowCounter(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		algorithm sliding_window_counter
		limit 2
		window 1h
	}
	respond "ok"`, srv.Addr))
	if got := cs.statuses(3, "/"); got != "200 200 429" {
		t.Fatalf("got %s, want 200 200 429", got)
	}
	if ra, err := strconv.Atoi(cs.get("/").header.Get("Retry-After")); err != nil || ra < 1 || ra > 7200 {
		t.Fatalf("Retry-After %d, %v: want the wait until the estimate falls below the limit", ra, err)
	}
}
