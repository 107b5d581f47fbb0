package limiter

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"hash"
	"strconv"
	"strings"
	"sync"
)

// maxClientKeyBytes is the longest client key used verbatim in a Redis key.
const maxClientKeyBytes = 64

// emptyClientKey stands for a request whose key candidates were all empty: all such requests of a
// zone share one key. It begins with a byte that no verbatim key has, and is shorter than any
// digest, so it can equal neither.
const emptyClientKey = "~empty"

// Client keys carry the key candidate that produced them.
//
// A zone's key is a list of candidates (an API key header, then the client IP, ...): the first
// that is not empty wins. Were the winning value used alone, the values of different candidates
// would share one key space, and a client could name another candidate's bucket: an X-API-Key
// header of "203.0.113.7" would spend, and read, the budget of the client at 203.0.113.7. So the
// client key (Request.Key, the {http.rate_limit_redis.key} placeholder, the admin API's key) is
// the pair (candidate, value), written by CandidateKey:
//
//	value          the first candidate, when value does not begin with digits and "="
//	<n>=value      candidate n (counted from 1), and the first candidate when value does
//
// and ClientKey gives the part of the Redis key that identifies the client (the hash tag):
//
//	first candidate:  value verbatim when it is at most maxClientKeyBytes bytes of
//	                  [A-Za-z0-9._:@/-], else "~" and its base64url SHA-256
//	candidate n ≥ 2:  "<n>=" and the value the same way, the digest taken of "<n>=value"
//	all empty:        "~empty"
//	keyed (0=):       "0=" and a base64url HMAC-SHA256 (KeySecret, the handler's key_secret)
//
// The first candidate's keys are exactly those of the releases without namespaces, so the common
// `key {client_ip}` (or any single-candidate zone) keeps its buckets across the upgrade; the
// buckets of the other candidates start afresh. The namespaces cannot meet: no first-candidate
// tag holds "=" (neither the safe alphabet nor base64url has it), and every other tag begins
// with its candidate's number (canonical, at most maxCandidateDigits digits) and "=". Within one
// namespace a verbatim value never begins with "~", so it never equals a digest. Every tag is at
// most maxClientKeyBytes bytes, and none holds a brace, so none can leave its hash tag.

// maxCandidateDigits bounds the candidate number in a client key, so that a digested tag
// ("<n>=~" and 43 bytes) stays within maxClientKeyBytes.
const maxCandidateDigits = 9

// KeyedCandidate is the candidate number of keyed client keys (KeySecret): no key candidate of
// a zone has it.
const KeyedCandidate = 0

// CandidateKey returns the client key of a request whose first non-empty key candidate is the
// n-th (counting from 1, at most 999,999,999) with value: value itself for the first candidate,
// unless value begins with digits and "=" (which would read as a candidate number), else
// "<n>=" and value. ParseCandidateKey inverts it.
func CandidateKey(n int, value string) string {
	if n < 1 || n > 999_999_999 {
		panic("limiter: key candidate number out of range: " + strconv.Itoa(n))
	}
	if n == 1 && !numbered(value) {
		return value
	}
	return strconv.Itoa(n) + "=" + value
}

// ParseCandidateKey returns the candidate number and value of a client key: n and value of
// "<n>=value" when n is a canonical decimal of at most 9 digits, else 1 and the key itself. It
// inverts CandidateKey; "1=value" and value (not numbered) are the same client. n is
// KeyedCandidate for a keyed key.
func ParseCandidateKey(key string) (n int, value string) {
	i := 0
	for i < len(key) && i <= maxCandidateDigits && '0' <= key[i] && key[i] <= '9' {
		i++
	}
	if i == 0 || i > maxCandidateDigits || i == len(key) || key[i] != '=' || (key[0] == '0' && i > 1) {
		return 1, key
	}
	n, _ = strconv.Atoi(key[:i]) // at most 9 digits: cannot fail
	return n, key[i+1:]
}

// numbered reports whether s begins with one or more digits followed by "=".
func numbered(s string) bool {
	i := 0
	for i < len(s) && '0' <= s[i] && s[i] <= '9' {
		i++
	}
	return i > 0 && i < len(s) && s[i] == '='
}

