package ratelimitredis

// What a request resolves to in each zone (resolve.go), through Caddy and a real Redis: client
// keys (key candidates with namespaces of their own, key_secret's keyed digests, IP prefixes,
// keys that are empty, huge, made of braces or control bytes, and a burst of 100,000 clients)
// and plans (zone numbers from a map of the API key).

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/clientip"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestCandidateNamespaces: `key {http.request.header.X-API-Key} {client_ip}`, the client IP
// taken from X-Forwarded-For behind a trusted proxy. An attacker sending the victim's IP address
// as its API key gets a bucket of its own: it neither spends the victim's budget (the victim
// still gets its full burst) nor learns anything of it (its own X-RateLimit-Remaining starts
// full), and its own IP's bucket is untouched. Nor does the attacker reach the victim by
// mimicking the candidate's form (X-API-Key: 2=<ip>).
func TestCandidateNamespaces(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.StartSites(t, "\t\ttrusted_proxies static 127.0.0.1/8", fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone api {
			key {http.request.header.X-API-Key} {client_ip}
			capacity 4
			refill_rate 1/1h
		}
	}
	respond "{http.rate_limit_redis.key}"`, srv.Addr))[0]
	const victim, attacker = "203.0.113.7", "198.51.100.1"

	cs.Get("/", "X-Forwarded-For", victim).Expect(t, "victim 1", 200, "2="+victim, "X-RateLimit-Remaining", "3")
	for i := 1; i <= 4; i++ {
		// Its own bucket, full at first: 3 2 1 0, not the victim's 2 1 0 then 429.
		cs.Get("/", "X-Forwarded-For", attacker, "X-API-Key", victim).Expect(t, "attacker "+strconv.Itoa(i), 200, victim,
			"X-RateLimit-Remaining", strconv.Itoa(4-i))
	}
	cs.Get("/", "X-Forwarded-For", attacker, "X-API-Key", victim).Expect(t, "attacker 5", 429, "")
	cs.Get("/", "X-Forwarded-For", attacker, "X-API-Key", "2="+victim).Expect(t, "attacker mimicking the IP candidate", 200,
		"1=2="+victim, "X-RateLimit-Remaining", "3")
	for i := 2; i <= 4; i++ {
		cs.Get("/", "X-Forwarded-For", victim).Expect(t, "victim "+strconv.Itoa(i), 200, "2="+victim,
			"X-RateLimit-Remaining", strconv.Itoa(4-i))
	}
	cs.Get("/", "X-Forwarded-For", victim).Expect(t, "victim 5: its burst of 4 spent by itself alone", 429, "")
	cs.Get("/", "X-Forwarded-For", attacker).Expect(t, "the attacker's IP", 200, "2="+attacker, "X-RateLimit-Remaining", "3")

	keys := srv.Keys(t)
	slices.Sort(keys)
	want := []string{
		"rl:{2=" + attacker + "}:api:tb",
		"rl:{2=" + victim + "}:api:tb",
		"rl:{" + victim + "}:api:tb",                // the attacker's API key: as before namespaces
		"rl:{" + digestOf("2="+victim) + "}:api:tb", // X-API-Key: 2=<ip>, digested
	}
	slices.Sort(want)
	if !slices.Equal(keys, want) {
		t.Fatalf("Redis keys %q, want %q", keys, want)
	}
}

// digestOf is the first candidate's digested form of value: "~" and its base64url SHA-256.
func digestOf(value string) string {
	sum := sha256.Sum256([]byte(value))
	return "~" + base64.RawURLEncoding.EncodeToString(sum[:])
}

// keyedTag matches the hash tag of a keyed client key.
var keyedTag = regexp.MustCompile(`^0=[A-Za-z0-9_-]{43}$`)

// TestKeySecret: with key_secret every Redis key's hash tag is "0=" and a keyed digest, and no
// raw client key (API key or IP address) is in any Redis key name. Handlers with the same secret
// share a zone's state (one from {env.*}, one literal); a handler with another secret does not.
// The placeholder still shows the client key as resolved.
func TestKeySecret(t *testing.T) {
	srv := redistest.Start(t)
	secret, other := "s1-"+rand.Text(), "s2-"+rand.Text()
	t.Setenv("RL_TEST_KEY_SECRET", secret)
	site := func(keySecret string) string {
		return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key_secret %s
		zone api {
			key {http.request.header.X-API-Key} {client_ip}
			capacity 3
			refill_rate 1/1h
		}
	}
	respond "{http.rate_limit_redis.key}"`, srv.Addr, keySecret)
	}
	sites := caddytest.StartSites(t, "", site("{env.RL_TEST_KEY_SECRET}"), site(secret), site(other))
	a, b, c := sites[0], sites[1], sites[2]
	const apiKey = "sk-live-4f9a2c"
	a.Get("/", "X-API-Key", apiKey).Expect(t, "site A", 200, apiKey, "X-RateLimit-Remaining", "2")
	b.Get("/", "X-API-Key", apiKey).Expect(t, "site B, same secret: same bucket", 200, apiKey, "X-RateLimit-Remaining", "1")
	c.Get("/", "X-API-Key", apiKey).Expect(t, "site C, another secret: another bucket", 200, apiKey, "X-RateLimit-Remaining", "2")
	a.Get("/").Expect(t, "site A by IP", 200, "2=127.0.0.1", "X-RateLimit-Remaining", "2")
	a.Get("/", "X-API-Key", "127.0.0.1").Expect(t, "site A, the IP as an API key", 200, "127.0.0.1", "X-RateLimit-Remaining", "2")

	keys := srv.Keys(t)
	ks, ko := limiter.NewKeySecret([]byte(secret)), limiter.NewKeySecret([]byte(other))
	want := []string{
		limiter.StateKey("rl:", tbZone("api"), ks.Key(apiKey)),
		limiter.StateKey("rl:", tbZone("api"), ko.Key(apiKey)),
		limiter.StateKey("rl:", tbZone("api"), ks.Key("2=127.0.0.1")),
		limiter.StateKey("rl:", tbZone("api"), ks.Key("127.0.0.1")),
	}
	slices.Sort(keys)
	slices.Sort(want)
	if !slices.Equal(keys, want) {
		t.Fatalf("Redis keys %q, want %q", keys, want)
	}
	for _, k := range keys {
		if strings.Contains(k, apiKey) || strings.Contains(k, "127.0.0.1") || !keyedTag.MatchString(hashTag(k)) {
			t.Fatalf("Redis key %q: want a keyed hash tag and no raw client key", k)
		}
	}
}

