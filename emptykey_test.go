package ratelimitredis

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

const metricEmptyKeys = "caddy_rate_limit_redis_empty_key_total"

// basicAuthHash is bcrypt (cost 4, fast under -race) of the password "secret".
const basicAuthHash = "$2a$04$xltt3zCfHZGgWaU6blmk1u/ptIfCjoT1xU.7HaP1/qGGoti2pmy9G"

// authMsg is the start of the warning logged at load for a key placeholder of authentication.
const authMsg = "a key placeholder is set by authentication"

// TestEmptyKeyAnonymousClient ports the security review's finding: a zone keyed on
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
				lc.get("/").expect(t, "anonymous "+strconv.Itoa(i)+": admitted, then refused by basic_auth", 401, "")
			}
			lc.get("/").expect(t, "anonymous 4: the shared bucket is empty", 429, "", "Retry-After", "3600", "X-RateLimit-Limit", "3")
			lc.get("/", alice...).expect(t, "alice, locked out by the anonymous client", 429, "", "Retry-After", "3600")
		}, 5},
		{EmptyKeySkip, func(t *testing.T, lc *loggedCaddy) {
			for i := 1; i <= 5; i++ {
				lc.get("/").expect(t, "anonymous "+strconv.Itoa(i)+": not limited", 401, "", "X-RateLimit-Limit", "")
			}
			for i := 1; i <= 5; i++ {
				lc.get("/", alice...).expect(t, "alice "+strconv.Itoa(i)+": not limited", 200, "user=alice", "X-RateLimit-Limit", "")
			}
		}, 10},
		{EmptyKeyDeny, func(t *testing.T, lc *loggedCaddy) {
			lc.get("/").expect(t, "anonymous", 403, "", "Retry-After", "", "X-RateLimit-Limit", "")
			lc.get("/", alice...).expect(t, "alice: the key is empty before basic_auth", 403, "", "Retry-After", "")
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
			lc.get("/").expect(t, "anonymous: refused by basic_auth first", 401, "")
		}
		for i := 1; i <= 3; i++ {
			lc.get("/", alice...).expect(t, "alice "+strconv.Itoa(i), 200, "user=alice key=alice",
				"X-RateLimit-Remaining", strconv.Itoa(3-i))
		}
		lc.get("/", alice...).expect(t, "alice over her limit", 429, "", "Retry-After", "3600")
		lc.get("/", bob...).expect(t, "bob has a bucket of his own", 200, "user=bob key=bob", "X-RateLimit-Remaining", "2")
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

func basicAuth(user, password string) string {
	return base64.StdEncoding.EncodeToString([]byte(user + ":" + password))
}

// TestJSONClientIPShorthand ports the review's JSON config (json-clientip.json): "key":
// ["{client_ip}"] is Caddyfile shorthand, which Caddy does not expand in JSON; it used to be an
// unknown placeholder, always empty, so five clients shared one bucket (200 200 200 429 429).
// It is now read as the Caddyfile reads it, {http.vars.client_ip}, with a warning at load: each
// client has its own bucket.
func TestJSONClientIPShorthand(t *testing.T) {
	srv := redistest.Start(t)
	port := freeLoopbackPort(t)
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
	if err := loadServing(t, []byte(cfg)); err != nil {
		t.Fatal(err)
	}
	cs := &caddyServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(port)}

	for i := 1; i <= 5; i++ {
		ip := "203.0.113." + strconv.Itoa(i)
		cs.get("/", "X-Forwarded-For", ip).expect(t, "client "+ip, 200, "ip="+ip+" key=["+ip+"] remaining=2")
	}
	ip := "203.0.113.1"
	cs.get("/", "X-Forwarded-For", ip).expect(t, "client 1 again", 200, "ip="+ip+" key=["+ip+"] remaining=1")

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

// TestPlaceholderChecks: what Provision expands and warns about in key and cost placeholders,
// and the valid placeholders it leaves alone.
func TestPlaceholderChecks(t *testing.T) {
	for _, tc := range []struct {
		key, readAs string
		warnings    []string // "msg prefix|placeholder|did_you_mean"
	}{
		// Valid: no warning, unchanged.
		{key: "{http.request.header.X-API-Key}"},
		{key: "{http.request.cookie.session}"},
		{key: "{http.vars.client_ip}"},
		{key: "{http.vars.tier}"},
		{key: "{env.TENANT}"},
		{key: "{http.request.remote.host}"},
		{key: "{http.request.remote.host/24,64}"},
		{key: "{http.request.host}"},
		{key: "{http.request.host.labels.1}"},
		{key: "{http.request.uri.path.0}"},
		{key: "{http.request.uri.query.key}"},
		{key: "{http.request.tls.client.fingerprint}"},
		{key: "{http.regexp.tenant.1}"},
		{key: "{tier}"},        // a `map` output
		{key: "{file.tenant}"}, // in JSON, Caddy's placeholder of a file's contents
		{key: "static-key"},
		// Caddyfile shorthands: expanded as the Caddyfile does.
		{key: "{client_ip}", readAs: "{http.vars.client_ip}", warnings: []string{"a key placeholder is Caddyfile shorthand||"}},
		{key: "{header.X-API-Key}", readAs: "{http.request.header.X-API-Key}", warnings: []string{"a key placeholder is Caddyfile shorthand||"}},
		{key: "{remote_host}", readAs: "{http.request.remote.host}", warnings: []string{"a key placeholder is Caddyfile shorthand||"}},
		{key: "user-{vars.user}", readAs: "user-{http.vars.user}", warnings: []string{"a key placeholder is Caddyfile shorthand||"}},
		// Never a value where the handler runs by default.
		{key: "{http.auth.user.id}", warnings: []string{authMsg + "|{http.auth.user.id}|"}},
		// Not placeholders Caddy provides.
		{key: "{http.request.headers.X-API-Key}", warnings: []string{"a key placeholder is not one Caddy provides|{http.request.headers.X-API-Key}|{http.request.header.X-API-Key}"}},
		{key: "{http.request.client_ip}", warnings: []string{"a key placeholder is not one Caddy provides|{http.request.client_ip}|{http.vars.client_ip}"}},
		{key: "{http.request.uri.path.first}", warnings: []string{"a key placeholder is not one Caddy provides|{http.request.uri.path.first}|"}},
		{key: "{http.request.header.}", warnings: []string{"a key placeholder is not one Caddy provides|{http.request.header.}|"}},
	} {
		t.Run(tc.key, func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			z := &Zone{Name: "pc", Key: []string{tc.key}, Cost: "1", EmptyKey: EmptyKeyShared}
			z.checkPlaceholders(zap.New(core))
			want := tc.readAs
			if want == "" {
				want = tc.key
			}
			if z.Key[0] != want {
				t.Errorf("read as %q, want %q", z.Key[0], want)
			}
			var got []string
			for _, e := range logs.All() {
				m := e.ContextMap()
				got = append(got, fmt.Sprintf("%s|%v|%v", e.Message, orEmpty(m["placeholder"]), orEmpty(m["did_you_mean"])))
			}
			if len(got) != len(tc.warnings) {
				t.Fatalf("warnings %q, want %q", got, tc.warnings)
			}
			for i, w := range tc.warnings {
				prefix, rest, _ := strings.Cut(w, "|")
				if !strings.HasPrefix(got[i], prefix) || !strings.HasSuffix(got[i], "|"+rest) {
					t.Errorf("warning %q, want %q", got[i], w)
				}
			}
		})
	}
	// The cost is checked too: a shorthand there is expanded.
	core, logs := observer.New(zapcore.WarnLevel)
	z := &Zone{Name: "pc", Key: []string{"{http.vars.client_ip}"}, Cost: "{header.X-Cost}"}
	z.checkPlaceholders(zap.New(core))
	if z.Cost != "{http.request.header.X-Cost}" || logs.Len() != 1 {
		t.Errorf("cost read as %q with %d warnings, want {http.request.header.X-Cost} and 1", z.Cost, logs.Len())
	}
}

func orEmpty(v any) any {
	if v == nil {
		return ""
	}
	return v
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
