package ratelimitredis

// Hostile input (issue 7), end to end through Caddy and a real Redis: client keys that are huge,
// full of braces or control bytes, a burst of 100,000 clients, hostile cost placeholders,
// X-Forwarded-For spoofing, one zone name shared by two sites, and configs out of range on the
// JSON path. Nothing may crash, grow without bound or escape its hash tag.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// startSites runs Caddy in this process with the given `servers` global options and one site
// per body, each on its own free loopback port, and stops it when the test ends.
func startSites(t *testing.T, serverOptions string, sites ...string) []*caddyServer {
	t.Helper()
	var b strings.Builder
	b.WriteString("{\n\tadmin off\n\tauto_https off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n")
	if serverOptions != "" {
		fmt.Fprintf(&b, "\tservers {\n%s\n\t}\n", serverOptions)
	}
	b.WriteString("}\n")
	servers := make([]*caddyServer, len(sites))
	for i, site := range sites {
		port := freeLoopbackPort(t)
		servers[i] = &caddyServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(port)}
		fmt.Fprintf(&b, ":%d {\n\tbind 127.0.0.1\n%s\n}\n", port, site)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := loadCaddyfile(t, b.String()); err != nil {
		t.Fatalf("loading: %v", err)
	}
	return servers
}

// redisKeys returns every key of srv.
func redisKeys(t *testing.T, srv *redistest.Server) []string {
	t.Helper()
	keys, err := srv.Client().Keys(t.Context(), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	return keys
}

// hashTag is the part of key that Redis Cluster hashes: between the first { and the first }
// after it, when that is not empty; else the whole key.
func hashTag(key string) string {
	if open := strings.IndexByte(key, '{'); open >= 0 {
		if end := strings.IndexByte(key[open+1:], '}'); end > 0 {
			return key[open+1 : open+1+end]
		}
	}
	return key
}

// tbZone and swZone are zones named name, enough for limiter.StateKey.
func tbZone(name string) *limiter.Zone {
	return &limiter.Zone{Name: name, Algorithm: limiter.TokenBucket}
}

func swZone(name string) *limiter.Zone {
	return &limiter.Zone{Name: name, Algorithm: limiter.SlidingWindow}
}

// TestAbuseHugeAPIKey: a 64 kB X-API-Key. With Caddy's default max_header_size (16 kB) it never
// reaches the handler: 431, and Redis sees nothing. With the limit raised it is one client,
// counted under a 44-byte digest: the Redis key has the same length as for any other hashed key.
func TestAbuseHugeAPIKey(t *testing.T) {
	site := func(addr string) string {
		return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-API-Key}
		capacity 2
		refill_rate 1/1h
	}
	respond "ok"`, addr)
	}
	huge := strings.Repeat("k", 64<<10)
	other := huge[:len(huge)-1] + "K" // differs in the last byte only

	t.Run("default max_header_size", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := startSites(t, "", site(srv.Addr))[0]
		if r := cs.get("/", "X-API-Key", huge); r.status != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("got %d %q, want 431", r.status, r.body)
		}
		if n := srv.ScriptCalls(); n != 0 {
			t.Fatalf("%d script calls: the request reached the limiter", n)
		}
		if keys := redisKeys(t, srv); len(keys) != 0 {
			t.Fatalf("Redis keys %q, want none", keys)
		}
	})

	t.Run("max_header_size 128KB", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := startSites(t, "\t\tmax_header_size 128KB", site(srv.Addr))[0]
		cs.get("/", "X-API-Key", huge).expect(t, "first", 200, "ok", "X-RateLimit-Remaining", "1")
		cs.get("/", "X-API-Key", huge).expect(t, "second", 200, "ok", "X-RateLimit-Remaining", "0")
		cs.get("/", "X-API-Key", huge).expect(t, "third", 429, "")
		cs.get("/", "X-API-Key", other).expect(t, "a key differing in its last byte", 200, "ok", "X-RateLimit-Remaining", "1")

		keys := redisKeys(t, srv)
		want := map[string]bool{
			limiter.StateKey("rl:", tbZone("default"), huge):  true,
			limiter.StateKey("rl:", tbZone("default"), other): true,
		}
		if len(keys) != len(want) {
			t.Fatalf("Redis keys %q, want %d", keys, len(want))
		}
		for _, k := range keys {
			// rl: { ~ and 43 bytes of digest } :default:tb
			if !want[k] || len(k) != len("rl:{}:default:tb")+44 {
				t.Fatalf("Redis key %q (%d bytes): want one of %v, of %d bytes", k, len(k), want, len("rl:{}:default:tb")+44)
			}
		}
	})
}

// TestAbuseBraceKeys: client keys made of braces cannot choose their Redis Cluster hash slot. Each
// stored key has exactly one { and one }, its hash tag is the sanitised client key, and a
// cluster-enabled redis-server puts both zones of a client in the slot of that sanitised key.
func TestAbuseBraceKeys(t *testing.T) {
	srv := redistest.Start(t)
	// Only asked CLUSTER KEYSLOT: the hash slot as Redis computes it.
	slots := redistest.Start(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
	cs := startSites(t, "", fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone tb {
			key {http.request.header.X-API-Key}
			capacity 5
			refill_rate 1/1h
		}
		zone sw {
			key {http.request.header.X-API-Key}
			algorithm sliding_window
			limit 5
			window 1h
		}
	}
	respond "ok"`, srv.Addr))[0]

	raws := []string{
		"alice", "{", "}", "}{", "{}", "{x}", "{{{}}}", "a{b}c", "x}:tb:{y",
		"{alice}", // a key that would hash as "alice" if it were used verbatim
		strings.Repeat("{", 1000) + strings.Repeat("}", 1000),
	}
	for _, raw := range raws {
		cs.get("/", "X-API-Key", raw).expect(t, "key "+raw[:min(len(raw), 20)], 200, "ok", "X-RateLimit-Remaining", "4")
	}
	keys := redisKeys(t, srv)
	if len(keys) != 2*len(raws) {
		t.Fatalf("%d Redis keys, want %d: %q", len(keys), 2*len(raws), keys)
	}
	slotOf := func(key string) int64 { return slots.Do("CLUSTER", "KEYSLOT", key).(int64) }
	for _, raw := range raws {
		tag := limiter.ClientKey(raw)
		if strings.ContainsAny(raw, "{}") && tag == raw {
			t.Fatalf("%q was used verbatim", raw)
		}
		want := slotOf(tag)
		for _, z := range []*limiter.Zone{tbZone("tb"), swZone("sw")} {
			key := limiter.StateKey("rl:", z, raw)
			if srv.Do("EXISTS", key) != int64(1) {
				t.Fatalf("no Redis key %q for client key %q", key, raw)
			}
			if strings.Count(key, "{") != 1 || strings.Count(key, "}") != 1 || hashTag(key) != tag {
				t.Fatalf("Redis key %q for %q: want one hash tag, %q", key, raw, tag)
			}
			if got := slotOf(key); got != want {
				t.Fatalf("Redis key %q for %q is in slot %d, want %d (the slot of %q)", key, raw, got, want, tag)
			}
		}
	}
	if slotOf(limiter.StateKey("rl:", tbZone("tb"), "{alice}")) == slotOf("alice") {
		t.Fatal(`"{alice}" shares the slot of "alice": its braces chose the hash tag`)
	}
}