// ClientKey returns the form of a client key (as CandidateKey writes it) that goes inside a Redis
// key's hash tag; see the namespaces above. For the first candidate: a value of at most 64
// bytes (maxClientKeyBytes) of [A-Za-z0-9._:@/-] is used verbatim; any other is replaced by "~" and
// the unpadded base64url SHA-256 of its bytes (44 bytes in all), so a hostile key can neither
// grow a Redis key without bound nor escape its hash tag with a brace. The empty key becomes
// "~empty". For candidate n ≠ 1 the same, behind "<n>=", the digest taken of "<n>=value".
// Distinct (candidate, value) pairs give distinct results, up to SHA-256 collisions; a key
// already in this form (verbatim) is returned as it is, with no allocation.
func ClientKey(raw string) string {
	if raw == "" {
		return emptyClientKey
	}
	n, v := ParseCandidateKey(raw)
	if n == 1 {
		if len(v) <= maxClientKeyBytes && verbatim(v) {
			return v
		}
		sum := sha256.Sum256([]byte(v))
		return "~" + base64.RawURLEncoding.EncodeToString(sum[:])
	}
	// raw is "<n>=" and v, n canonical.
	if len(raw) <= maxClientKeyBytes && verbatim(v) {
		return raw
	}
	sum := sha256.Sum256([]byte(raw))
	ns := raw[:len(raw)-len(v)]
	return ns + "~" + base64.RawURLEncoding.EncodeToString(sum[:])
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

// MinKeySecretBytes is the shortest secret NewKeySecret accepts.
const MinKeySecretBytes = 16

// KeySecret replaces client keys by keyed digests under a per-deployment secret. Without it, a
// client that chooses its key (an API key header) chooses its Redis Cluster hash slot too: CRC16
// is easy to invert, so it can aim all its new keys at one slot, and one primary. Under a secret
// it knows nothing of the slot; and raw keys (IP addresses, API keys) are no longer Redis key
// names. Safe for concurrent use.
type KeySecret struct {
	macs sync.Pool // of hash.Hash: HMAC-SHA256 under the secret
}

// NewKeySecret returns a KeySecret for secret, which must be at least MinKeySecretBytes long (the
// caller checks: its error must not show the secret). The secret is copied.
func NewKeySecret(secret []byte) *KeySecret {
	secret = append([]byte(nil), secret...)
	return &KeySecret{macs: sync.Pool{New: func() any { return hmac.New(sha256.New, secret) }}}
}

// Key returns the keyed client key standing for key (a client key as CandidateKey writes it):
// "0=" and the unpadded base64url HMAC-SHA256, under the secret, of its candidate number and
// value as "<n>=value" (so value and "1=value" are one client): 45 bytes, which ClientKey uses
// verbatim. The empty key (all candidates empty: the zone's shared key, no client's) stays "".
func (s *KeySecret) Key(key string) string {
	if key == "" {
		return ""
	}
	n, v := ParseCandidateKey(key)
	mac := s.macs.Get().(hash.Hash)
	mac.Reset()
	var buf [96]byte
	b := strconv.AppendInt(buf[:0], int64(n), 10)
	b = append(b, '=')
	b = append(b, v...)
	mac.Write(b)
	var sum [sha256.Size]byte
	out := mac.Sum(sum[:0])
	s.macs.Put(mac)
	const prefix = "0="
	var dst [len(prefix) + 43]byte
	copy(dst[:], prefix)
	base64.RawURLEncoding.Encode(dst[len(prefix):], out)
	return string(dst[:])
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

// OverrideKey returns the Redis key holding a client's override of zone z's numbers (a hash of
// the numbers' names: see SetOverride): `<prefix>{<ClientKey(rawClientKey)>}:<zone name>:ov`,
// in the hash slot of the client's state.
func OverrideKey(prefix string, z *Zone, rawClientKey string) string {
	return prefix + "{" + ClientKey(rawClientKey) + "}:" + z.Name + ":ov"
}

// zoneClient is a zone, by its name, and a client, as ClientKey gives it: what the deny cache
// and the lease grants are kept by. A comparable struct, built with no allocation for a verbatim
// key.
type zoneClient struct {
	zone   string
	client string
}

// zoneClientOf returns r's zone and client.
func zoneClientOf(r Request) zoneClient {
	return zoneClient{zone: r.Zone.Name, client: ClientKey(r.Key)}
}