// TestKeySecretNeverShows: a key_secret from {env.*}, with every log at DEBUG and log_key on,
// through allowed and denied requests, a reload with another secret and failing configs: neither
// secret is in any log line, any error (Provision, Validate, ServeHTTP, Caddy's load) or the
// adapted JSON, which holds the placeholder.
func TestKeySecretNeverShows(t *testing.T) {
	first, second := "first-"+rand.Text(), "second-"+rand.Text()
	secrets := []string{first, second}
	srv := redistest.Start(t)
	t.Setenv("RL_TEST_KEY_SECRET", first)
	site := fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		timeout 2s # a loaded machine must not make a decision fail: the test expects Redis's answers
		key_secret {env.RL_TEST_KEY_SECRET}
		log_key
		key {http.request.header.X-API-Key} {client_ip}
		capacity 1
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr)
	lc := startLoggedCaddy(t, site)
	lc.Get("/", "X-API-Key", "k").Expect(t, "allowed", 200, "ok")
	lc.Get("/", "X-API-Key", "k").Expect(t, "denied", 429, "")
	lc.Get("/", "X-API-Key", "k").Expect(t, "denied from the deny cache", 429, "")
	t.Setenv("RL_TEST_KEY_SECRET", second)
	if err := lc.load(site); err != nil {
		t.Fatalf("reload: %v", err)
	}
	lc.Get("/", "X-API-Key", "k").Expect(t, "another secret: a new bucket", 200, "ok")
	lc.Get("/", "X-API-Key", "k").Expect(t, "denied under the new secret", 429, "")
	srv.Stop()
	lc.Get("/", "X-API-Key", "k2").Expect(t, "redis down", 200, "ok")

	var errs []error
	for _, keySecret := range []string{"{env.RL_TEST_KEY_SECRET}", second} {
		zones := func() []*Zone { return []*Zone{{Name: "ks", Capacity: NumberOf(5), RefillRate: NumberOf(1)}} }
		// Provision fails: a TLS CA file that does not exist.
		errs = append(errs, provisionErr(t, &Handler{KeySecret: keySecret, Zones: zones(),
			Redis: &RedisConfig{Addresses: []string{srv.Addr}, TLS: &TLSConfig{CA: "/nonexistent/ca.pem"}}}))
		// Validate fails: no zone.
		errs = append(errs, provisionErr(t, &Handler{KeySecret: keySecret, Redis: &RedisConfig{Addresses: []string{srv.Addr}}}))
		// ServeHTTP fails: Redis is down (fail_mode closed: the 503's error).
		observed, logs := observer.New(zapcore.DebugLevel)
		h := provisioned(t, &Handler{KeySecret: keySecret, LogKey: true, FailMode: FailClosed, Zones: zones(),
			Redis: &RedisConfig{Addresses: []string{srv.Addr}, PoolSize: 4}})
		h.logger = zap.New(observed)
		_, err, _ := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
		var he caddyhttp.HandlerError
		if !errors.As(err, &he) || he.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("ServeHTTP with Redis down: %v, want a 503", err)
		}
		errs = append(errs, err)
		for _, e := range logs.All() {
			b, _ := json.Marshal(e.ContextMap())
			for _, s := range secrets {
				if strings.Contains(e.Message+string(b), s) {
					t.Errorf("a log line of a provisioned handler holds the key secret: %s %s", e.Message, b)
				}
			}
		}
	}
	// Secrets too short, from the environment and literal.
	t.Setenv("RL_TEST_SHORT_SECRET", second[:limiter.MinKeySecretBytes-1])
	for _, keySecret := range []string{"{env.RL_TEST_SHORT_SECRET}", second[:limiter.MinKeySecretBytes-1]} {
		err := provisionErr(t, &Handler{KeySecret: keySecret, Zones: []*Zone{{Name: "ks", Capacity: NumberOf(5), RefillRate: NumberOf(1)}}})
		if !errors.Is(err, errKeySecretShort) {
			t.Fatalf("a short key_secret: %v, want %v", err, errKeySecretShort)
		}
		errs = append(errs, err)
	}
	// Caddy's load of a JSON config that fails with a literal secret in it.
	errs = append(errs, caddy.Load([]byte(fmt.Sprintf(`{"admin":{"disabled":true},"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:0"],
		"routes":[{"handle":[{"handler":"rate_limit_redis","key_secret":%q,"redis":{"addresses":["a:1","b:2"],"db":3},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}]}]}}}}}`, second)), true))

	for _, err := range errs {
		if err == nil {
			t.Fatal("an expected error is nil")
		}
		for _, s := range secrets {
			for _, text := range []string{err.Error(), fmt.Sprintf("%+v", err), fmt.Sprintf("%#v", err)} {
				if strings.Contains(text, s) || strings.Contains(text, s[:limiter.MinKeySecretBytes-1]) {
					t.Errorf("an error holds a key secret: %s", text)
				}
			}
		}
	}
	lines := lc.lines()
	if len(withMsg(ours(lines), "rate limited")) != 3 || len(withMsg(lines, "handled request")) == 0 {
		t.Fatalf("the logs lack the lines this test reads for the secret (denials, access): %d lines", len(lines))
	}
	for _, l := range lines {
		for _, s := range secrets {
			if strings.Contains(l.raw, s) {
				t.Errorf("a log line holds a key secret: %s", l.raw)
			}
		}
	}
	for _, cfg := range lc.adapted {
		for _, s := range secrets {
			if strings.Contains(string(cfg), s) {
				t.Errorf("the adapted JSON holds a key secret: %s", cfg)
			}
		}
		if !strings.Contains(string(cfg), `"key_secret":"{env.RL_TEST_KEY_SECRET}"`) {
			t.Errorf("the adapted JSON lacks the placeholder: %s", cfg)
		}
	}
}

// bcrypt hashes (cost 4, for speed) of the passwords "alice-pw" and "bob-pw".
const (
	aliceHash = "$2a$04$0IolCeR4RXBOduPbbAiHBu1jVSbYhbeT9/2Db7IR7frhi7h2wIz7G"
	bobHash   = "$2a$04$Jg8LrbNPFktYsvIA2yfVQ.4yEc1AN1wH2rcls6wABD3/Wc.XqZwDS"
)