// rawRequest sends request bytes as they are on a new connection and returns the status line.
func rawRequest(t *testing.T, base, request string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", strings.TrimPrefix(base, "http://"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, request); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the status line: %v", err)
	}
	return strings.TrimSpace(line)
}

// TestAbuseNULAndCRLF: NUL, CR and LF bytes. In a header they never reach the handler: Go's HTTP
// server answers 400 and Redis sees nothing. Through a placeholder that decodes them (a query
// parameter), each distinct value is its own client, counted under a digest in one hash tag.
func TestAbuseNULAndCRLF(t *testing.T) {
	srv := redistest.Start(t)
	cs := startSites(t, "", fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-API-Key} {http.request.uri.query.k}
		capacity 2
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr))[0]

	for name, value := range map[string]string{"NUL": "a\x00b", "CR": "a\rb", "DEL": "a\x7fb"} {
		status := rawRequest(t, cs.base, "GET / HTTP/1.1\r\nHost: x\r\nX-API-Key: "+value+"\r\n\r\n")
		if status != "HTTP/1.1 400 Bad Request" {
			t.Fatalf("%s in a header: got %q, want 400", name, status)
		}
	}
	if n := srv.ScriptCalls(); n != 0 {
		t.Fatalf("%d script calls: a header with a control byte reached the limiter", n)
	}

	raws := []string{"a\x00b", "a\r\nb", "a\nb", "\r\n", "\x00", "a\x00b\x00", "ab"}
	for _, raw := range raws {
		path := "/?k=" + url.QueryEscape(raw)
		cs.get(path).expect(t, fmt.Sprintf("%q first", raw), 200, "ok", "X-RateLimit-Remaining", "1")
		cs.get(path).expect(t, fmt.Sprintf("%q second", raw), 200, "ok", "X-RateLimit-Remaining", "0")
		cs.get(path).expect(t, fmt.Sprintf("%q third", raw), 429, "")
	}
	keys := redisKeys(t, srv)
	if len(keys) != len(raws) {
		t.Fatalf("%d Redis keys, want one per client key (%d): %q", len(keys), len(raws), keys)
	}
	for _, raw := range raws {
		// The query parameter is the zone's second key candidate.
		key := limiter.StateKey("rl:", tbZone("default"), limiter.CandidateKey(2, raw))
		if srv.Do("EXISTS", key) != int64(1) {
			t.Fatalf("no Redis key %q for %q", key, raw)
		}
		if strings.ContainsAny(key, "\x00\r\n") || strings.Count(key, "{") != 1 || strings.Count(key, "}") != 1 {
			t.Fatalf("Redis key %q for %q holds a control byte or more than one hash tag", key, raw)
		}
	}
}

