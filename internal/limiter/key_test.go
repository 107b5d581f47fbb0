package limiter_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"strings"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

func digest(s string) string {
	sum := sha256.Sum256([]byte(s))
	return base64.RawURLEncoding.EncodeToString(sum[:])
}

// TestCandidateKeys: the client key of each key candidate, and its Redis hash tag, exactly. The
// first candidate's tags are those of the releases before namespaces; an IP address as the
// second candidate and the same text as the first (an X-API-Key header) are different clients.
func TestCandidateKeys(t *testing.T) {
	long := strings.Repeat("k", 100)
	for _, tc := range []struct {
		n        int
		value    string
		key, tag string // for the first candidate, tag is what releases before namespaces gave
	}{
		{1, "203.0.113.7", "203.0.113.7", "203.0.113.7"},
		{2, "203.0.113.7", "2=203.0.113.7", "2=203.0.113.7"},
		{1, "2=203.0.113.7", "1=2=203.0.113.7", "~" + digest("2=203.0.113.7")}, // a header that mimics candidate 2
		{1, "1=alice", "1=1=alice", "~" + digest("1=alice")},
		{1, "0=x", "1=0=x", "~" + digest("0=x")},
		{1, "=x", "=x", "~" + digest("=x")},
		{1, "a=b", "a=b", "~" + digest("a=b")},
		{1, "}{", "}{", "~" + digest("}{")},
		{1, long, long, "~" + digest(long)},
		{2, long, "2=" + long, "2=~" + digest("2="+long)},
		{3, "}{", "3=}{", "3=~" + digest("3=}{")},
		{2, "::1", "2=::1", "2=::1"},
		{12, "x", "12=x", "12=x"},
		{2, strings.Repeat("a", 62), "2=" + strings.Repeat("a", 62), "2=" + strings.Repeat("a", 62)},
		{2, strings.Repeat("a", 63), "2=" + strings.Repeat("a", 63), "2=~" + digest("2="+strings.Repeat("a", 63))},
	} {
		key := limiter.CandidateKey(tc.n, tc.value)
		if key != tc.key {
			t.Errorf("CandidateKey(%d, %q) = %q, want %q", tc.n, tc.value, key, tc.key)
		}
		if n, v := limiter.ParseCandidateKey(key); n != tc.n || v != tc.value {
			t.Errorf("ParseCandidateKey(%q) = %d, %q; want %d, %q", key, n, v, tc.n, tc.value)
		}
		if tag := limiter.ClientKey(key); tag != tc.tag {
			t.Errorf("ClientKey(%q) = %q, want %q", key, tag, tc.tag)
		}
	}
	// "1=value" is the first candidate's value too: the admin API may be given either.
	if limiter.ClientKey("1=alice") != "alice" || limiter.ClientKey("1=203.0.113.7") != "203.0.113.7" {
		t.Error(`"1=value" is not the first candidate's value`)
	}
	// Numbers that CandidateKey never writes read as the first candidate's value.
	for _, raw := range []string{"02=x", "1234567890=x", "=x", "2"} {
		if n, v := limiter.ParseCandidateKey(raw); n != 1 || v != raw {
			t.Errorf("ParseCandidateKey(%q) = %d, %q; want the first candidate's value", raw, n, v)
		}
	}
}

// TestKeySecret: a keyed key is "0=" and the base64url HMAC-SHA256 of "<n>=value" under the
// secret; it is verbatim in the hash tag, differs per candidate and per secret, and the empty
// key (the zone's shared key) is not keyed.
func TestKeySecret(t *testing.T) {
	secret := []byte("a secret of 32 bytes, not more..")
	ks := limiter.NewKeySecret(secret)
	mac := func(s string) string {
		m := hmac.New(sha256.New, secret)
		m.Write([]byte(s))
		return "0=" + base64.RawURLEncoding.EncodeToString(m.Sum(nil))
	}
	for key, want := range map[string]string{
		"alice":           mac("1=alice"),
		"1=alice":         mac("1=alice"),
		"2=203.0.113.7":   mac("2=203.0.113.7"),
		"203.0.113.7":     mac("1=203.0.113.7"),
		"1=2=203.0.113.7": mac("1=2=203.0.113.7"),
	} {
		got := ks.Key(key)
		if got != want || len(got) != 45 || limiter.ClientKey(got) != got {
			t.Errorf("Key(%q) = %q, want %q, verbatim as a tag", key, got, want)
		}
	}
	if ks.Key("") != "" {
		t.Error("the shared key of all-empty candidates was keyed")
	}
	if limiter.NewKeySecret([]byte("another secret, 32 bytes long...")).Key("alice") == ks.Key("alice") {
		t.Error("two secrets give the same keyed key")
	}
}
