package ratelimitredis

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func TestMaskIP(t *testing.T) {
	for _, tc := range []struct {
		v      string
		v4, v6 int
		want   string
	}{
		{"203.0.113.7", 32, 64, "203.0.113.7"},
		{"203.0.113.7", 24, 64, "203.0.113.0/24"},
		{"203.0.113.7", 1, 64, "128.0.0.0/1"},
		{"::ffff:203.0.113.7", 32, 64, "203.0.113.7"}, // IPv4-mapped: IPv4
		{"::ffff:203.0.113.7", 24, 128, "203.0.113.0/24"},
		{"2001:db8::1", 32, 64, "2001:db8::/64"},
		{"2001:db8::1", 32, 128, "2001:db8::1"},
		{"2001:db8:0:1:2:3:4:5", 32, 64, "2001:db8:0:1::/64"},
		{"2001:db8:0:1:2:3:4:5", 32, 48, "2001:db8::/48"},
		{"2001:DB8:0:0:0:0:0:1", 32, 128, "2001:db8::1"}, // canonical form
		{"fe80::1%eth0", 32, 128, "fe80::1"},             // the zone dropped
		{"fe80::1%eth0", 32, 64, "fe80::/64"},
		{"::", 32, 64, "::/64"},
		{"0.0.0.0", 32, 64, "0.0.0.0"},
		// Not IP addresses: unchanged.
		{"alice", 24, 64, "alice"},
		{"", 24, 64, ""},
		{"1", 24, 64, "1"},
		{"deadbeef", 24, 64, "deadbeef"},
		{"1.2.3", 24, 64, "1.2.3"},
		{"01.2.3.4", 24, 64, "01.2.3.4"},
		{"2001:db8::/64", 24, 64, "2001:db8::/64"},
		{"203.0.113.7:443", 24, 64, "203.0.113.7:443"},
		{"2=203.0.113.7", 24, 64, "2=203.0.113.7"},
	} {
		if got := maskIP(tc.v, tc.v4, tc.v6); got != tc.want {
			t.Errorf("maskIP(%q, %d, %d) = %q, want %q", tc.v, tc.v4, tc.v6, got, tc.want)
		}
	}
	// The default keys of IPv4 clients, and full-length IPv6 ones, cost no allocation.
	for _, v := range []string{"203.0.113.7", "2001:db8::1", "alice"} {
		if n := testing.AllocsPerRun(100, func() { maskIP(v, 32, 128) }); n != 0 {
			t.Errorf("maskIP(%q, 32, 128): %v allocations, want 0", v, n)
		}
	}
}

func TestPolicyWindow(t *testing.T) {
	for _, tc := range []struct {
		quota  int64
		window time.Duration
		q, w   int64
	}{
		{3, 6 * time.Second, 3, 6},
		{10, time.Hour, 10, 3600},
		{10, 1500 * time.Millisecond, 10, 2},                           // rounded up: never more than the rate
		{100, time.Minute - time.Nanosecond, 100, 60},                  // 100/1m as a float refill rate
		{10, 100 * time.Millisecond, 100, 1},                           // the rate per second
		{3, 700 * time.Millisecond, 4, 1},                              // rounded down
		{1, time.Millisecond, 1000, 1},                                 //
		{1_000_000, time.Millisecond, 1_000_000_000, 1},                //
		{1 << 53, time.Second, sfMaxInteger, 1},                        // an Integer has 15 digits
		{1 << 53, time.Millisecond, sfMaxInteger, 1},                   //
		{1, 0, sfMaxInteger, 1},                                        // a refill so fast the window is 0
		{999_999_999_999_999, 999 * time.Millisecond, sfMaxInteger, 1}, //
	} {
		if q, w := policyWindow(tc.quota, tc.window); q != tc.q || w != tc.w {
			t.Errorf("policyWindow(%d, %v) = q=%d;w=%d, want q=%d;w=%d", tc.quota, tc.window, q, w, tc.q, tc.w)
		}
	}
}

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

// TestMaybeIP: every IP address form passes the pre-check (so it is masked), and numeric user
// ids and hexadecimal API keys do not (so they cost no parse).
func TestMaybeIP(t *testing.T) {
	for _, c := range []struct {
		s    string
		want bool
	}{
		{"203.0.113.7", true}, {"2001:db8::1", true}, {"::1", true}, {"::ffff:203.0.113.7", true},
		{"fe80::1%eth0", true}, {"fe80::1%25", true},
		{"12345", false}, {"deadbeefcafe", false}, {"DEADBEEF", false}, {"1%x", false}, {"", false}, {"a", false},
		{"user-1", false},
	} {
		if got := maybeIP(c.s); got != c.want {
			t.Errorf("maybeIP(%q) = %v, want %v", c.s, got, c.want)
		}
		if _, err := netip.ParseAddr(c.s); err == nil && !maybeIP(c.s) {
			t.Errorf("%q parses as an address but maybeIP says no", c.s)
		}
	}
}
