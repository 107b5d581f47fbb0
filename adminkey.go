package ratelimitredis

import (
	"fmt"
	"net/netip"
	"strings"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/clientip"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// ipPlaceholders are the key placeholders whose value is the client's IP address.
var ipPlaceholders = map[string]bool{
	"http.vars.client_ip":      true,
	"http.request.remote.host": true,
}

// ipCandidate reports whether the zone's key candidate k (expanded) is the client's IP address.
func ipCandidate(k string) bool { return ipPlaceholders[singlePlaceholder(k)] }

// adminKey maps a client key given to the admin API, as {http.rate_limit_redis.key} shows it,
// to the key a request of that client has in zone z. A value that is an IP address is masked
// to the zone's prefix lengths, as resolve masks a request's. For a candidate that is the
// client's IP address, a network in CIDR notation is masked too (::1/128 is ::/64 in a zone of
// ipv6_prefix 64). The error is for a key that no request can have: a candidate number above
// the zone's number of candidates, or a network wider than the zone's prefix. warning is not empty when a value of the first candidate,
// given without "1=", is an IP address while the zone's IP address is another candidate.
func (z *Zone) adminKey(given string) (key, warning string, err error) {
	n, v := limiter.ParseCandidateKey(given)
	if n > len(z.Key) {
		return "", "", fmt.Errorf("key: zone %s has %d key candidate(s): no request's key is of candidate %d", z.Name, len(z.Key), n)
	}
	k := z.Key[n-1]
	if !ipCandidate(k) {
		if n == 1 && v == given && isIPOrNetwork(v) { // not written 1=…: the operator may have meant the IP
			for i, other := range z.Key[1:] {
				if ipCandidate(other) {
					warning = fmt.Sprintf("key %s is taken as zone %s's first key candidate (%s), not as its IP address (candidate %d, %s): give %d=%s for that",
						v, z.Name, k, i+2, other, i+2, v)
					break
				}
			}
		}
		return limiter.CandidateKey(n, clientip.Mask(v, z.v4, z.v6)), warning, nil
	}
	if p, err := netip.ParsePrefix(v); err == nil {
		addr, bits := p.Addr(), p.Bits()
		if addr.Is4In6() {
			addr, bits = addr.Unmap(), bits-96
		}
		zoneBits := z.v6
		if addr.Is4() {
			zoneBits = z.v4
		}
		if bits < zoneBits {
			return "", "", fmt.Errorf("key: %s is a network of /%d bits, and zone %s keys these addresses by their /%d: no request's key is a wider network", v, bits, z.Name, zoneBits)
		}
		return limiter.CandidateKey(n, clientip.Mask(addr.String(), z.v4, z.v6)), "", nil
	}
	return limiter.CandidateKey(n, clientip.Mask(v, z.v4, z.v6)), "", nil
}

// isIPOrNetwork reports whether v is an IP address or a network in CIDR notation.
func isIPOrNetwork(v string) bool {
	if strings.Contains(v, "/") {
		_, err := netip.ParsePrefix(v)
		return err == nil
	}
	_, err := netip.ParseAddr(v)
	return err == nil
}
