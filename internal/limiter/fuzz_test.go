package limiter

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// FuzzClientKey: any bytes give a key component of at most maxClientKeyBytes bytes without a
// brace, and client keys of different candidates never meet. A first-candidate key is the input
// itself when it is short and of the safe alphabet, else "~" and a 43-byte digest (or "~empty"),
// as before candidates had namespaces; a key of candidate n is "<n>=" and the same. Every pair
// (candidate, value) gives its own component: CandidateKey and ParseCandidateKey invert each
// other, no first-candidate component holds "=", every other begins with its number and "=",
// and digests differ unless SHA-256 collides. Keyed keys (KeySecret) are "0=" and 43 bytes,
// distinct per pair and per secret. In the Redis key, the component is the whole hash tag: Redis
// hashes exactly it, whatever the input. Seeds: testdata/fuzz/FuzzClientKey.
func FuzzClientKey(f *testing.F) {
	zone := &Zone{Name: "z", Algorithm: TokenBucket}
	secretA := NewKeySecret([]byte("0123456789abcdef-secret-A"))
	secretB := NewKeySecret([]byte("0123456789abcdef-secret-B"))
	f.Fuzz(func(t *testing.T, raw, other string) {
		got := ClientKey(raw)
		if len(got) > maxClientKeyBytes || strings.ContainsAny(got, "{}") {
			t.Fatalf("ClientKey(%q) = %q: too long or has a brace", raw, got)
		}
		n, v := ParseCandidateKey(raw)
		switch {
		case raw == "":
			if got != "~empty" {
				t.Fatalf("ClientKey(\"\") = %q", got)
			}
		case n == 1 && len(v) <= maxClientKeyBytes && verbatim(v):
			if got != v {
				t.Fatalf("ClientKey(%q) = %q, want %q verbatim", raw, got, v)
			}
		case n == 1:
			if len(got) != 44 || got[0] != '~' || !verbatim(got[1:]) {
				t.Fatalf("ClientKey(%q) = %q, want ~ and a 43-byte base64url digest", raw, got)
			}
		default:
			ns := strconv.Itoa(n) + "="
			rest, ok := strings.CutPrefix(got, ns)
			if !ok || (rest != v && (len(rest) != 44 || rest[0] != '~' || !verbatim(rest[1:]))) || (rest == v && !verbatim(v)) {
				t.Fatalf("ClientKey(%q) = %q, want %q and the value verbatim or ~ and a 43-byte digest", raw, got, ns)
			}
		}
		if n == 1 && strings.Contains(got, "=") {
			t.Fatalf("ClientKey(%q) = %q: a first-candidate key holds =", raw, got)
		}
		// "<n>=" with n canonical (no leading zero) and at most 9 digits is candidate n; anything
		// else is the first candidate's value as it is.
		wantN, wantV := 1, raw
		if digits, rest, ok := strings.Cut(raw, "="); ok && digits != "" && len(digits) <= 9 &&
			strings.Trim(digits, "0123456789") == "" && (digits == "0" || digits[0] != '0') {
			wantN, _ = strconv.Atoi(digits)
			wantV = rest
		}
		if n != wantN || v != wantV {
			t.Fatalf("ParseCandidateKey(%q) = %d, %q; want %d, %q", raw, n, v, wantN, wantV)
		}

		// Pairs: the same value under candidates 1, 2 and 10, and other under candidate 1 and 2.
		type pair struct {
			n int
			v string
		}
		pairs := []pair{{1, raw}, {2, raw}, {10, raw}, {1, other}, {2, other}}
		tags := map[string]pair{}
		keyed := map[string]pair{}
		for _, p := range pairs {
			key := CandidateKey(p.n, p.v)
			if pn, pv := ParseCandidateKey(key); pn != p.n || pv != p.v {
				t.Fatalf("ParseCandidateKey(CandidateKey(%d, %q) = %q) = %d, %q", p.n, p.v, key, pn, pv)
			}
			tag := ClientKey(key)
			if len(tag) > maxClientKeyBytes || strings.ContainsAny(tag, "{}") {
				t.Fatalf("ClientKey(%q) = %q: too long or has a brace", key, tag)
			}
			if q, dup := tags[tag]; dup && q != p {
				t.Fatalf("candidate %d %q and candidate %d %q share the client key %q", q.n, q.v, p.n, p.v, tag)
			}
			tags[tag] = p
			k := secretA.Key(key)
			if p.n == 1 && p.v == "" {
				if k != "" {
					t.Fatalf("the shared key of all-empty candidates was keyed: %q", k)
				}
				continue
			}
			if len(k) != 45 || !strings.HasPrefix(k, "0=") || !verbatim(k[2:]) || ClientKey(k) != k {
				t.Fatalf("keyed key of %q = %q, want 0= and 43 bytes of base64url, verbatim", key, k)
			}
			if q, dup := keyed[k]; dup && q != p {
				t.Fatalf("candidate %d %q and candidate %d %q share the keyed key %q", q.n, q.v, p.n, p.v, k)
			}
			keyed[k] = p
			if _, dup := tags[k]; dup {
				t.Fatalf("keyed key %q equals an unkeyed one", k)
			}
			if secretB.Key(key) == k {
				t.Fatalf("two secrets give %q the same keyed key", key)
			}
		}

		// Redis Cluster hashes the bytes between the first { and the first } after it.
		key := StateKey("rl:", zone, raw)
		open := strings.IndexByte(key, '{')
		end := strings.IndexByte(key[open+1:], '}')
		if strings.Count(key, "{") != 1 || strings.Count(key, "}") != 1 || key[open+1:open+1+end] != got {
			t.Fatalf("StateKey for %q = %q: its hash tag is not exactly %q", raw, key, got)
		}
	})
}

