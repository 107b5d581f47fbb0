package e2e_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func TestEndToEndHostileKeys(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-API-Key}
		capacity 2
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr))
	huge := strings.Repeat("k", 10_000) // Caddy rejects headers over 16 kB by default (431) before any handler
	for _, k := range []string{huge, "}{", "{x}"} {
		cs.Get("/", "X-API-Key", k).Expect(t, "first", 200, "ok", "X-RateLimit-Remaining", "1")
		cs.Get("/", "X-API-Key", k).Expect(t, "second", 200, "ok", "X-RateLimit-Remaining", "0")
		cs.Get("/", "X-API-Key", k).Expect(t, "third", 429, "")
	}
	// No key header at all: every such request shares the zone's one key.
	cs.Get("/").Expect(t, "no key", 200, "ok", "X-RateLimit-Remaining", "1")
	cs.Get("/").Expect(t, "no key again", 200, "ok", "X-RateLimit-Remaining", "0")
	for _, k := range srv.Client().Keys(t.Context(), "*").Val() {
		if len(k) > 80 || strings.Count(k, "{") != 1 || strings.Count(k, "}") != 1 {
			t.Errorf("Redis key %q is unbounded or escapes its hash tag", k)
		}
	}
}

// TestAbuseForwardedFor: with {client_ip} and no trusted_proxies, X-Forwarded-For is ignored, so
// a client rotating it is still one client. With trusted_proxies, Caddy takes the client IP from
// the header when the peer is a trusted proxy: the first valid address by default, the last
// untrusted one with trusted_proxies_strict, which is what survives a proxy that appends the
// address it saw to a header the client forged.
func TestAbuseForwardedFor(t *testing.T) {
	site := func(addr string) string {
		return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		capacity 3
		refill_rate 1/1h
	}
	respond "{http.rate_limit_redis.key}"`, addr)
	}

	t.Run("no trusted_proxies", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := caddytest.StartSites(t, "", site(srv.Addr))[0]
		for i := 1; i <= 3; i++ {
			xff := fmt.Sprintf("203.0.113.%d", i)
			cs.Get("/", "X-Forwarded-For", xff, "X-Real-IP", xff).Expect(t, "XFF "+xff, 200, "127.0.0.1", "X-RateLimit-Remaining", strconv.Itoa(3-i))
		}
		cs.Get("/", "X-Forwarded-For", "203.0.113.4").Expect(t, "fourth XFF", 429, "")
		if keys := srv.Keys(t); len(keys) != 1 || keys[0] != "rl:{127.0.0.1}:default:tb" {
			t.Fatalf("Redis keys %q, want only the peer's", keys)
		}
	})

	t.Run("trusted_proxies", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := caddytest.StartSites(t, "\t\ttrusted_proxies static 127.0.0.1/8", site(srv.Addr))[0]
		for i := 1; i <= 3; i++ {
			xff := fmt.Sprintf("203.0.113.%d", i)
			cs.Get("/", "X-Forwarded-For", xff).Expect(t, "XFF "+xff, 200, xff, "X-RateLimit-Remaining", "2")
		}
		// The first valid address wins: behind a proxy that appends, a forged first entry does.
		cs.Get("/", "X-Forwarded-For", "198.51.100.7, 203.0.113.1").Expect(t, "forged first entry", 200, "198.51.100.7", "X-RateLimit-Remaining", "2")
	})

	t.Run("trusted_proxies_strict", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := caddytest.StartSites(t, "\t\ttrusted_proxies static 127.0.0.1/8\n\t\ttrusted_proxies_strict", site(srv.Addr))[0]
		// The proxy appends the address it saw (203.0.113.1) to whatever the client sent.
		for i := 1; i <= 3; i++ {
			forged := fmt.Sprintf("198.51.100.%d", i)
			cs.Get("/", "X-Forwarded-For", forged+", 203.0.113.1").Expect(t, "forged "+forged, 200, "203.0.113.1", "X-RateLimit-Remaining", strconv.Itoa(3-i))
		}
		cs.Get("/", "X-Forwarded-For", "198.51.100.4, 203.0.113.1").Expect(t, "fourth forged entry", 429, "")
		cs.Get("/", "X-Forwarded-For", "203.0.113.2").Expect(t, "another client", 200, "203.0.113.2", "X-RateLimit-Remaining", "2")
		// Trusted hops on the right are skipped.
		cs.Get("/", "X-Forwarded-For", "203.0.113.3, 127.0.0.5").Expect(t, "through two proxies", 200, "203.0.113.3", "X-RateLimit-Remaining", "2")
	})
}

// TestAbuseZoneSharedAcrossSites: two handlers (two sites) with a zone of the same name, the same
// key_prefix and the same Redis share the zone's state, because the Redis key is
// `<prefix>{client}:<zone>:<tb|sw>`; another key_prefix separates them.
func TestAbuseZoneSharedAcrossSites(t *testing.T) {
	srv := redistest.Start(t)
	site := func(prefix string) string {
		return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key_prefix %s
		zone api {
			capacity 4
			refill_rate 1/1h
		}
	}
	respond "ok"`, srv.Addr, prefix)
	}
	sites := caddytest.StartSites(t, "", site("rl:"), site("rl:"), site("other:"))
	a, b, c := sites[0], sites[1], sites[2]
	a.Get("/").Expect(t, "site A", 200, "ok", "X-RateLimit-Remaining", "3")
	b.Get("/").Expect(t, "site B, same zone", 200, "ok", "X-RateLimit-Remaining", "2")
	a.Get("/").Expect(t, "site A again", 200, "ok", "X-RateLimit-Remaining", "1")
	b.Get("/").Expect(t, "site B again", 200, "ok", "X-RateLimit-Remaining", "0")
	a.Get("/").Expect(t, "site A, spent by both", 429, "")
	b.Get("/").Expect(t, "site B, spent by both", 429, "")
	c.Get("/").Expect(t, "site C, other key_prefix", 200, "ok", "X-RateLimit-Remaining", "3")
	keys := srv.Keys(t)
	if len(keys) != 2 {
		t.Fatalf("Redis keys %q, want rl:{127.0.0.1}:api:tb and other:{127.0.0.1}:api:tb", keys)
	}
}
