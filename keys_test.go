package ratelimitredis

// Client keys, end to end through Caddy and a real Redis: the key candidates of a zone have
// namespaces of their own (an X-API-Key header equal to an IP address is not that IP), and
// key_secret replaces every client key by a keyed digest.

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/clientip"
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
	cs := startSites(t, "\t\ttrusted_proxies static 127.0.0.1/8", fmt.Sprintf(`
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

	cs.get("/", "X-Forwarded-For", victim).expect(t, "victim 1", 200, "2="+victim, "X-RateLimit-Remaining", "3")
	for i := 1; i <= 4; i++ {
		// Its own bucket, full at first: 3 2 1 0, not the victim's 2 1 0 then 429.
		cs.get("/", "X-Forwarded-For", attacker, "X-API-Key", victim).expect(t, "attacker "+strconv.Itoa(i), 200, victim,
			"X-RateLimit-Remaining", strconv.Itoa(4-i))
	}
	cs.get("/", "X-Forwarded-For", attacker, "X-API-Key", victim).expect(t, "attacker 5", 429, "")
	cs.get("/", "X-Forwarded-For", attacker, "X-API-Key", "2="+victim).expect(t, "attacker mimicking the IP candidate", 200,
		"1=2="+victim, "X-RateLimit-Remaining", "3")
	for i := 2; i <= 4; i++ {
		cs.get("/", "X-Forwarded-For", victim).expect(t, "victim "+strconv.Itoa(i), 200, "2="+victim,
			"X-RateLimit-Remaining", strconv.Itoa(4-i))
	}
	cs.get("/", "X-Forwarded-For", victim).expect(t, "victim 5: its burst of 4 spent by itself alone", 429, "")
	cs.get("/", "X-Forwarded-For", attacker).expect(t, "the attacker's IP", 200, "2="+attacker, "X-RateLimit-Remaining", "3")

	keys := redisKeys(t, srv)
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

// TestAdminCandidateKeys: the admin API takes the client key as {http.rate_limit_redis.key}
// shows it, so the second candidate's as `2=<value>`, and says which candidate it is; the first
// candidate's key with the same value is another client.
func TestAdminCandidateKeys(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone api {
			key {http.request.header.X-API-Key} {client_ip}
			capacity 2
			refill_rate 1/1h
		}
	}
	respond "{http.rate_limit_redis.key}"`, srv.Addr))

	shown := ac.get("/").body // the IP candidate's key, as the placeholder shows it
	if shown != "2=127.0.0.1" {
		t.Fatalf("placeholder %q, want 2=127.0.0.1", shown)
	}
	ac.get("/").expect(t, "by IP 2", 200, shown, "X-RateLimit-Remaining", "0")
	ac.get("/").expect(t, "by IP 3", 429, "")
	ac.get("/", "X-API-Key", "127.0.0.1").expect(t, "an API key equal to the IP", 200, "127.0.0.1", "X-RateLimit-Remaining", "1")

	st := adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape(shown), 200)
	if len(st) != 1 || st[0].Key != shown || st[0].Candidate != 2 || st[0].RedisKey != "rl:{2=127.0.0.1}:api:tb" ||
		!st[0].Exists || st[0].Remaining != 0 {
		t.Fatalf("state of %s: %+v", shown, st)
	}
	for _, key := range []string{"127.0.0.1", "1=127.0.0.1"} {
		st = adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape(key), 200)
		if len(st) != 1 || st[0].Key != key || st[0].Candidate != 1 || st[0].RedisKey != "rl:{127.0.0.1}:api:tb" ||
			!st[0].Exists || st[0].Remaining != 1 {
			t.Fatalf("state of %s: %+v", key, st)
		}
	}
	reset := adminJSON[[]resetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape(shown), 200)
	if fmt.Sprint(reset) != fmt.Sprint([]resetResult{{Zone: "api", Key: shown, Candidate: 2, RedisKey: "rl:{2=127.0.0.1}:api:tb", Redis: []string{srv.Addr}, Deleted: true, Broadcast: true}}) {
		t.Fatalf("reset: %+v", reset)
	}
	ac.get("/").expect(t, "by IP after the reset", 200, shown, "X-RateLimit-Remaining", "1")
	if srv.Do("EXISTS", "rl:{127.0.0.1}:api:tb") != int64(1) {
		t.Fatal("resetting the IP candidate's key deleted the API key's")
	}
	ac.expectError(t, "GET", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape("0=x"), 400,
		"key: candidates are counted from 1 (0= is no client key's): give the key as {http.rate_limit_redis.key} shows it")
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
	sites := startSites(t, "", site("{env.RL_TEST_KEY_SECRET}"), site(secret), site(other))
	a, b, c := sites[0], sites[1], sites[2]
	const apiKey = "sk-live-4f9a2c"
	a.get("/", "X-API-Key", apiKey).expect(t, "site A", 200, apiKey, "X-RateLimit-Remaining", "2")
	b.get("/", "X-API-Key", apiKey).expect(t, "site B, same secret: same bucket", 200, apiKey, "X-RateLimit-Remaining", "1")
	c.get("/", "X-API-Key", apiKey).expect(t, "site C, another secret: another bucket", 200, apiKey, "X-RateLimit-Remaining", "2")
	a.get("/").expect(t, "site A by IP", 200, "2=127.0.0.1", "X-RateLimit-Remaining", "2")
	a.get("/", "X-API-Key", "127.0.0.1").expect(t, "site A, the IP as an API key", 200, "127.0.0.1", "X-RateLimit-Remaining", "2")

	keys := redisKeys(t, srv)
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