// TestLimitAfterAuthentication: the pattern of docs/caddyfile.md, "Limiting after
// authentication". rate_limit_redis is ordered before basic_auth, so at the top level it limits
// what no one has authenticated (here per IP, which caps password guessing); inside a route,
// after basic_auth, it limits per authenticated user, and a request that fails authentication
// never reaches it.
func TestLimitAfterAuthentication(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %[1]s
		}
		zone ip {
			key {client_ip}
			capacity 6
			refill_rate 1/1h
		}
	}
	route {
		basic_auth {
			alice %[2]s
			bob %[3]s
		}
		rate_limit_redis {
			redis {
				address %[1]s
			}
			zone user {
				key {http.auth.user.id}
				capacity 2
				refill_rate 1/1h
			}
		}
		respond "hello {http.auth.user.id}"
	}`, srv.Addr, aliceHash, bobHash))
	auth := func(user, password string) []string {
		req, _ := http.NewRequest(http.MethodGet, "/", nil)
		req.SetBasicAuth(user, password)
		return []string{"Authorization", req.Header.Get("Authorization")}
	}
	status := func(step string, hdr []string, want int) {
		t.Helper()
		if r := cs.Get("/", hdr...); r.Status != want {
			t.Fatalf("%s: %d %q, want %d", step, r.Status, r.Body, want)
		}
	}
	status("wrong password", auth("alice", "guess"), 401)
	cs.Get("/", auth("alice", "alice-pw")...).Expect(t, "alice 1", 200, "hello alice")
	cs.Get("/", auth("alice", "alice-pw")...).Expect(t, "alice 2", 200, "hello alice")
	status("alice 3: her user zone", auth("alice", "alice-pw"), 429)
	cs.Get("/", auth("bob", "bob-pw")...).Expect(t, "bob: his own user bucket", 200, "hello bob")
	status("wrong password again", auth("alice", "guess2"), 401)
	status("the IP zone caps guessing", auth("alice", "guess3"), 429)

	keys := srv.Keys(t)
	slices.Sort(keys)
	if want := []string{"rl:{127.0.0.1}:ip:tb", "rl:{alice}:user:tb", "rl:{bob}:user:tb"}; !slices.Equal(keys, want) {
		t.Fatalf("Redis keys %q, want %q: the failed logins must not reach the user zone", keys, want)
	}
}

// TestKeyPlaceholderLookedUpAsReplaceAll checks that a key entry made of one placeholder, looked
// up directly (keySources), resolves exactly as Caddy's ReplaceAll resolves it with Caddy's own
// HTTP placeholders: static strings, numbers, booleans, unknown and empty placeholders; request
// header fields (missing, empty, repeated, a name not in canonical case, a field changed in place
// by a handler before this one); variables (client_ip, a number, missing); and entries that are
// not one placeholder.
func TestKeyPlaceholderLookedUpAsReplaceAll(t *testing.T) {
	t.Parallel()
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-Api-Key", "k1")
	r.Header.Add("X-Multi", "a")
	r.Header.Add("X-Multi", "b")
	r.Header["X-Empty"] = []string{""}
	vars := map[string]any{"client_ip": "203.0.113.7", "n": 42}
	r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, vars))
	repl := caddyhttp.NewTestReplacer(r)
	repl.Set("v.str", "alice")
	repl.Set("v.int", 42)
	repl.Set("v.bool", true)
	repl.Set("v.empty", "")
	repl.Set("v.ip", "203.0.113.7")
	r.Header.Set("X-Changed", "later") // as request_header does, after the replacer was made
	entries := []string{"{v.str}", "{v.int}", "{v.bool}", "{v.empty}", "{v.unknown}", "{v.ip}",
		"user-{v.str}", "{v.str}{v.int}", `\{v.str}`, "literal",
		"{http.request.header.X-Api-Key}", "{http.request.header.x-api-key}", "{http.request.header.X-Multi}",
		"{http.request.header.X-Empty}", "{http.request.header.X-Missing}", "{http.request.header.X-Changed}",
		"{http.request.header.}", "key-{http.request.header.X-Api-Key}",
		"{http.vars.client_ip}", "{http.vars.n}", "{http.vars.missing}", "{http.vars.}"}
	direct := 0
	for _, k := range entries {
		compiled := &Zone{Key: []string{k}, keySources: []keySource{compileKey(k)}, v4: 32, v6: 64}
		replaced := &Zone{Key: []string{k}, v4: 32, v6: 64}
		got, want := compiled.clientKey(r, repl, &clientip.Memo{}), replaced.clientKey(r, repl, &clientip.Memo{})
		if got != want {
			t.Errorf("key %q: looked up %q, ReplaceAll %q", k, got, want)
		}
		if src := compileKey(k); src.header != "" || src.vars != "" {
			direct++
		}
	}
	if direct != 9 {
		t.Fatalf("%d entries read from the request directly, want 9: the test checks less than it says", direct)
	}
	if singlePlaceholder("{v.str}") != "v.str" || singlePlaceholder("user-{v.str}") != "" {
		t.Fatal("singlePlaceholder does not tell one placeholder from the rest: the test checks nothing")
	}
}

// TestIPPrefixKeys, end to end through Caddy behind a trusted proxy: IPv6 clients
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
	sites := caddytest.StartSites(t, "\t\ttrusted_proxies static 127.0.0.1/32",
		site("", "dflt"),
		site("ipv6_prefix 128\n\t\tipv4_prefix 24", "full"),
		strings.Replace(site("ipv6_prefix 128", "wide"), "capacity 2", "ipv6_prefix 48\n\t\t\tcapacity 2", 1),
	)
	type step struct {
		xff, user string
		status    int
		key       string // the placeholder, when admitted
	}
	run := func(cs *caddytest.Site, name string, steps []step) {
		t.Helper()
		for i, s := range steps {
			r := cs.Get("/", "X-Forwarded-For", s.xff, "X-User", s.user)
			if r.Status != s.status || (s.status == 200 && r.Body != s.key) {
				t.Fatalf("%s step %d (%s %s): %d %q, want %d %q", name, i, s.xff, s.user, r.Status, r.Body, s.status, s.key)
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
	keys := srv.Keys(t)
	for _, want := range []string{"rl:{2=2001:db8::/64}:dflt:tb", "rl:{2=198.51.100.0/24}:full:tb", "rl:{2=2001:db8::/48}:wide:tb"} {
		if !slices.Contains(keys, want) {
			t.Errorf("Redis key %s missing: %q", want, keys)
		}
	}
}

// TestNAT64Keys (docs/security.md): behind a NAT64/SIIT translator IPv4 clients are
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
	sites := caddytest.StartSites(t, "\t\ttrusted_proxies static 127.0.0.1/32", single, mapped, split)
	statuses := func(cs *caddytest.Site, xff ...string) string {
		var got []string
		for _, x := range xff {
			got = append(got, strconv.Itoa(cs.Get("/", "X-Forwarded-For", x).Status))
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
		cs.Get("/", "X-Forwarded-For", a).Expect(t, "nat64 "+want, 200, want)
		if got := statuses(cs, a, a, b, b, b); got != "200 429 200 200 429" {
			t.Fatalf("%s: %s; want 200 429 200 200 429 (a bucket per IPv4 client)", want, got)
		}
		cs.Get("/", "X-Forwarded-For", "2001:db8::1").Expect(t, "native IPv6", 200, "ip 2001:db8::/64")
		// 64:ff9b::1:0:0:1 is in 64:ff9b::/64 but not the /96: keyed as any IPv6 client.
		if got := statuses(cs, "2001:db8::2", "2001:db8::3", "64:ff9b::1:0:0:1", "64:ff9b::1:0:0:2", "64:ff9b::1:0:0:3"); got != "200 429 200 200 429" {
			t.Fatalf("native IPv6 (%s): %s; want 200 429 200 200 429 (one bucket per /64)", want, got)
		}
	}
}

// TestEmptyKeyAnonymousClient: a zone keyed on
// {http.auth.user.id} with rate_limit_redis in its default place, before basic_auth, sees every
// request with an empty key. Under each empty_key the warning is logged at load, the requests are
// counted in empty_key_total, and: shared — one anonymous client's requests exhaust the one
// shared bucket and then lock out a user with the right password too; skip — the zone limits
// nobody (nginx's behaviour); deny — every request is a 403, whoever sends it. With the handler
// in a route after basic_auth (as the warning says), each user has a bucket of their own.
func TestEmptyKeyAnonymousClient(t *testing.T) {
	srv := redistest.Start(t)
	const users = "basic_auth {\n\t\talice " + basicAuthHash + "\n\t\tbob " + basicAuthHash + "\n\t}"
	limiterBlock := func(zone, emptyKey string) string {
		return fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		zone %s {
			key {http.auth.user.id}
			empty_key %s
			capacity 3
			refill_rate 1/1h
		}
	}`, srv.Addr, zone, emptyKey)
	}
	alice := []string{"Authorization", "Basic " + basicAuth("alice", "secret")}
	bob := []string{"Authorization", "Basic " + basicAuth("bob", "secret")}

	for _, tc := range []struct {
		emptyKey string
		check    func(t *testing.T, lc *loggedCaddy)
		requests float64 // the requests counted in empty_key_total
	}{
		{EmptyKeyShared, func(t *testing.T, lc *loggedCaddy) {
			for i := 1; i <= 3; i++ {
				lc.Get("/").Expect(t, "anonymous "+strconv.Itoa(i)+": admitted, then refused by basic_auth", 401, "")
			}
			lc.Get("/").Expect(t, "anonymous 4: the shared bucket is empty", 429, "", "Retry-After", "3600", "X-RateLimit-Limit", "3")
			lc.Get("/", alice...).Expect(t, "alice, locked out by the anonymous client", 429, "", "Retry-After", "3600")
		}, 5},
		{EmptyKeySkip, func(t *testing.T, lc *loggedCaddy) {
			for i := 1; i <= 5; i++ {
				lc.Get("/").Expect(t, "anonymous "+strconv.Itoa(i)+": not limited", 401, "", "X-RateLimit-Limit", "")
			}
			for i := 1; i <= 5; i++ {
				lc.Get("/", alice...).Expect(t, "alice "+strconv.Itoa(i)+": not limited", 200, "user=alice", "X-RateLimit-Limit", "")
			}
		}, 10},
		{EmptyKeyDeny, func(t *testing.T, lc *loggedCaddy) {
			lc.Get("/").Expect(t, "anonymous", 403, "", "Retry-After", "", "X-RateLimit-Limit", "")
			lc.Get("/", alice...).Expect(t, "alice: the key is empty before basic_auth", 403, "", "Retry-After", "")
		}, 2},
	} {
		t.Run(tc.emptyKey, func(t *testing.T) {
			zone := "ek_" + tc.emptyKey
			lc := startLoggedCaddy(t, limiterBlock(zone, tc.emptyKey)+"\n\t"+users+
				"\n\trespond \"user={http.auth.user.id}\"")
			reg := activeRegistry(t)
			before := metricValue(t, reg, metricEmptyKeys, "zone", zone)
			tc.check(t, lc)
			if got := metricValue(t, reg, metricEmptyKeys, "zone", zone) - before; got != tc.requests {
				t.Errorf("empty_key_total{zone=%q} +%v, want +%v", zone, got, tc.requests)
			}
			warnings := withMsgPrefix(ours(lc.lines()), authMsg)
			if len(warnings) != 1 {
				t.Fatalf("%d auth placeholder warnings at load, want 1: %v", len(warnings), ours(lc.lines()))
			}
			if f := warnings[0].fields; f["level"] != "warn" || f["zone"] != zone ||
				f["placeholder"] != "{http.auth.user.id}" || f["empty_key"] != tc.emptyKey {
				t.Errorf("warning: %s", warnings[0].raw)
			}
		})
	}

	t.Run("in a route after basic_auth", func(t *testing.T) {
		zone := "ek_after_auth"
		lc := startLoggedCaddy(t, "route {\n\t"+users+"\n\t"+limiterBlock(zone, EmptyKeyShared)+
			"\n\trespond \"user={http.auth.user.id} key={http.rate_limit_redis.key}\"\n\t}")
		reg := activeRegistry(t)
		before := metricValue(t, reg, metricEmptyKeys, "zone", zone)
		for i := 1; i <= 5; i++ {
			lc.Get("/").Expect(t, "anonymous: refused by basic_auth first", 401, "")
		}
		for i := 1; i <= 3; i++ {
			lc.Get("/", alice...).Expect(t, "alice "+strconv.Itoa(i), 200, "user=alice key=alice",
				"X-RateLimit-Remaining", strconv.Itoa(3-i))
		}
		lc.Get("/", alice...).Expect(t, "alice over her limit", 429, "", "Retry-After", "3600")
		lc.Get("/", bob...).Expect(t, "bob has a bucket of his own", 200, "user=bob key=bob", "X-RateLimit-Remaining", "2")
		if got := metricValue(t, reg, metricEmptyKeys, "zone", zone) - before; got != 0 {
			t.Errorf("empty_key_total{zone=%q} +%v, want 0", zone, got)
		}
		// Caddy cannot tell the handler where it stands: the warning is there, and says when
		// to ignore it.
		warnings := withMsgPrefix(ours(lc.lines()), authMsg)
		if len(warnings) != 1 || !strings.Contains(warnings[0].raw, "ignore this warning if the handler runs after authentication") {
			t.Fatalf("warnings: %v", warnings)
		}
	})
}

