package clientip

import (
	"net/netip"
	"testing"
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
		if got := Mask(tc.v, tc.v4, tc.v6); got != tc.want {
			t.Errorf("Mask(%q, %d, %d) = %q, want %q", tc.v, tc.v4, tc.v6, got, tc.want)
		}
	}
	// The default keys of IPv4 clients, and full-length IPv6 ones, cost no allocation.
	for _, v := range []string{"203.0.113.7", "2001:db8::1", "alice"} {
		if n := testing.AllocsPerRun(100, func() { Mask(v, 32, 128) }); n != 0 {
			t.Errorf("Mask(%q, 32, 128): %v allocations, want 0", v, n)
		}
	}
}

// TestMaybeIP: every IP address form passes the pre-check (so it is masked), and numeric user
// ids and hexadecimal API keys do not (so they cost no parse).
func TestMaybeIP(t *testing.T) {
	t.Parallel()
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
