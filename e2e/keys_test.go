package e2e_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func TestEndToEndHostileKeys(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
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
		cs.get("/", "X-API-Key", k).expect(t, "first", 200, "ok", "X-RateLimit-Remaining", "1")
		cs.get("/", "X-API-Key", k).expect(t, "second", 200, "ok", "X-RateLimit-Remaining", "0")
		cs.get("/", "X-API-Key", k).expect(t, "third", 429, "")
	}
	// No key header at all: every such request shares the zone's one key.
	cs.get("/").expect(t, "no key", 200, "ok", "X-RateLimit-Remaining", "1")
	cs.get("/").expect(t, "no key again", 200, "ok", "X-RateLimit-Remaining", "0")
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
		cs := startSites(t, "", site(srv.Addr))[0]
		for i := 1; i <= 3; i++ {
			xff := fmt.Sprintf("203.0.113.%d", i)
			cs.get("/", "X-Forwarded-For", xff, "X-Real-IP", xff).expect(t, "XFF "+xff, 200, "127.0.0.1", "X-RateLimit-Remaining", strconv.Itoa(3-i))
		}
		cs.get("/", "X-Forwarded-For", "203.0.113.4").expect(t, "fourth XFF", 429, "")
		if keys := redisKeys(t, srv); len(keys) != 1 || keys[0] != "rl:{127.0.0.1}:default:tb" {
			t.Fatalf("Redis keys %q, want only the peer's", keys)
		}
	})

	t.Run("trusted_proxies", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := startSites(t, "\t\ttrusted_proxies static 127.0.0.1/8", site(srv.Addr))[0]
		for i := 1; i <= 3; i++ {
			xff := fmt.Sprintf("203.0.113.%d", i)
			cs.get("/", "X-Forwarded-For", xff).expect(t, "XFF "+xff, 200, xff, "X-RateLimit-Remaining", "2")
		}
		// The first valid address wins: behind a proxy that appends, a forged first entry does.
		cs.get("/", "X-Forwarded-For", "198.51.100.7, 203.0.113.1").expect(t, "forged first entry", 200, "198.51.100.7", "X-RateLimit-Remaining", "2")
	})

	t.Run("trusted_proxies_strict", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := startSites(t, "\t\ttrusted_proxies static 127.0.0.1/8\n\t\ttrusted_proxies_strict", site(srv.Addr))[0]
		// The proxy appends the address it saw (203.0.113.1) to whatever the client sent.
		for i := 1; i <= 3; i++ {
			forged := fmt.Sprintf("198.51.100.%d", i)
			cs.get("/", "X-Forwarded-For", forged+", 203.0.113.1").expect(t, "forged "+forged, 200, "203.0.113.1", "X-RateLimit-Remaining", strconv.Itoa(3-i))
		}
		cs.get("/", "X-Forwarded-For", "198.51.100.4, 203.0.113.1").expect(t, "fourth forged entry", 429, "")
		cs.get("/", "X-Forwarded-For", "203.0.113.2").expect(t, "another client", 200, "203.0.113.2", "X-RateLimit-Remaining", "2")
		// Trusted hops on the right are skipped.
		cs.get("/", "X-Forwarded-For", "203.0.113.3, 127.0.0.5").expect(t, "through two proxies", 200, "203.0.113.3", "X-RateLimit-Remaining", "2")
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
	sites := startSites(t, "", site("rl:"), site("rl:"), site("other:"))
	a, b, c := sites[0], sites[1], sites[2]
	a.get("/").expect(t, "site A", 200, "ok", "X-RateLimit-Remaining", "3")
	b.get("/").expect(t, "site B, same zone", 200, "ok", "X-RateLimit-Remaining", "2")
	a.get("/").expect(t, "site A again", 200, "ok", "X-RateLimit-Remaining", "1")
	b.get("/").expect(t, "site B again", 200, "ok", "X-RateLimit-Remaining", "0")
	a.get("/").expect(t, "site A, spent by both", 429, "")
	b.get("/").expect(t, "site B, spent by both", 429, "")
	c.get("/").expect(t, "site C, other key_prefix", 200, "ok", "X-RateLimit-Remaining", "3")
	keys := redisKeys(t, srv)
	if len(keys) != 2 {
		t.Fatalf("Redis keys %q, want rl:{127.0.0.1}:api:tb and other:{127.0.0.1}:api:tb", keys)
	}
}