// TestEmptyKeyDenyDryRun: in dry_run, a request that empty_key deny would reject goes on,
// reported with {http.rate_limit_redis.allowed} false, and no zone is decided or charged.
func TestEmptyKeyDenyDryRun(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{
		Redis:  &RedisConfig{Addresses: []string{srv.Addr}},
		DryRun: true,
		Zones: []*Zone{
			{Name: "ek_dry_ip", Capacity: NumberOf(5), RefillRate: NumberOf(1), Key: []string{"{http.request.remote.host}"}},
			{Name: "ek_dry_user", Capacity: NumberOf(5), RefillRate: NumberOf(1), Key: []string{"{http.request.header.X-User}"}, EmptyKey: EmptyKeyDeny},
		},
	})
	repl := caddy.NewReplacer()
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
	w := httptest.NewRecorder()
	nextCalled := false
	err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		nextCalled = true
		return nil
	}))
	if err != nil || !nextCalled {
		t.Fatalf("dry_run: err %v, next called %t; want the request passed on", err, nextCalled)
	}
	if v, _ := repl.Get("http.rate_limit_redis.allowed"); v != false {
		t.Errorf("{http.rate_limit_redis.allowed} = %v, want false", v)
	}
	if w.Header().Get("X-RateLimit-Limit") != "" || srv.ScriptCalls() != 0 {
		t.Errorf("a zone was decided: headers %v, %d script calls", w.Header(), srv.ScriptCalls())
	}
	// Enforced, the same request is a 403 HandlerError.
	h.DryRun = false
	_, err, nextCalled = serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
	var he caddyhttp.HandlerError
	if !errors.As(err, &he) || he.StatusCode != http.StatusForbidden || nextCalled ||
		he.Err.Error() != "zone ek_dry_user: every key placeholder is empty (empty_key deny)" {
		t.Fatalf("enforced: err %v (next %t), want the 403 of empty_key deny", err, nextCalled)
	}
	if srv.ScriptCalls() != 0 {
		t.Errorf("%d script calls, want none", srv.ScriptCalls())
	}
}

