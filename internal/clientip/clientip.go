// Package clientip masks a client's IP address to a network prefix, so that the clients of one
// network share a rate limit key. It imports nothing from Caddy.
package clientip

import "net/netip"

// Mask returns v masked to a prefix when it is an IP address, and v itself otherwise. An IPv4
// address, or an IPv4-mapped IPv6 one (::ffff:203.0.113.7, which is the same client), is masked
// to v4 bits, any other IPv6 address to v6 bits; a zone (%eth0) is dropped. A full-length prefix
// gives the address in its canonical form (203.0.113.7, 2001:db8::1), a shorter one the network
// in CIDR notation (203.0.113.0/24, 2001:db8::/64). Both forms are of the alphabet that the
// limiter's ClientKey keeps verbatim. A canonical address at full length is returned as it is,
// with no allocation. v4 is 0 to 32 bits, v6 0 to 128.
func Mask(v string, v4, v6 int) string {
	if !maybeIP(v) {
		return v
	}
	addr, err := netip.ParseAddr(v)
	if err != nil {
		return v
	}
	addr = addr.Unmap().WithZone("")
	bits := v6
	if addr.Is4() {
		bits = v4
	}
	var buf [64]byte
	var b []byte
	if bits >= addr.BitLen() {
		b = addr.AppendTo(buf[:0])
	} else {
		p, _ := addr.Prefix(bits) // cannot fail: 0 <= bits < BitLen
		b = p.AppendTo(buf[:0])
	}
	if string(b) == v {
		return v
	}
	return string(b)
}

// maybeIP reports whether s could be an IP address: not empty, of hexadecimal digits, '.', ':'
// and a zone's '%' and what follows it, with a '.' or a ':' before any '%' (every IPv4 and IPv6
// address has one). It spares the parse, and the error it allocates, of most values that are
// not: numeric user ids and hexadecimal API keys among them.
func maybeIP(s string) bool {
	if len(s) < 2 {
		return false
	}
	sep := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '.', c == ':':
			sep = true
		case '0' <= c && c <= '9', 'a' <= c && c <= 'f', 'A' <= c && c <= 'F':
		case c == '%':
			return sep // a zone may hold anything
		default:
			return false
		}
	}
	return sep
}

// Memo remembers the last value Mask masked, with its prefix lengths, so that the zones of a
// request that share a key candidate (the common case) mask it once. Its zero value is ready
// to use; it is not safe for concurrent use.
type Memo struct {
	v, masked string
	v4, v6    int
}

// Mask is Mask(v, v4, v6), from the memo when it holds the same value and lengths.
func (m *Memo) Mask(v string, v4, v6 int) string {
	if m.v != v || m.v4 != v4 || m.v6 != v6 {
		*m = Memo{v: v, masked: Mask(v, v4, v6), v4: v4, v6: v6}
	}
	return m.masked
}