// FuzzAllow: any valid zone and any cost, decided by a real redis-server, give a Decision and
// never an error: every number the script computes fits its reply. A cost above the quota is
// denied as unsatisfiable, and nothing is ever negative or above the quota; a token bucket with
// a max_wait (decisions of one key build up its debt) holds an admitted request at most that
// long, and only then. Seeds: testdata/fuzz/FuzzAllow.
func FuzzAllow(f *testing.F) {
	srv := redistest.Start(f)
	l := New(srv.Client(), Options{KeyPrefix: "rl:"})
	f.Fuzz(func(t *testing.T, sliding bool, quota int64, rate float64, windowMicros, cost int64, key string, maxWaitMicros int64) {
		z := &Zone{Name: "z", Algorithm: TokenBucket, Capacity: quota, RefillRate: rate, MaxWait: time.Duration(maxWaitMicros) * time.Microsecond}
		if sliding {
			// One sorted set entry per admitted slot: keep a fuzzer's window small.
			z = &Zone{Name: "z", Algorithm: SlidingWindow, Limit: quota % 10_000, Window: time.Duration(windowMicros) * time.Microsecond}
		}
		if z.Validate() != nil || cost < 1 {
			return
		}
		d, err := l.Allow(t.Context(), []Request{{Zone: z, Key: key, Cost: cost}})
		if err != nil {
			t.Fatalf("zone %+v, cost %d: %v", z, cost, err)
		}
		if d.Remaining < 0 || d.Remaining > z.Quota() || d.RetryAfter < 0 || d.Reset < 0 ||
			(cost > z.Quota()) != d.Unsatisfiable || (d.Allowed && d.Unsatisfiable) ||
			d.Delay < 0 || d.Delay > z.MaxWait || (d.Delay > 0 && !d.Allowed) {
			t.Fatalf("zone %+v, cost %d: decision %+v", z, cost, d)
		}
	})
}