// TestJSONClientIPShorthand (a JSON config, json-clientip.json): "key":
// ["{client_ip}"] is Caddyfile shorthand, which Caddy does not expand in JSON. It is read as the
// Caddyfile reads it, {http.vars.client_ip}, with a warning at load, so each client has its own
// bucket; read as an unknown placeholder, always empty, five clients would share one bucket
// (200 200 200 429 429).
func TestJSONClientIPShorthand(t *testing.T) {
	srv := redistest.Start(t)
	port := freeport.Must(t)
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	cfg := fmt.Sprintf(`{
  "admin": {"disabled": true},
  "logging": {"logs": {"default": {"level": "DEBUG", "encoder": {"format": "json"},
    "writer": {"output": "file", "filename": %q, "roll": false}}}},
  "apps": {"http": {"servers": {"s": {
    "listen": ["127.0.0.1:%d"],
    "trusted_proxies": {"source": "static", "ranges": ["127.0.0.1/32"]},
    "routes": [{"handle": [
      {"handler": "rate_limit_redis", "redis": {"addresses": [%q]}, "key_prefix": "js:",
       "zones": [{"name": "json_perip", "key": ["{client_ip}"], "capacity": 3, "refill_rate": 0.0166}]},
      {"handler": "static_response", "body": "ip={http.vars.client_ip} key=[{http.rate_limit_redis.key}] remaining={http.rate_limit_redis.remaining}"}
    ]}]
  }}}}
}`, logFile, port, srv.Addr)
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := caddytest.LoadServing(t, []byte(cfg)); err != nil {
		t.Fatal(err)
	}
	cs := &caddytest.Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(port)}

	for i := 1; i <= 5; i++ {
		ip := "203.0.113." + strconv.Itoa(i)
		cs.Get("/", "X-Forwarded-For", ip).Expect(t, "client "+ip, 200, "ip="+ip+" key=["+ip+"] remaining=2")
	}
	ip := "203.0.113.1"
	cs.Get("/", "X-Forwarded-For", ip).Expect(t, "client 1 again", 200, "ip="+ip+" key=["+ip+"] remaining=1")

	b, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	var found int
	for l := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
		var f map[string]any
		if json.Unmarshal([]byte(l), &f) != nil || f["logger"] != "http.handlers.rate_limit_redis" {
			continue
		}
		if strings.HasPrefix(f["msg"].(string), "a key placeholder is Caddyfile shorthand") {
			found++
			if f["level"] != "warn" || f["zone"] != "json_perip" || f["key"] != "{client_ip}" || f["read_as"] != "{http.vars.client_ip}" {
				t.Errorf("warning: %s", l)
			}
		}
	}
	if found != 1 {
		t.Fatalf("%d shorthand warnings in the log, want 1:\n%s", found, b)
	}
}