// TestAbuseManyClients: a burst of 100,000 distinct clients, each taking one decision of two
// zones (a token bucket and a sliding window) through the handler. Every key Redis holds has a
// TTL, at most the zone's window; the memory per tracked key is measured (MEMORY USAGE, and
// used_memory over the key count); then the keys expire, and Redis's memory returns.
func TestAbuseManyClients(t *testing.T) {
	const (
		clients = 100_000
		workers = 8
		// Shorter than the burst takes here: the first clients' keys expire before it ends, so
		// Redis holds about the clients of the last window, not all of them.
		window = 5 * time.Second
	)
	srv := redistest.Start(t)
	rdb := srv.Client()
	ctx := t.Context()
	usedMemoryRE := regexp.MustCompile(`(?m)^used_memory:(\d+)`)
	usedMemory := func(info string) int64 {
		n, _ := strconv.ParseInt(usedMemoryRE.FindStringSubmatch(info)[1], 10, 64)
		return n
	}
	baseline := usedMemory(rdb.Info(ctx, "memory").Val())

	h := provisioned(t, &Handler{
		Redis:   &RedisConfig{Addresses: []string{srv.Addr}},
		Timeout: caddy.Duration(10 * time.Second), // a slow machine must not fail open
		Zones: []*Zone{
			{Name: "tb", Key: []string{"{http.request.header.X-API-Key}"}, Capacity: NumberOf(5), RefillRate: NumberOf(1 / window.Seconds())},
			{Name: "sw", Key: []string{"{http.request.header.X-API-Key}"}, Algorithm: "sliding_window", Limit: NumberOf(5), Window: NumberOf(caddy.Duration(window))},
		},
	})
	ip := func(i int) string { return fmt.Sprintf("10.%d.%d.%d", i>>16, i>>8&0xff, i&0xff) }
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := w; i < clients; i += workers {
				r := httptest.NewRequest(http.MethodGet, "/", nil)
				r.Header.Set("X-API-Key", ip(i))
				caddyhttp.NewTestReplacer(r) // the request's placeholders, as Caddy's server sets them
				rec, next := httptest.NewRecorder(), false
				err := h.ServeHTTP(rec, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
					next = true
					return nil
				}))
				if err != nil || !next || rec.Header().Get("X-RateLimit-Remaining") != "4" || rec.Header().Get("X-RateLimit-Degraded") != "" {
					errs <- fmt.Errorf("client %s: err %v, next %t, headers %v", ip(i), err, next, rec.Header())
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	burst := time.Since(start)

	// Every key has a TTL (INFO keyspace: expires == keys). The keys of the first clients may
	// have expired already: at most, not exactly, two keys per client.
	info := rdb.Info(ctx, "memory", "keyspace").Val() // one snapshot of both
	m := regexp.MustCompile(`db0:keys=(\d+),expires=(\d+)`).FindStringSubmatch(info)
	if m == nil {
		t.Fatal("no keys in Redis")
	}
	keys, _ := strconv.Atoi(m[1])
	expires, _ := strconv.Atoi(m[2])
	peak := usedMemory(info)
	if keys != expires || keys > 2*clients || keys == 0 {
		t.Fatalf("%d keys, %d with a TTL: want every key with one, at most %d", keys, expires, 2*clients)
	}
	// TTLs and MEMORY USAGE of the latest clients (the earliest may have expired), in one
	// round trip.
	const sample = 1000
	var ttls []*redis.DurationCmd
	var sizes []*redis.IntCmd
	_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := clients - sample; i < clients; i++ {
			for _, z := range []*limiter.Zone{tbZone("tb"), swZone("sw")} {
				key := limiter.StateKey("rl:", z, ip(i))
				ttls = append(ttls, p.PTTL(ctx, key))
				sizes = append(sizes, p.MemoryUsage(ctx, key, 0))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var bytes [2]int64 // token bucket, sliding window
	for i := range ttls {
		if ttl := ttls[i].Val(); ttl <= 0 || ttl > window {
			t.Fatalf("%s: TTL %v, want within (0, %v]", ttls[i].Args()[1], ttl, window)
		}
		bytes[i%2] += sizes[i].Val()
	}
	t.Logf("%d clients in %v (%.0f decisions/s of two zones); at its end Redis held %d keys of the %d written, all with a TTL of at most %v",
		clients, burst.Round(time.Millisecond), float64(clients)/burst.Seconds(), keys, 2*clients, window)
	t.Logf("MEMORY USAGE per key: token bucket %d bytes, sliding window (one entry) %d bytes; used_memory: %d bytes per key (%.1f MB for %d keys)",
		bytes[0]/sample, bytes[1]/sample, (peak-baseline)/int64(keys), float64(peak-baseline)/1e6, keys)

	// One sliding window client with many entries: the bytes per admitted slot.
	l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:"})
	bulk := &limiter.Zone{Name: "bulk", Algorithm: limiter.SlidingWindow, Limit: 1000, Window: window}
	if d, err := l.Decide(ctx, []limiter.Request{{Zone: bulk, Key: "bulk", Cost: 1000}}); err != nil || !d.Allowed {
		t.Fatalf("bulk: %+v, %v", d, err)
	}
	t.Logf("sliding window with 1000 entries: %d bytes per entry (MEMORY USAGE)",
		rdb.MemoryUsage(ctx, limiter.StateKey("rl:", bulk, "bulk"), 0).Val()/1000)

	// The keys expire: memory is bounded by the clients of the last window.
	waitFor(t, window+30*time.Second, "every key expired", func() bool { return rdb.DBSize(ctx).Val() == 0 })
	waitFor(t, 30*time.Second, "used_memory back within 10% of the burst's", func() bool {
		return usedMemory(rdb.Info(ctx, "memory").Val())-baseline < (peak-baseline)/10
	})
	t.Logf("after expiry: used_memory %d bytes above the baseline (%d at the end of the burst)",
		usedMemory(rdb.Info(ctx, "memory").Val())-baseline, peak-baseline)
}

// TestAbuseCostPlaceholder: every kind of hostile cost, end to end, with the statuses of DESIGN
// §5: empty counts as 1; anything but a positive integer is 400; a cost above the zone's
// capacity or limit is 429 without Retry-After. None of them charges the zone.
func TestAbuseCostPlaceholder(t *testing.T) {
	srv := redistest.Start(t)
	cs := startSites(t, "", fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone tb {
			match path /tb
			cost {http.request.header.X-Cost}
			capacity 10
			refill_rate 1/1h
		}
		zone sw {
			match path /sw
			cost {http.request.header.X-Cost}
			algorithm sliding_window
			limit 10
			window 1h
		}
	}
	respond "ok"`, srv.Addr))[0]

	bad := []string{"-1", "0", "-0", "00", "NaN", "nan", "Inf", "+Inf", "1e3", "0x10", "1.0", "1,000", "abc", "٣",
		"3 3", "+", "-", "99999999999999999999", "-9223372036854775808", "{http.request.header.X-Cost}"}
	for _, path := range []string{"/tb", "/sw"} {
		cs.get(path, "X-Cost", "").expect(t, path+" empty cost counts 1", 200, "ok", "X-RateLimit-Remaining", "9")
		cs.get(path).expect(t, path+" no cost header counts 1", 200, "ok", "X-RateLimit-Remaining", "8")
		cs.get(path, "X-Cost", "+2").expect(t, path+" cost +2", 200, "ok", "X-RateLimit-Remaining", "6")
		for _, cost := range bad {
			cs.get(path, "X-Cost", cost).expect(t, fmt.Sprintf("%s cost %q", path, cost), 400, "", "Retry-After", "", "X-RateLimit-Remaining", "")
		}
		// Decided by Redis, again and again: a huge cost once made the script's retry after
		// overflow, a bad_response that failed open and, five times over, opened the circuit
		// breaker for every client.
		for range 3 {
			for _, cost := range []string{"11", "9007199254740993", "9223372036854775807"} {
				cs.get(path, "X-Cost", cost).expect(t, fmt.Sprintf("%s cost %s above the quota", path, cost), 429, "",
					"Retry-After", "", "X-RateLimit-Remaining", "6", "X-RateLimit-Degraded", "")
			}
		}
		// Nothing above was charged: 6 left, so 7 waits (with Retry-After) and 6 passes.
		r := cs.get(path, "X-Cost", "7")
		r.expect(t, path+" cost 7 of 6 left", 429, "", "X-RateLimit-Remaining", "6")
		if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); ra < 1 {
			t.Fatalf("%s: Retry-After %q on a denial that waiting cures", path, r.header.Get("Retry-After"))
		}
		cs.get(path, "X-Cost", "6").expect(t, path+" cost 6 of 6 left", 200, "ok", "X-RateLimit-Remaining", "0", "X-RateLimit-Degraded", "")
	}
}

// TestAbuseForwardedFor: with {client_ip} and no trusted_proxies, X-Forwarded-For is ignored, so
// a client rotating it is still one client. With trusted_proxies, Caddy takes the client IP from
// the header when the peer is a trusted proxy: the first valid address by default, the last
// untrusted one with trusted_proxies_strict, which is what survives a proxy that appends the
// address it saw to a header the client forged.
func TestAbuseForwardedFor(t *testing.T) {
	site := func(addr string) string {
		return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		capacity 3
		refill_rate 1/1h
	}
	respond "{http.rate_limit_redis.key}"`, addr)
	}

	t.Run("no trusted_proxies", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := startSites(t, "", site(srv.Addr))[0]
		for i := 1; i <= 3; i++ {
			xff := fmt.Sprintf("203.0.113.%d", i)
			cs.get("/", "X-Forwarded-For", xff, "X-Real-IP", xff).expect(t, "XFF "+xff, 200, "127.0.0.1", "X-RateLimit-Remaining", strconv.Itoa(3-i))
		}
		cs.get("/", "X-Forwarded-For", "203.0.113.4").expect(t, "fourth XFF", 429, "")
		if keys := redisKeys(t, srv); len(keys) != 1 || keys[0] != "rl:{127.0.0.1}:default:tb" {
			t.Fatalf("Redis keys %q, want only the peer's", keys)
		}
	})

	t.Run("trusted_proxies", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := startSites(t, "\t\ttrusted_proxies static 127.0.0.1/8", site(srv.Addr))[0]
		for i := 1; i <= 3; i++ {
			xff := fmt.Sprintf("203.0.113.%d", i)
			cs.get("/", "X-Forwarded-For", xff).expect(t, "XFF "+xff, 200, xff, "X-RateLimit-Remaining", "2")
		}
		// The first valid address wins: behind a proxy that appends, a forged first entry does.
		cs.get("/", "X-Forwarded-For", "198.51.100.7, 203.0.113.1").expect(t, "forged first entry", 200, "198.51.100.7", "X-RateLimit-Remaining", "2")
	})

	t.Run("trusted_proxies_strict", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := startSites(t, "\t\ttrusted_proxies static 127.0.0.1/8\n\t\ttrusted_proxies_strict", site(srv.Addr))[0]
		// The proxy appends the address it saw (203.0.113.1) to whatever the client sent.
		for i := 1; i <= 3; i++ {
			forged := fmt.Sprintf("198.51.100.%d", i)
			cs.get("/", "X-Forwarded-For", forged+", 203.0.113.1").expect(t, "forged "+forged, 200, "203.0.113.1", "X-RateLimit-Remaining", strconv.Itoa(3-i))
		}
		cs.get("/", "X-Forwarded-For", "198.51.100.4, 203.0.113.1").expect(t, "fourth forged entry", 429, "")
		cs.get("/", "X-Forwarded-For", "203.0.113.2").expect(t, "another client", 200, "203.0.113.2", "X-RateLimit-Remaining", "2")
		// Trusted hops on the right are skipped.
		cs.get("/", "X-Forwarded-For", "203.0.113.3, 127.0.0.5").expect(t, "through two proxies", 200, "203.0.113.3", "X-RateLimit-Remaining", "2")
	})
}