// FuzzDecodeReply: any bytes a Redis server sends as the decide script's reply, read by a real
// go-redis client into the values go-redis makes of them (RESP2 and RESP3 types: errors,
// integers, strings, nil, doubles, booleans, big numbers, arrays, maps, sets, attributes,
// pushes), give Allow a Decision or an error, never a panic and never a hang, on both
// production paths: the Batcher and a plain round trip. A Decision's fields are in range.
//
// The "server" is the other end of a net.Pipe that refuses HELLO (so the client speaks RESP2,
// as garbageRedis in the root package does), answers the script command with the fuzzer's
// bytes and hangs up, so that a truncated reply ends in EOF. Zone a has a max_wait of 1s: a
// reply that admits with a delay is a decision only up to it. Inputs declaring a length above
// maxFuzzLength are skipped: go-redis allocates whatever length a reply declares
// (redis/go-redis#3856), and a huge one is a fatal out-of-memory that no Go code can recover;
// docs/limits.md, "Redis is trusted". Seeds: testdata/fuzz/FuzzDecodeReply.
func FuzzDecodeReply(f *testing.F) {
	reqs := []Request{
		{Zone: &Zone{Name: "a", Algorithm: TokenBucket, Capacity: 10, RefillRate: 1, MaxWait: time.Second}, Key: "k", Cost: 1},
		{Zone: &Zone{Name: "b", Algorithm: SlidingWindow, Limit: 5, Window: time.Second}, Key: "k", Cost: 2},
		{Zone: &Zone{Name: "c", Algorithm: TokenBucket, Capacity: 1, RefillRate: 1}, Key: "k", Cost: 3},
	}
	// One client for all inputs; each decision dials afresh.
	var reply atomic.Pointer[[]byte]
	rdb := replyingClient(&reply)
	defer rdb.Close()
	pipeline := NewBatcher(rdb, 1)
	defer pipeline.Close()
	paths := []struct {
		name string
		l    *Limiter
	}{
		{"pipeline", New(rdb, Options{KeyPrefix: "rl:", Batcher: pipeline})},
		{"round trip", New(rdb, Options{KeyPrefix: "rl:"})},
	}
	f.Fuzz(func(t *testing.T, data []byte, zones uint8) {
		if declaresLength(data, maxFuzzLength) {
			return
		}
		n := int(zones%3) + 1
		reply.Store(&data)
		for _, path := range paths {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			d, err := path.l.Allow(ctx, reqs[:n])
			hung := ctx.Err() != nil
			cancel()
			if hung {
				t.Fatalf("%s: Allow hung on reply %q: %v", path.name, data, err)
			}
			if err != nil {
				if d != (Decision{}) {
					t.Fatalf("%s: error %v with a non-zero Decision %+v", path.name, err, d)
				}
				continue
			}
			if d.Zone < 0 || d.Zone >= n || d.Limit != reqs[d.Zone].Zone.Quota() || d.Remaining < 0 ||
				d.RetryAfter < 0 || d.Reset < 0 || (d.Allowed && (d.RetryAfter != 0 || d.Unsatisfiable)) || d.Cached ||
				d.Delay < 0 || d.Delay > reqs[d.Zone].Zone.MaxWait || (d.Delay > 0 && !d.Allowed) {
				t.Fatalf("%s: decision %+v for %d zones from reply %q", path.name, d, n, data)
			}
		}
	})
}

// TestReplyingClient: the fuzz harness delivers its reply, once per decision, on both paths.
func TestReplyingClient(t *testing.T) {
	var reply atomic.Pointer[[]byte]
	rdb := replyingClient(&reply)
	defer rdb.Close()
	pipeline := NewBatcher(rdb, 1)
	defer pipeline.Close()
	reqs := []Request{
		{Zone: &Zone{Name: "a", Algorithm: TokenBucket, Capacity: 10, RefillRate: 1, MaxWait: time.Second}, Key: "k", Cost: 1},
		{Zone: &Zone{Name: "b", Algorithm: SlidingWindow, Limit: 5, Window: time.Second}, Key: "k", Cost: 2},
	}
	for _, tc := range []struct {
		reply string
		want  Decision
	}{
		{"*11\r\n:1\r\n:1\r\n:9\r\n:0\r\n:1000000\r\n:1000000\r\n:1\r\n:1\r\n:0\r\n:1000000\r\n:400000\r\n",
			Decision{Allowed: true, Zone: 1, Limit: 5, Remaining: 1, Reset: time.Second, Next: 400 * time.Millisecond}},
		{"*11\r\n:0\r\n:1\r\n:9\r\n:0\r\n:1000000\r\n:1000000\r\n:0\r\n:0\r\n:250000\r\n:1000000\r\n:250000\r\n",
			Decision{Zone: 1, Limit: 5, RetryAfter: 250 * time.Millisecond, Reset: time.Second, Next: 250 * time.Millisecond}},
		{"*11\r\n:1\r\n:1\r\n:0\r\n:500000\r\n:10500000\r\n:1500000\r\n:1\r\n:1\r\n:0\r\n:1000000\r\n:400000\r\n",
			Decision{Allowed: true, Delay: 500 * time.Millisecond, Zone: 0, Limit: 10, Reset: 10500 * time.Millisecond, Next: 1500 * time.Millisecond}},
	} {
		b := []byte(tc.reply)
		reply.Store(&b)
		for _, l := range []*Limiter{New(rdb, Options{Batcher: pipeline}), New(rdb, Options{})} {
			for range 2 {
				if d, err := l.Allow(context.Background(), reqs); err != nil || d != tc.want {
					t.Fatalf("reply %q: got %+v, %v; want %+v", tc.reply, d, err, tc.want)
				}
			}
		}
	}
}