// TestPlansEndToEnd: a map from the API key to a plan, three handlers (sites) sharing one Redis,
// 30 concurrent requests per key spread over the three: the free key gets exactly 3, the paid
// key exactly 10, every response with its own plan's numbers in the headers. Then the map is
// changed and Caddy reloaded: the free key, moved to the paid plan mid-window, gets exactly the
// difference at once (7; a token bucket stores what is used), and the paid key, moved to a plan
// of 25, exactly 15 more.
func TestPlansEndToEnd(t *testing.T) {
	srv := redistest.Start(t)
	before := planSite(srv.Addr, "\t\tkey-paid 10 10/1h\n\t\tdefault 3 3/1h")
	servers, reload := reloadableSites(t, "", before, before, before)
	if got := burst(t, servers, "key-free", 30, 3, 3600); got != 3 {
		t.Fatalf("free key: %d admitted of 30, want exactly 3", got)
	}
	if got := burst(t, servers, "key-paid", 30, 10, 3600); got != 10 {
		t.Fatalf("paid key: %d admitted of 30, want exactly 10", got)
	}
	after := planSite(srv.Addr, "\t\tkey-free 10 10/1h\n\t\tkey-paid 25 25/1h\n\t\tdefault 3 3/1h")
	reload(after, after, after)
	if got := burst(t, servers, "key-free", 30, 10, 3600); got != 7 {
		t.Fatalf("free key moved to the paid plan: %d admitted of 30, want exactly the difference, 7", got)
	}
	if got := burst(t, servers, "key-paid", 30, 25, 3600); got != 15 {
		t.Fatalf("paid key moved to a plan of 25: %d admitted of 30, want exactly 15", got)
	}
	if got := burst(t, servers, "key-other", 30, 3, 3600); got != 3 {
		t.Fatalf("another key on the default plan: %d admitted of 30, want exactly 3", got)
	}
}

// TestPlanChangeWithoutReload: with the numbers from a header (as a trusted gateway in front
// would set it; X-RateLimit-Limit and {http.rate_limit_redis.limit} say them), a client denied under a quota of 3, with its denial in the deny cache, is
// decided by Redis under a quota of 10 and gets exactly the difference, 7, at once; back under
// 3 it is denied again, with Retry-After. For every algorithm: each stores what is used, so a
// larger quota admits the difference, never a fresh quota.
func TestPlanChangeWithoutReload(t *testing.T) {
	if s := time.Now().Unix() % 3600; s > 3590 {
		time.Sleep(time.Duration(3601-s) * time.Second) // the windows of 1h must not turn over during the test
	}
	srv := redistest.Start(t)
	newFakeClock(t) // the handler's clock stands still: "quota 3 again" is within max_age
	servers, _ := reloadableSites(t, "", fmt.Sprintf(`
	rate_limit_redis_tuned clock=%s {
		redis {
			address %s
		}
		zone tb {
			match path /token_bucket
			key {http.request.header.X-Client}
			capacity {http.request.header.X-Quota}
			refill_rate 1/1h
		}
		zone sw {
			match path /sliding_window
			key {http.request.header.X-Client}
			algorithm sliding_window
			limit {http.request.header.X-Quota}
			window 1h
		}
		zone fw {
			match path /fixed_window
			key {http.request.header.X-Client}
			algorithm fixed_window
			limit {http.request.header.X-Quota}
			window 1h
		}
		zone sc {
			match path /sliding_window_counter
			key {http.request.header.X-Client}
			algorithm sliding_window_counter
			limit {http.request.header.X-Quota}
			window 1h
		}
	}
	respond "{http.rate_limit_redis.limit}"`, t.Name(), srv.Addr))
	cs := servers[0]
	for _, algorithm := range []string{"token_bucket", "sliding_window", "fixed_window", "sliding_window_counter"} {
		path := "/" + algorithm
		quota := func(q string) string {
			t.Helper()
			var codes []string
			for {
				r := cs.Get(path, "X-Client", "alice", "X-Quota", q)
				if r.Header.Get("X-RateLimit-Limit") != q || (r.Status == 200 && r.Body != q) {
					t.Fatalf("%s quota %s: X-RateLimit-Limit %q, {http.rate_limit_redis.limit} %q", algorithm, q, r.Header.Get("X-RateLimit-Limit"), r.Body)
				}
				codes = append(codes, strconv.Itoa(r.Status))
				if r.Status != 200 {
					return strings.Join(codes, " ")
				}
			}
		}
		if got := quota("3"); got != "200 200 200 429" {
			t.Fatalf("%s quota 3: %s", algorithm, got)
		}
		calls := srv.ScriptCalls()
		if r := cs.Get(path, "X-Client", "alice", "X-Quota", "3"); r.Status != 429 || srv.ScriptCalls() != calls {
			t.Fatalf("%s quota 3 again: %d with %d script calls, want 429 from the deny cache", algorithm, r.Status, srv.ScriptCalls()-calls)
		}
		if got := quota("10"); got != strings.Repeat("200 ", 7)+"429" {
			t.Fatalf("%s moved to quota 10: %s, want exactly 7 more", algorithm, got)
		}
		r := cs.Get(path, "X-Client", "alice", "X-Quota", "3")
		if ra, _ := strconv.Atoi(r.Header.Get("Retry-After")); r.Status != 429 || ra < 1 || r.Header.Get("X-RateLimit-Remaining") != "0" {
			t.Fatalf("%s back to quota 3 with 10 used: %d %v", algorithm, r.Status, r.Header)
		}
	}
}

