package ratelimitredis

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestIPPrefixKeys (issue 19.1), end to end through Caddy behind a trusted proxy: IPv6 clients
// are keyed by their /64 by default, so addresses of one /64 share a bucket (capacity 2: 200
// 200 429) and another /64 has its own; ipv6_prefix 128 separates addresses again; a zone's
// prefix overrides the handler's; ipv4_prefix groups IPv4 clients (IPv4-mapped addresses
// included), whose default is the address itself. The key placeholder shows the prefix.
func TestIPPrefixKeys(t *testing.T) {
	srv := redistest.Start(t)
	site := func(options, zone string) string {
		return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		%s
		zone %s {
			key {http.request.header.X-User} {client_ip}
			capacity 2
			refill_rate 1/1h
		}
	}
	respond "{http.rate_limit_redis.key}"`, srv.Addr, options, zone)
	}
	sites := startSites(t, "\t\ttrusted_proxies static 127.0.0.1/32",
		site("", "dflt"),
		site("ipv6_prefix 128\n\t\tipv4_prefix 24", "full"),
		strings.Replace(site("ipv6_prefix 128", "wide"), "capacity 2", "ipv6_prefix 48\n\t\t\tcapacity 2", 1),
	)
	type step struct {
		xff, user string
		status    int
		key       string // the placeholder, when admitted
	}
	run := func(cs *caddyServer, name string, steps []step) {
		t.Helper()
		for i, s := range steps {
			r := cs.get("/", "X-Forwarded-For", s.xff, "X-User", s.user)
			if r.status != s.status || (s.status == 200 && r.body != s.key) {
				t.Fatalf("%s step %d (%s %s): %d %q, want %d %q", name, i, s.xff, s.user, r.status, r.body, s.status, s.key)
			}
		}
	}
	// The default: IPv6 by /64, IPv4 by address; a value that is not an IP is as it is.
	run(sites[0], "default", []step{
		{xff: "2001:db8::1", status: 200, key: "2=2001:db8::/64"},
		{xff: "2001:db8::2", status: 200, key: "2=2001:db8::/64"},
		{xff: "2001:db8::3", status: 429},
		{xff: "2001:db8:0:1::1", status: 200, key: "2=2001:db8:0:1::/64"},
		{xff: "203.0.113.1", status: 200, key: "2=203.0.113.1"},
		{xff: "203.0.113.2", status: 200, key: "2=203.0.113.2"},
		{xff: "203.0.113.1", status: 200, key: "2=203.0.113.1"},
		{xff: "203.0.113.1", status: 429},
		{xff: "::ffff:203.0.113.2", status: 200, key: "2=203.0.113.2"}, // IPv4-mapped: the same client
		{xff: "203.0.113.2", status: 429},
		{xff: "2001:db8::9", user: "alice", status: 200, key: "alice"},
		{xff: "2001:db8::9", user: "2001:db8:0:7::1", status: 200, key: "2001:db8:0:7::/64"}, // any candidate that is an IP
	})
	// ipv6_prefix 128: one bucket per address again; ipv4_prefix 24: per /24.
	run(sites[1], "ipv6_prefix 128, ipv4_prefix 24", []step{
		{xff: "2001:db8::1", status: 200, key: "2=2001:db8::1"},
		{xff: "2001:db8::2", status: 200, key: "2=2001:db8::2"},
		{xff: "2001:db8::3", status: 200, key: "2=2001:db8::3"},
		{xff: "2001:db8::1", status: 200, key: "2=2001:db8::1"},
		{xff: "2001:db8::1", status: 429},
		{xff: "198.51.100.1", status: 200, key: "2=198.51.100.0/24"},
		{xff: "198.51.100.2", status: 200, key: "2=198.51.100.0/24"},
		{xff: "198.51.100.3", status: 429},
		{xff: "::ffff:198.51.100.4", status: 429},
		{xff: "198.51.101.1", status: 200, key: "2=198.51.101.0/24"},
	})
	// The zone's ipv6_prefix 48 overrides the handler's 128.
	run(sites[2], "zone ipv6_prefix 48", []step{
		{xff: "2001:db8:0:1::1", status: 200, key: "2=2001:db8::/48"},
		{xff: "2001:db8:0:2::1", status: 200, key: "2=2001:db8::/48"},
		{xff: "2001:db8:0:ffff::1", status: 429},
		{xff: "2001:db9::1", status: 200, key: "2=2001:db9::/48"},
	})
	keys := redisKeys(t, srv)
	for _, want := range []string{"rl:{2=2001:db8::/64}:dflt:tb", "rl:{2=198.51.100.0/24}:full:tb", "rl:{2=2001:db8::/48}:wide:tb"} {
		if !slices.Contains(keys, want) {
			t.Errorf("Redis key %s missing: %q", want, keys)
		}
	}
}

// TestNAT64Keys (issue 29, docs/security.md): behind a NAT64/SIIT translator IPv4 clients are
// seen as 64:ff9b::<IPv4>. By default they all share the /64 64:ff9b::/64 (capacity 2: two
// IPv4 clients spend it for every other). docs/security.md's two ways key them by /96+32, each
// IPv4 client on its own, while native IPv6 clients stay keyed by /64: a map whose output every
// zone keys on, or two zones split by the client_ip matcher, ipv6_prefix 128 in the NAT64 one.
func TestNAT64Keys(t *testing.T) {
	srv := redistest.Start(t)
	const respond = `
	respond "{http.rate_limit_redis.zone} {http.rate_limit_redis.key}"`
	single := fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key_prefix nat64single:
		zone ip {
			key {client_ip}
			capacity 2
			refill_rate 1/1h
		}
	}`, srv.Addr) + respond
	mapped := fmt.Sprintf(`
	map {client_ip} {rl_client} {
		~^64:ff9b::((?:[0-9a-f]{1,4}:)?[0-9a-f]{1,4})$ "nat64-${1}"
		default {client_ip}
	}
	rate_limit_redis {
		redis {
			address %s
		}
		key_prefix nat64map:
		zone ip {
			key {rl_client}
			capacity 2
			refill_rate 1/1h
		}
	}`, srv.Addr) + respond
	split := fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key_prefix nat64split:
		zone ip {
			match not client_ip 64:ff9b::/96
			key {client_ip}
			capacity 2
			refill_rate 1/1h
		}
		zone ip_nat64 {
			match client_ip 64:ff9b::/96
			key {client_ip}
			ipv6_prefix 128
			capacity 2
			refill_rate 1/1h
		}
	}`, srv.Addr) + respond
	sites := startSites(t, "\t\ttrusted_proxies static 127.0.0.1/32", single, mapped, split)
	statuses := func(cs *caddyServer, xff ...string) string {
		var got []string
		for _, x := range xff {
			got = append(got, strconv.Itoa(cs.get("/", "X-Forwarded-For", x).status))
		}
		return strings.Join(got, " ")
	}
	// 192.0.2.1 and 198.51.100.7 through the translator.
	a, b := "64:ff9b::192.0.2.1", "64:ff9b::198.51.100.7"
	if got := statuses(sites[0], a, a, b); got != "200 200 429" {
		t.Fatalf("one zone, default ipv6_prefix: %s; want 200 200 429 (both IPv4 clients in 64:ff9b::/64)", got)
	}
	for i, want := range []string{"ip nat64-c000:201", "ip_nat64 64:ff9b::c000:201"} {
		cs := sites[1+i]
		cs.get("/", "X-Forwarded-For", a).expect(t, "nat64 "+want, 200, want)
		if got := statuses(cs, a, a, b, b, b); got != "200 429 200 200 429" {
			t.Fatalf("%s: %s; want 200 429 200 200 429 (a bucket per IPv4 client)", want, got)
		}
		cs.get("/", "X-Forwarded-For", "2001:db8::1").expect(t, "native IPv6", 200, "ip 2001:db8::/64")
		// 64:ff9b::1:0:0:1 is in 64:ff9b::/64 but not the /96: keyed as any IPv6 client.
		if got := statuses(cs, "2001:db8::2", "2001:db8::3", "64:ff9b::1:0:0:1", "64:ff9b::1:0:0:2", "64:ff9b::1:0:0:3"); got != "200 429 200 200 429" {
			t.Fatalf("native IPv6 (%s): %s; want 200 429 200 200 429 (one bucket per /64)", want, got)
		}
	}
}