// TestAdminKeySecret: with key_secret the admin API maps the key it is given (as the
// placeholder shows it) through the same secret, and reports the keyed Redis key.
func TestAdminKeySecret(t *testing.T) {
	srv := redistest.Start(t)
	secret := "admin-" + rand.Text()
	t.Setenv("RL_TEST_KEY_SECRET", secret)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key_secret {env.RL_TEST_KEY_SECRET}
		zone api {
			key {http.request.header.X-API-Key} {client_ip}
			capacity 1
			refill_rate 1/1h
		}
	}
	respond "{http.rate_limit_redis.key}"`, srv.Addr))
	ks := limiter.NewKeySecret([]byte(secret))
	for _, key := range []string{"alice", "2=127.0.0.1"} {
		var hdr []string
		if key == "alice" {
			hdr = []string{"X-API-Key", "alice"}
		}
		ac.get("/", hdr...).expect(t, key+" 1", 200, key)
		ac.get("/", hdr...).expect(t, key+" 2", 429, "")
		redisKey := limiter.StateKey("rl:", tbZone("api"), ks.Key(key))
		st := adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape(key), 200)
		if len(st) != 1 || st[0].Key != key || st[0].RedisKey != redisKey || !keyedTag.MatchString(hashTag(redisKey)) ||
			!st[0].Exists || st[0].Remaining != 0 {
			t.Fatalf("state of %s: %+v, want Redis key %s", key, st, redisKey)
		}
		reset := adminJSON[[]resetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape(key), 200)
		if len(reset) != 1 || !reset[0].Deleted || reset[0].RedisKey != redisKey {
			t.Fatalf("reset of %s: %+v", key, reset)
		}
		ac.get("/", hdr...).expect(t, key+" after the reset", 200, key)
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
	lc.get("/", "X-API-Key", "k").expect(t, "allowed", 200, "ok")
	lc.get("/", "X-API-Key", "k").expect(t, "denied", 429, "")
	lc.get("/", "X-API-Key", "k").expect(t, "denied from the deny cache", 429, "")
	t.Setenv("RL_TEST_KEY_SECRET", second)
	if err := lc.load(site); err != nil {
		t.Fatalf("reload: %v", err)
	}
	lc.get("/", "X-API-Key", "k").expect(t, "another secret: a new bucket", 200, "ok")
	lc.get("/", "X-API-Key", "k").expect(t, "denied under the new secret", 429, "")
	srv.Stop()
	lc.get("/", "X-API-Key", "k2").expect(t, "redis down", 200, "ok")

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

// TestKeySecretConfigErrors: the JSON path rejects a key_secret that is short once its
// placeholders are replaced, or that holds a placeholder not known at load, and names the field.
func TestKeySecretConfigErrors(t *testing.T) {
	t.Setenv("RL_TEST_EMPTY", "")
	for name, tc := range map[string]struct{ secret, want string }{
		"short literal":         {"fifteen bytes..", errKeySecretShort.Error()},
		"unset variable":        {"{env.RL_TEST_EMPTY}", errKeySecretShort.Error()},
		"request placeholder":   {"{http.request.header.X-Secret}", errKeySecretPlaceholder.Error()},
		"braces left by escape": {`\{0123456789abcdef}`, errKeySecretPlaceholder.Error()},
	} {
		t.Run(name, func(t *testing.T) {
			err := provisionErr(t, &Handler{KeySecret: tc.secret, Zones: []*Zone{{Name: "a", Capacity: NumberOf(1), RefillRate: NumberOf(1)}}})
			if err == nil || err.Error() != tc.want {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
		})
	}
	if errKeySecretShort.Error() != "key_secret must be at least 16 bytes, placeholders replaced: use 32 random bytes, such as the output of `openssl rand -base64 32`" {
		t.Fatalf("error text: %q", errKeySecretShort)
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
	cs := startCaddy(t, fmt.Sprintf(`
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
		if r := cs.get("/", hdr...); r.status != want {
			t.Fatalf("%s: %d %q, want %d", step, r.status, r.body, want)
		}
	}
	status("wrong password", auth("alice", "guess"), 401)
	cs.get("/", auth("alice", "alice-pw")...).expect(t, "alice 1", 200, "hello alice")
	cs.get("/", auth("alice", "alice-pw")...).expect(t, "alice 2", 200, "hello alice")
	status("alice 3: her user zone", auth("alice", "alice-pw"), 429)
	cs.get("/", auth("bob", "bob-pw")...).expect(t, "bob: his own user bucket", 200, "hello bob")
	status("wrong password again", auth("alice", "guess2"), 401)
	status("the IP zone caps guessing", auth("alice", "guess3"), 429)

	keys := redisKeys(t, srv)
	slices.Sort(keys)
	if want := []string{"rl:{127.0.0.1}:ip:tb", "rl:{alice}:user:tb", "rl:{bob}:user:tb"}; !slices.Equal(keys, want) {
		t.Fatalf("Redis keys %q, want %q: the failed logins must not reach the user zone", keys, want)
	}
}

