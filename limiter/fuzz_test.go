package limiter

import (
	"encoding/binary"
	"strings"
	"testing"
	"time"
)

// FuzzClientKey: any bytes give a key component of at most MaxClientKeyBytes bytes without a
// brace: the input itself when it is short and of the safe alphabet, else "~" and a 43-byte
// digest (or "~empty"). "~" is outside the safe alphabet, so a verbatim key never equals a
// digest: distinct inputs give distinct components, up to SHA-256 collisions.
func FuzzClientKey(f *testing.F) {
	for _, seed := range []string{"", "203.0.113.9", "::1", "user@example.com", "}{", "{x}", "~empty", "ключ", "a\x00b", "a\r\nb", strings.Repeat("k", 65)} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		got := ClientKey(raw)
		if len(got) > MaxClientKeyBytes || strings.ContainsAny(got, "{}") {
			t.Fatalf("ClientKey(%q) = %q: too long or has a brace", raw, got)
		}
		switch {
		case raw == "":
			if got != "~empty" {
				t.Fatalf("ClientKey(\"\") = %q", got)
			}
		case len(raw) <= MaxClientKeyBytes && verbatim(raw):
			if got != raw {
				t.Fatalf("ClientKey(%q) = %q, want it verbatim", raw, got)
			}
		default:
			if len(got) != 44 || got[0] != '~' || !verbatim(got[1:]) {
				t.Fatalf("ClientKey(%q) = %q, want ~ and a 43-byte base64url digest", raw, got)
			}
		}
	})
}

// FuzzDecodeReply: any reply value (built from the fuzzer's bytes: integers, strings, nil,
// errors and nested arrays, as go-redis hands them over) gives a Decision or an error wrapping
// ErrBadResponse, never a panic; a Decision's zone index is in range.
func FuzzDecodeReply(f *testing.F) {
	// One zone, allowed: {1, 1, 9, 0, 100}.
	f.Add([]byte{0, 5, 1, 1, 1, 1, 1, 9, 1, 0, 1, 100}, uint8(0))
	// Two zones, denied by the second: {0, 1, 3, 0, 7, 0, 0, 2, 1}.
	f.Add([]byte{0, 9, 1, 0, 1, 1, 1, 3, 1, 0, 1, 7, 1, 0, 1, 0, 1, 2, 1, 1}, uint8(1))
	f.Add([]byte{3, 3, 'a', 'b', 'c'}, uint8(0)) // a string
	f.Add([]byte{4}, uint8(0))                   // nil
	reqs := []Request{
		{Zone: &Zone{Name: "a", Algorithm: TokenBucket, Capacity: 10, RefillRate: 1}, Cost: 1},
		{Zone: &Zone{Name: "b", Algorithm: SlidingWindow, Limit: 5, Window: time.Second}, Cost: 2},
		{Zone: &Zone{Name: "c", Algorithm: TokenBucket, Capacity: 1, RefillRate: 1}, Cost: 3},
	}
	f.Fuzz(func(t *testing.T, data []byte, zones uint8) {
		n := int(zones%3) + 1
		reply, _ := replyFrom(data, 0)
		allowed, zr, err := decodeReply(reply, n)
		if err != nil {
			return
		}
		d := pick(reqs[:n], allowed, zr)
		if d.Zone < 0 || d.Zone >= n || d.Allowed != allowed {
			t.Fatalf("decision %+v for %d zones from %#v", d, n, reply)
		}
	})
}

// replyFrom builds a reply value from data: a type byte, then its content. Depth is bounded.
func replyFrom(data []byte, depth int) (any, []byte) {
	if len(data) == 0 {
		return nil, data
	}
	kind, data := data[0]%6, data[1:]
	switch kind {
	case 0: // an array of data[0]%16 values
		if len(data) == 0 || depth > 3 {
			return []any{}, data
		}
		n := int(data[0] % 16)
		data = data[1:]
		arr := make([]any, n)
		for i := range arr {
			arr[i], data = replyFrom(data, depth+1)
		}
		return arr, data
	case 1: // a small integer: one signed byte
		if len(data) == 0 {
			return int64(0), data
		}
		return int64(int8(data[0])), data[1:]
	case 2: // any integer: 8 bytes, big-endian
		if len(data) < 8 {
			return int64(len(data)), nil
		}
		return int64(binary.BigEndian.Uint64(data)), data[8:]
	case 3: // a string of data[0] bytes
		if len(data) == 0 {
			return "", data
		}
		n := min(int(data[0]), len(data)-1)
		return string(data[1 : 1+n]), data[1+n:]
	case 4:
		return nil, data
	default:
		return ErrBadResponse, data // an error value inside a reply
	}
}