// TestAbuseZoneSharedAcrossSites: two handlers (two sites) with a zone of the same name, the same
// key_prefix and the same Redis share the zone's state, because the Redis key is
// `<prefix>{client}:<zone>:<tb|sw>`; another key_prefix separates them.
func TestAbuseZoneSharedAcrossSites(t *testing.T) {
	srv := redistest.Start(t)
	site := func(prefix string) string {
		return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key_prefix %s
		zone api {
			capacity 4
			refill_rate 1/1h
		}
	}
	respond "ok"`, srv.Addr, prefix)
	}
	sites := startSites(t, "", site("rl:"), site("rl:"), site("other:"))
	a, b, c := sites[0], sites[1], sites[2]
	a.get("/").expect(t, "site A", 200, "ok", "X-RateLimit-Remaining", "3")
	b.get("/").expect(t, "site B, same zone", 200, "ok", "X-RateLimit-Remaining", "2")
	a.get("/").expect(t, "site A again", 200, "ok", "X-RateLimit-Remaining", "1")
	b.get("/").expect(t, "site B again", 200, "ok", "X-RateLimit-Remaining", "0")
	a.get("/").expect(t, "site A, spent by both", 429, "")
	b.get("/").expect(t, "site B, spent by both", 429, "")
	c.get("/").expect(t, "site C, other key_prefix", 200, "ok", "X-RateLimit-Remaining", "3")
	keys := redisKeys(t, srv)
	if len(keys) != 2 {
		t.Fatalf("Redis keys %q, want rl:{127.0.0.1}:api:tb and other:{127.0.0.1}:api:tb", keys)
	}
}

// TestConfigAbuseJSON: the JSON path (unmarshal, Provision, Validate, as `caddy run` with a JSON
// config does) rejects the out-of-range values the Caddyfile parser rejects, names the field,
// and leaves no Redis client behind.
func TestConfigAbuseJSON(t *testing.T) {
	tb := func(fields string) string { return `{"zones":[{"name":"a",` + fields + `}]}` }
	sw := func(fields string) string { return tb(`"algorithm":"sliding_window",` + fields) }
	for name, tc := range map[string]struct{ json, want string }{
		"capacity 0":        {tb(`"capacity":0,"refill_rate":1`), "zone a: capacity is required for algorithm token_bucket (the default when no algorithm is given)"},
		"capacity negative": {tb(`"capacity":-5,"refill_rate":1`), `zone a: capacity: "-5" is out of range (1 to 9007199254740992)`},
		// caddy.Load passes numbers through float64: 2^53+1 would arrive as 2^53, 2^53+2 as itself.
		"capacity beyond 2^53":  {tb(`"capacity":9007199254740994,"refill_rate":1`), `zone a: capacity: "9007199254740994" is out of range (1 to 9007199254740992)`},
		"capacity beyond int64": {tb(`"capacity":99999999999999999999,"refill_rate":1`), `zone a: capacity: "100000000000000000000" is out of range (1 to 9007199254740992)`},
		"capacity a float":      {tb(`"capacity":1.5,"refill_rate":1`), `zone a: capacity: "1.5" is not an integer`},
		"refill_rate 0":         {tb(`"capacity":1`), "zone a: refill_rate is required for algorithm token_bucket (the default when no algorithm is given)"},
		"refill_rate negative":  {tb(`"capacity":1,"refill_rate":-1`), `zone a: refill_rate: "-1" must be > 0`},
		"refill_rate tiny":      {tb(`"capacity":1,"refill_rate":5e-324`), "zone a: an empty bucket takes +Infs to refill (capacity / refill_rate); at most 366d is supported"},
		"refill_rate beyond float64": {tb(`"capacity":1,"refill_rate":1e309`),
			"cannot unmarshal number 1e309 into Go value of type float64"},
		"limit 0":               {sw(`"limit":0,"window":"1m"`), "zone a: limit is required for algorithm sliding_window"},
		"limit negative":        {sw(`"limit":-1,"window":"1m"`), `zone a: limit: "-1" is out of range (1 to 1000000)`},
		"limit beyond 2^53":     {sw(`"limit":9007199254740994,"window":"1m"`), `zone a: limit: "9007199254740994" is out of range (1 to 1000000)`},
		"window 0":              {sw(`"limit":1`), "zone a: window is required for algorithm sliding_window"},
		"window below 1ms":      {sw(`"limit":1,"window":"999us"`), `zone a: window: "999us" is out of range (1ms to 366d)`},
		"window 1ns":            {sw(`"limit":1,"window":1`), `zone a: window: "1ns" is out of range (1ms to 366d)`},
		"window negative":       {sw(`"limit":1,"window":"-1s"`), `zone a: window: "-1s" is out of range (1ms to 366d)`},
		"window above 366d":     {sw(`"limit":1,"window":"367d"`), `zone a: window: "367d" is out of range (1ms to 366d)`},
		"window not a duration": {sw(`"limit":1,"window":"soon"`), `zone a: window: "soon" is not a duration`},
		"zone name with a space": {`{"zones":[{"name":"a b","capacity":1,"refill_rate":1}]}`,
			`zone name "a b" must be 1 to 64 characters of A-Z a-z 0-9 _ . -`},
		"zone name in braces": {`{"zones":[{"name":"{a}","capacity":1,"refill_rate":1}]}`,
			`zone name "{a}" must be 1 to 64 characters of A-Z a-z 0-9 _ . -`},
		"zone name with a brace": {`{"zones":[{"name":"a}","capacity":1,"refill_rate":1}]}`,
			`zone name "a}" must be 1 to 64 characters of A-Z a-z 0-9 _ . -`},
		"zone name empty": {`{"zones":[{"capacity":1,"refill_rate":1}]}`,
			`zone name "" must be 1 to 64 characters of A-Z a-z 0-9 _ . -`},
		"zone name too long": {`{"zones":[{"name":"` + strings.Repeat("a", 65) + `","capacity":1,"refill_rate":1}]}`,
			`zone name "` + strings.Repeat("a", 65) + `" must be 1 to 64 characters of A-Z a-z 0-9 _ . -`},
		"duplicate zone names": {`{"zones":[{"name":"a","capacity":1,"refill_rate":1},{"name":"a","algorithm":"sliding_window","limit":1,"window":"1s"}]}`,
			`zone name "a" is used twice`},
		"cost 0":              {tb(`"capacity":1,"refill_rate":1,"cost":"0"`), `zone a: cost: "0" must be > 0`},
		"cost negative":       {tb(`"capacity":1,"refill_rate":1,"cost":"-1"`), `zone a: cost: "-1" must be > 0`},
		"cost NaN":            {tb(`"capacity":1,"refill_rate":1,"cost":"NaN"`), `zone a: cost: "NaN" is not an integer or a placeholder`},
		"cost beyond int64":   {tb(`"capacity":1,"refill_rate":1,"cost":"99999999999999999999"`), `zone a: cost: "99999999999999999999" is out of range`},
		"cost an empty brace": {tb(`"capacity":1,"refill_rate":1,"cost":"x{}"`), `zone a: cost: "x{}" is not an integer or a placeholder`},
		"cost an open brace":  {tb(`"capacity":1,"refill_rate":1,"cost":"{"`), `zone a: cost: "{" is not an integer or a placeholder`},
		"cost above capacity": {tb(`"capacity":5,"refill_rate":1,"cost":"6"`), "zone a: cost 6 is larger than capacity 5: no request could ever be admitted"},
		"key_prefix with a brace": {`{"key_prefix":"rl{","zones":[{"name":"a","capacity":1,"refill_rate":1}]}`,
			`key_prefix "rl{" must not contain { or }`},
		"timeout negative": {`{"timeout":"-1s","zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "timeout must be > 0"},
		"db negative":      {`{"redis":{"db":-1},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis db -1 must be >= 0"},
		"algorithm":        {`{"zones":[{"name":"a","algorithm":"leaky_bucket","capacity":1,"refill_rate":1}]}`, `zone a: algorithm "leaky_bucket" must be token_bucket, sliding_window, fixed_window, sliding_window_counter or concurrency`},
	} {
		t.Run(name, func(t *testing.T) {
			// Raw, so that numbers reach Caddy as written.
			handler := json.RawMessage(`{"handler":"rate_limit_redis",` + strings.TrimPrefix(tc.json, "{"))
			cfg, err := json.Marshal(map[string]any{
				"admin": map[string]any{"disabled": true},
				"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"s": map[string]any{
					"listen": []string{"127.0.0.1:0"},
					"routes": []any{map[string]any{"handle": []any{handler}}},
				}}}},
			})
			if err != nil {
				t.Fatal(err)
			}
			before := clientCount()
			err = caddy.Load(cfg, true)
			if err == nil {
				_ = caddy.Stop()
				t.Fatalf("config loaded; want error %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not say %q", err, tc.want)
			}
			if after := clientCount(); after != before {
				t.Fatalf("%d shared Redis clients after the failed load, %d before", after, before)
			}
		})
	}
}

// clientCount is the number of shared Redis clients alive.
func clientCount() int {
	n := 0
	clients.Range(func(any, any) bool { n++; return true })
	return n
}