// TestExamplesAreSafe runs Caddyfile.example and deploy/Caddyfile (ports moved to free loopback
// ports, the admin API off) against a real Redis and checks what makes them safe as written: a
// client inventing a new X-API-Key per request is stopped by the ip zone, and the login zone
// covers /login/, /login/… and /LOGIN as well as /login.
func TestExamplesAreSafe(t *testing.T) {
	for _, ex := range []struct {
		file       string
		ipBurst    int     // the ip zone's capacity
		ipPerSec   float64 // its refill rate, per second
		ipRefillAs string  // as the file writes it
	}{
		{"Caddyfile.example", 40, 0.5, "1 per 2s"},
		{composeCaddyfile, 100, 10, "10 a second"}, // deploy/traffic.sh sends about 9 a second from one address
	} {
		file := ex.file
		t.Run(file, func(t *testing.T) {
			srv := redistest.Start(t)
			src, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			site := freeLoopbackPort(t)
			caddyfile := string(src)
			for _, r := range [][2]string{
				{"\tadmin localhost:2019\n", "\tadmin off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n"},
				{"\tadmin {$ADMIN_ADDRESS:localhost:2019}\n", "\tadmin off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n"},
				{"\n:8080 {\n", fmt.Sprintf("\n:%d {\n\tbind 127.0.0.1\n", site)},
				{"\n{$SITE_ADDRESS::8080} {\n", fmt.Sprintf("\n:%d {\n\tbind 127.0.0.1\n", site)},
				{"\n:2020 {\n", fmt.Sprintf("\n:%d {\n\tbind 127.0.0.1\n", freeLoopbackPort(t))},
			} {
				caddyfile = strings.Replace(caddyfile, r[0], r[1], 1)
			}
			t.Setenv("REDIS_ADDR", srv.Addr)
			t.Cleanup(func() { _ = caddy.Stop() })
			if err := loadCaddyfile(t, caddyfile); err != nil {
				t.Fatal(err)
			}
			cs := &caddyServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(site)}

			// 3 logins per minute per IP, whatever the form of the path (each with a new API
			// key, so that only the login and ip zones can deny). deploy/Caddyfile's /login asks
			// for a password (basic_auth): a 401, which its zone login counts (count_status).
			login := 200
			if file == composeCaddyfile {
				login = 401
			}
			for i, path := range []string{"/login", "/login/", "/LOGIN/x"} {
				if r := cs.get(path, "X-API-Key", "login"+strconv.Itoa(i)); r.status != login {
					t.Fatalf("login %d (%s): %d %q, want %d", i+1, path, r.status, r.body, login)
				}
			}
			for _, path := range []string{"/login", "/login/", "/login/x", "/Login", "/login%2F"} {
				r := cs.get(path, "X-API-Key", "login-4"+path)
				if r.status != 429 || !strings.Contains(r.body, `"zone":"login"`) {
					t.Fatalf("4th login (%s): %d %q, want 429 from zone login", path, r.status, r.body)
				}
			}
			// What docs/caddyfile.md warns of: a form the match does not list is not the login zone's.
			if r := cs.get("/login;jsessionid=1", "X-API-Key", "login-5"); r.status != login {
				t.Fatalf("/login;jsessionid=1: %d %q; docs/caddyfile.md says path /login /login/* does not match it", r.status, r.body)
			}

			// A new API key per request: each has a full api bucket, but the ip zone (a burst
			// of ex.ipBurst, then ex.ipRefillAs) stops them. 4 requests of the IP are spent above.
			start := time.Now()
			admitted := 0
			for ; admitted <= 10*ex.ipBurst; admitted++ {
				r := cs.get("/", "X-API-Key", "rotated-"+strconv.Itoa(admitted))
				if r.status == 429 {
					if !strings.Contains(r.body, `"zone":"ip"`) {
						t.Fatalf("rotated key %d: %q, want a 429 from zone ip", admitted, r.body)
					}
					break
				}
				if r.status != 200 {
					t.Fatalf("rotated key %d: %d %q", admitted, r.status, r.body)
				}
			}
			refilled := int(time.Since(start).Seconds()*ex.ipPerSec) + 1
			if want := ex.ipBurst - 4; admitted < want || admitted > want+refilled {
				t.Fatalf("%d rotated keys admitted, want %d (%d less the 4 above) plus at most %d refilled", admitted, want, ex.ipBurst, refilled)
			}
		})
	}
}

// TestKeyPlaceholderLookedUpAsReplaceAll checks that a key entry made of one placeholder, looked
// up directly (keySources), resolves exactly as Caddy's ReplaceAll resolves it with Caddy's own
// HTTP placeholders: static strings, numbers, booleans, unknown and empty placeholders; request
// header fields (missing, empty, repeated, a name not in canonical case, a field changed in place
// by a handler before this one); variables (client_ip, a number, missing); and entries that are
// not one placeholder.
func TestKeyPlaceholderLookedUpAsReplaceAll(t *testing.T) {
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
