package limiter

import (
	"crypto/sha256"
	"encoding/base64"
	"strings"
)

// MaxClientKeyBytes is the longest client key used verbatim in a Redis key.
const MaxClientKeyBytes = 64

// emptyClientKey stands for a request whose key candidates were all empty: all such requests of a
// zone share one key. It begins with a byte that no verbatim key has, and is shorter than any
// digest, so it can equal neither.
const emptyClientKey = "~empty"

// ClientKey returns the form of a client key that goes inside a Redis key's hash tag. A key of at
// most MaxClientKeyBytes bytes of [A-Za-z0-9._:@/-] is used verbatim; any other is replaced by
// "~" and the unpadded base64url SHA-256 of its bytes (44 bytes in all), so a hostile key can
// neither grow a Redis key without bound nor escape its hash tag with a brace. The empty key
// becomes "~empty". Distinct keys give distinct results, up to SHA-256 collisions.
func ClientKey(raw string) string {
	if raw == "" {
		return emptyClientKey
	}
	if len(raw) <= MaxClientKeyBytes && verbatim(raw) {
		return raw
	}
	sum := sha256.Sum256([]byte(raw))
	return "~" + base64.RawURLEncoding.EncodeToString(sum[:])
}

func verbatim(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case c == '.', c == '_', c == ':', c == '@', c == '/', c == '-':
		default:
			return false
		}
	}
	return true
}

// StateKey returns the Redis key holding zone z's state for a client:
// `<prefix>{<ClientKey(rawClientKey)>}:<zone name>:<tb|sw>`. The client key is the Redis Cluster
// hash tag, so all zones of one client share a slot.
func StateKey(prefix string, z *Zone, rawClientKey string) string {
	ck := ClientKey(rawClientKey)
	var b strings.Builder
	b.Grow(len(prefix) + len(ck) + len(z.Name) + 6)
	b.WriteString(prefix)
	b.WriteByte('{')
	b.WriteString(ck)
	b.WriteString("}:")
	b.WriteString(z.Name)
	b.WriteByte(':')
	b.WriteString(z.Algorithm.tag())
	return b.String()
}