// TestPlanHostileValues: zone numbers from a header a client could set, with hostile values:
// each is a 500 whose error (what Caddy logs, shown here by handle_errors)
// names the zone, the number, its placeholder and why, quoting at most 32 bytes of the value;
// none reaches Redis or charges anything. An empty value takes the fallback; without one it
// is a 500 too. In dry_run the request goes on.
func TestPlanHostileValues(t *testing.T) {
	srv := redistest.Start(t)
	site := func(dryRun string) string {
		return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		%s
		zone fallback {
			match path /fallback
			key {http.request.header.X-Client}
			capacity {http.request.header.X-Capacity} 5
			refill_rate 1/1h
		}
		zone bare {
			match path /bare
			key {http.request.header.X-Client}
			capacity {http.request.header.X-Capacity}
			refill_rate {http.request.header.X-Rate} 1/1h
		}
		zone window {
			match path /window
			key {http.request.header.X-Client}
			algorithm sliding_window
			limit {http.request.header.X-Limit} 5
			window {http.request.header.X-Window} 1h
		}
	}
	handle_errors {
		respond "{http.error.status_code} {http.error.message}"
	}
	respond "ok"`, srv.Addr, dryRun)
	}
	servers, _ := reloadableSites(t, "\t\tmax_header_size 256KB", site(""), site("dry_run"))
	cs, dry := servers[0], servers[1]
	digits := strings.Repeat("9", 100<<10)
	const capacityRange = " is out of range (1 to 9007199254740992)"
	const notRate = " is not a number of tokens, optionally per a duration (10, 100/1m)"
	for _, tc := range []struct {
		path, header, value, want string
	}{
		{"/fallback", "X-Capacity", "-1", `"-1"` + capacityRange},
		{"/fallback", "X-Capacity", "0", `"0"` + capacityRange},
		{"/fallback", "X-Capacity", "NaN", `"NaN" is not an integer`},
		{"/fallback", "X-Capacity", "1e309", `"1e309" is not an integer`},
		{"/fallback", "X-Capacity", "1.5", `"1.5" is not an integer`},
		{"/fallback", "X-Capacity", "9007199254740993", `"9007199254740993"` + capacityRange},
		{"/fallback", "X-Capacity", "99999999999999999999", `"99999999999999999999"` + capacityRange},
		{"/fallback", "X-Capacity", "{http.request.header.X-Capacity}", `"{http.request.header.X-Capacity}" is not an integer`},
		{"/fallback", "X-Capacity", digits, `"` + digits[:32] + `"… (102400 bytes) is too long: a number is at most 64 bytes`},
		{"/bare", "X-Rate", "NaN", `"NaN"` + notRate},
		{"/bare", "X-Rate", "1e309", `"1e309"` + notRate},
		{"/bare", "X-Rate", "-1", `"-1" must be > 0`},
		{"/bare", "X-Rate", "0", `"0" must be > 0`},
		{"/bare", "X-Rate", "5/0s", `"5/0s": the duration must be > 0`},
		{"/window", "X-Limit", "1000001", `"1000001" is out of range (1 to 1000000)`},
		{"/window", "X-Window", "0", `"0" is out of range (1ms to 366d)`},
		{"/window", "X-Window", "-1h", `"-1h" is out of range (1ms to 366d)`},
		{"/window", "X-Window", "1e309h", `"1e309h" is not a duration`},
		{"/window", "X-Window", "60", `"60" is not a duration`},
	} {
		zone := strings.TrimPrefix(tc.path, "/")
		headers := []string{"X-Client", "mallory", tc.header, tc.value}
		if zone == "bare" {
			headers = append(headers, "X-Capacity", "5")
		}
		placeholder := "{http.request.header." + tc.header + "}"
		number := map[string]string{"X-Capacity": "capacity", "X-Rate": "refill_rate", "X-Limit": "limit", "X-Window": "window"}[tc.header]
		want := fmt.Sprintf("500 zone %s: %s %s: %s", zone, number, placeholder, tc.want)
		cs.Get(tc.path, headers...).Expect(t, fmt.Sprintf("%s %s %.40q", tc.path, tc.header, tc.value), 500, want,
			"X-RateLimit-Limit", "", "Retry-After", "")
		dry.Get(tc.path, headers...).Expect(t, fmt.Sprintf("dry_run %s %s %.40q", tc.path, tc.header, tc.value), 200, "ok")
	}
	// The fill time of capacity and refill_rate together: 5 tokens at 1e-300/s.
	cs.Get("/bare", "X-Client", "mallory", "X-Capacity", "5", "X-Rate", "1e-300").Expect(t, "refill beyond 366d", 500,
		"500 zone bare: capacity 5 and refill_rate 1e-300: an empty bucket would take 5e+300s to refill; at most 366d is supported")
	// Empty: the fallback, or a 500 without one.
	cs.Get("/bare", "X-Client", "mallory").Expect(t, "empty without a fallback", 500,
		"500 zone bare: capacity {http.request.header.X-Capacity}: the placeholder is empty and capacity has no fallback "+
			"(write one after the placeholder: capacity {http.request.header.X-Capacity} <n>)")
	if n := srv.ScriptCalls(); n != 0 {
		t.Fatalf("%d script calls: a hostile number reached Redis", n)
	}
	cs.Get("/fallback", "X-Client", "mallory", "X-Capacity", "").Expect(t, "empty with a fallback", 200, "ok",
		"X-RateLimit-Limit", "5", "X-RateLimit-Remaining", "4")
	cs.Get("/fallback", "X-Client", "mallory").Expect(t, "absent with a fallback", 200, "ok",
		"X-RateLimit-Limit", "5", "X-RateLimit-Remaining", "3")
	cs.Get("/window", "X-Client", "mallory").Expect(t, "window, both empty: the fallbacks", 200, "ok",
		"X-RateLimit-Limit", "5", "X-RateLimit-Remaining", "4")
	cs.Get("/bare", "X-Client", "mallory", "X-Capacity", "2").Expect(t, "bare, a good value: nothing was charged before", 200, "ok",
		"X-RateLimit-Limit", "2", "X-RateLimit-Remaining", "1")
}

// TestPlanNumberErrorLogged: an unusable number is logged at error level by the handler's
// logger with the zone and the reason, also when handle_errors handles the 500 (Caddy then logs
// the handler's error at debug level only), and the value is quoted by its first 32 bytes.
func TestPlanNumberErrorLogged(t *testing.T) {
	srv := redistest.Start(t)
	lc := startLoggedCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone plan {
			capacity {http.request.header.X-Capacity}
			refill_rate 1
		}
	}
	handle_errors {
		respond "sorry" 500
	}
	respond "ok"`, srv.Addr))
	lc.Get("/", "X-Capacity", "-1"+strings.Repeat("0", 1000)).Expect(t, "hostile capacity", 500, "sorry")
	lines := withMsg(ours(lc.lines()), "a zone number from a placeholder is unusable")
	want := `zone plan: capacity {http.request.header.X-Capacity}: "-1000000000000000000000000000000"… (1002 bytes) is too long: a number is at most 64 bytes`
	if len(lines) != 1 || lines[0].fields["level"] != "error" || lines[0].fields["zone"] != "plan" || lines[0].fields["error"] != want {
		t.Fatalf("log lines %v, want one error line with %q", lines, want)
	}
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
		cs := caddytest.StartSites(t, "", site(srv.Addr))[0]
		if r := cs.Get("/", "X-API-Key", huge); r.Status != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("got %d %q, want 431", r.Status, r.Body)
		}
		if n := srv.ScriptCalls(); n != 0 {
			t.Fatalf("%d script calls: the request reached the limiter", n)
		}
		if keys := srv.Keys(t); len(keys) != 0 {
			t.Fatalf("Redis keys %q, want none", keys)
		}
	})

	t.Run("max_header_size 128KB", func(t *testing.T) {
		srv := redistest.Start(t)
		cs := caddytest.StartSites(t, "\t\tmax_header_size 128KB", site(srv.Addr))[0]
		cs.Get("/", "X-API-Key", huge).Expect(t, "first", 200, "ok", "X-RateLimit-Remaining", "1")
		cs.Get("/", "X-API-Key", huge).Expect(t, "second", 200, "ok", "X-RateLimit-Remaining", "0")
		cs.Get("/", "X-API-Key", huge).Expect(t, "third", 429, "")
		cs.Get("/", "X-API-Key", other).Expect(t, "a key differing in its last byte", 200, "ok", "X-RateLimit-Remaining", "1")

		keys := srv.Keys(t)
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
	cs := caddytest.StartSites(t, "", fmt.Sprintf(`
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
		cs.Get("/", "X-API-Key", raw).Expect(t, "key "+raw[:min(len(raw), 20)], 200, "ok", "X-RateLimit-Remaining", "4")
	}
	keys := srv.Keys(t)
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

// TestAbuseNULAndCRLF: NUL, CR and LF bytes. In a header they never reach the handler: Go's HTTP
// server answers 400 and Redis sees nothing. Through a placeholder that decodes them (a query
// parameter), each distinct value is its own client, counted under a digest in one hash tag.
func TestAbuseNULAndCRLF(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.StartSites(t, "", fmt.Sprintf(`
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
		status := rawRequest(t, cs.Base, "GET / HTTP/1.1\r\nHost: x\r\nX-API-Key: "+value+"\r\n\r\n")
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
		cs.Get(path).Expect(t, fmt.Sprintf("%q first", raw), 200, "ok", "X-RateLimit-Remaining", "1")
		cs.Get(path).Expect(t, fmt.Sprintf("%q second", raw), 200, "ok", "X-RateLimit-Remaining", "0")
		cs.Get(path).Expect(t, fmt.Sprintf("%q third", raw), 429, "")
	}
	keys := srv.Keys(t)
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
	redistest.WaitFor(t, window+30*time.Second, "every key expired", func() bool { return rdb.DBSize(ctx).Val() == 0 })
	// Within a third: Redis shrinks its tables in its cron, at its own pace on a loaded machine.
	redistest.WaitFor(t, 60*time.Second, "used_memory back within a third of the burst's", func() bool {
		return usedMemory(rdb.Info(ctx, "memory").Val())-baseline < (peak-baseline)/3
	})
	t.Logf("after expiry: used_memory %d bytes above the baseline (%d at the end of the burst)",
		usedMemory(rdb.Info(ctx, "memory").Val())-baseline, peak-baseline)
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

// reloadableSites is caddytest.StartSites that can load new site bodies on the same ports, as
// `caddy reload` does.
func reloadableSites(t *testing.T, serverOptions string, sites ...string) ([]*caddytest.Site, func(sites ...string)) {
	t.Helper()
	ports := make([]int, len(sites))
	servers := make([]*caddytest.Site, len(sites))
	for i := range sites {
		ports[i] = freeport.Must(t)
		servers[i] = &caddytest.Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(ports[i])}
	}
	load := func(sites ...string) {
		t.Helper()
		if err := caddytest.LoadCaddyfile(t, caddytest.Caddyfile("off", serverOptions, ports, sites)); err != nil {
			t.Fatalf("loading: %v", err)
		}
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	load(sites...)
	return servers, load
}

// burst sends n requests with the header X-API-Key: key at once, spread over servers, and
// returns how many were admitted; each response must be a 200 or a 429 with the plan's quota
// in X-RateLimit-Limit and RateLimit-Policy.
func burst(t *testing.T, servers []*caddytest.Site, key string, n int, quota int, window int) int {
	t.Helper()
	client := caddytest.Client(10 * time.Second)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		admitted int
		problems []string
	)
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, servers[i%len(servers)].Base+"/", nil)
			req.Header.Set("X-API-Key", key)
			<-start
			resp, err := client.Do(req)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				problems = append(problems, err.Error())
				return
			}
			resp.Body.Close()
			limit, policy := resp.Header.Get("X-RateLimit-Limit"), resp.Header.Get("RateLimit-Policy")
			wantPolicy := fmt.Sprintf(`"api";q=%d;w=%d`, quota, window)
			switch {
			case limit != strconv.Itoa(quota) || policy != wantPolicy:
				problems = append(problems, fmt.Sprintf("%d with X-RateLimit-Limit %q, RateLimit-Policy %q: want %d, %s", resp.StatusCode, limit, policy, quota, wantPolicy))
			case resp.StatusCode == 200:
				admitted++
			case resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "":
				problems = append(problems, fmt.Sprintf("status %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After")))
			}
		})
	}
	close(start)
	wg.Wait()
	if len(problems) > 0 {
		t.Fatalf("key %s: %d problems, the first: %s", key, len(problems), problems[0])
	}
	return admitted
}

// planSite is a site whose zone api takes its capacity and refill rate from a map of the API
// key: mappings is the map's body.
func planSite(addr, mappings string) string {
	return fmt.Sprintf(`
	map {http.request.header.X-API-Key} {plan_capacity} {plan_rate} {
%s
	}
	rate_limit_redis {
		redis {
			address %s
		}
		headers both
		timeout 2s # a loaded machine must not make a decision fail open: the test reads its headers
		zone api {
			key {http.request.header.X-API-Key}
			capacity {plan_capacity}
			refill_rate {plan_rate}
		}
	}
	respond "ok"`, mappings, addr)
}

// basicAuthHash is bcrypt (cost 4, fast under -race) of the password "secret".
const basicAuthHash = "$2a$04$xltt3zCfHZGgWaU6blmk1u/ptIfCjoT1xU.7HaP1/qGGoti2pmy9G"

func basicAuth(user, password string) string {
	return base64.StdEncoding.EncodeToString([]byte(user + ":" + password))
}

func withMsgPrefix(lines []logLine, prefix string) []logLine {
	var out []logLine
	for _, l := range lines {
		if m, _ := l.fields["msg"].(string); strings.HasPrefix(m, prefix) {
			out = append(out, l)
		}
	}
	return out
}