// maxFuzzLength bounds the lengths a fuzzed reply may declare (see FuzzDecodeReply).
const maxFuzzLength = 4096

// declaresLength reports whether data may declare an aggregate or string length above limit:
// whether any byte of a RESP length-prefixed type is followed, up to the next newline, by a
// number above it. It looks at every such byte, not only at line starts, because a bulk string
// of the wrong length shifts where go-redis reads the next header.
func declaresLength(data []byte, limit int) bool {
	for i, c := range data {
		if !strings.ContainsRune("$*%~>|=!", rune(c)) {
			continue
		}
		line := data[i+1:]
		if end := bytes.IndexByte(line, '\n'); end >= 0 {
			line = line[:end]
		}
		line = bytes.TrimSuffix(line, []byte("\r"))
		if n, err := strconv.ParseInt(string(line), 10, 64); (err == nil && n > int64(limit)) || errors.Is(err, strconv.ErrRange) {
			return true
		}
	}
	return false
}

// replyingClient is a go-redis client, configured as the handler's, whose every connection is
// one end of a net.Pipe served by serveReply with the reply stored when it is dialled. No
// connection is used twice (the server hangs up after its reply).
func replyingClient(reply *atomic.Pointer[[]byte]) *redis.Client {
	return redis.NewClient(&redis.Options{
		// An IP address: go-redis resolves a host name when the client is made.
		Addr: "127.0.0.1:6379",
		Dialer: func(context.Context, string, string) (net.Conn, error) {
			client, server := net.Pipe()
			go serveReply(server, *reply.Load())
			return client, nil
		},
		MaxRetries:            -1,
		ContextTimeoutEnabled: true,
		DisableIdentity:       true,
		ConnMaxIdleTime:       time.Nanosecond,
	})
}

// serveReply refuses HELLO, answers the next command with reply and hangs up.
func serveReply(c net.Conn, reply []byte) {
	defer c.Close()
	br := bufio.NewReader(c)
	for {
		name, err := readCommandName(br)
		if err != nil {
			return
		}
		if name == "HELLO" {
			if _, err := io.WriteString(c, "-ERR unknown command 'HELLO'\r\n"); err != nil {
				return
			}
			continue
		}
		_, _ = c.Write(reply)
		return
	}
}

// readCommandName reads one command (a RESP array of bulk strings) and returns its name.
func readCommandName(br *bufio.Reader) (string, error) {
	header := func(prefix byte) (int, error) {
		line, err := br.ReadString('\n')
		if err != nil {
			return 0, err
		}
		n, err := strconv.Atoi(strings.TrimSuffix(line[1:], "\r\n"))
		if line[0] != prefix || err != nil || n < 0 || n > 1<<20 {
			return 0, fmt.Errorf("unexpected %q", line)
		}
		return n, nil
	}
	n, err := header('*')
	if err != nil {
		return "", err
	}
	var name string
	for i := range n {
		size, err := header('$')
		if err != nil {
			return "", err
		}
		b := make([]byte, size+2)
		if _, err := io.ReadFull(br, b); err != nil {
			return "", err
		}
		if i == 0 {
			name = strings.ToUpper(string(b[:size]))
		}
	}
	return name, nil
}
