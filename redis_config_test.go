package ratelimitredis

// The redis and tls config (redis_config.go): TLS with an ACL user, settings from placeholders
// that resolve empty, and a password that never shows in a log or an error.

import (
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestTLSAndACL: over TLS with a client certificate and an ACL user, decisions work; a wrong
// CA, a missing client certificate, a wrong password and an unreadable CA file each fail with an
// error that says what is wrong, and the password appears in none of them.
func TestTLSAndACL(t *testing.T) {
	const password = "s3cret-Pa55word"
	// An ACL user with the rules of docs/security.md: the limiter's keys and the scripts' commands only (the
	// default user stays open, for the test's own plain connection).
	srv := redistest.StartTLS(t, append([]string{"--user", "limiter", "on", ">" + password}, aclRules()...)...)
	zone := func() []*Zone { return []*Zone{{Name: "z", Capacity: NumberOf(2), RefillRate: NumberOf(0.001)}} }
	tlsOK := func() *TLSConfig {
		return &TLSConfig{CA: srv.CA, Cert: srv.ClientCert, Key: srv.ClientKey}
	}

	t.Run("works", func(t *testing.T) {
		for _, algo := range []string{"token_bucket", "sliding_window"} {
			z := zone()
			if algo == "sliding_window" {
				z = []*Zone{{Name: "w", Algorithm: algo, Limit: NumberOf(2), Window: NumberOf(caddy.Duration(time.Hour))}}
			}
			h := provisioned(t, &Handler{
				Redis:    &RedisConfig{Addresses: []string{srv.TLSAddr}, Username: "limiter", Password: password, TLS: tlsOK()},
				FailMode: FailClosed,
				Timeout:  caddy.Duration(time.Second), // the first decision dials and shakes hands, under -race
				Zones:    z,
			})
			for i, want := range []int{200, 200, 429} {
				if got := status(t, h); got != want {
					t.Fatalf("%s request %d: %d, want %d; ACL LOG: %v", algo, i+1, got, want, srv.Do("ACL", "LOG"))
				}
			}
			srv.Do("SCRIPT", "FLUSH") // the next handler meets NOSCRIPT, and EVAL
		}
	})

	for _, tc := range []struct {
		name string
		cfg  *RedisConfig
		want string
	}{
		{"wrong CA", &RedisConfig{Addresses: []string{srv.TLSAddr}, Username: "limiter", Password: password,
			TLS: &TLSConfig{CA: srv.OtherCA, Cert: srv.ClientCert, Key: srv.ClientKey}},
			"tls: failed to verify certificate: x509: certificate signed by unknown authority"},
		// TLS 1.3: the client's handshake is done before the server checks its certificate, so the
		// client sends its first command, and the server's alert ("certificate required") races
		// the reset of a socket closed with that command unread: the client reports either.
		{"no client certificate", &RedisConfig{Addresses: []string{srv.TLSAddr}, Username: "limiter", Password: password,
			TLS: &TLSConfig{CA: srv.CA}},
			"certificate required|connection reset by peer"},
		{"wrong password", &RedisConfig{Addresses: []string{srv.TLSAddr}, Username: "limiter", Password: password + "x", TLS: tlsOK()},
			"WRONGPASS invalid username-password pair or user is disabled"},
		{"plain to the TLS port", &RedisConfig{Addresses: []string{srv.TLSAddr}, Username: "limiter", Password: password},
			"redis decide script"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A timeout long enough for go-redis to finish its one retry (a TLS handshake
			// under -race takes tens of ms): with a shorter one the decision ends first, and
			// reports a timeout instead of the cause.
			h := provisioned(t, &Handler{Redis: tc.cfg, FailMode: FailClosed, Zones: zone(), Timeout: caddy.Duration(time.Second)})
			_, err, next := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
			var he caddyhttp.HandlerError
			if !errors.As(err, &he) || he.StatusCode != 503 || next {
				t.Fatalf("got err %v, next %t; want 503 (fail_mode closed)", err, next)
			}
			if !slices.ContainsFunc(strings.Split(tc.want, "|"), func(w string) bool { return strings.Contains(err.Error(), w) }) {
				t.Fatalf("error %q does not say %q", err, tc.want)
			}
			if strings.Contains(err.Error(), password) {
				t.Fatalf("error %q shows the password", err)
			}
		})
	}

	t.Run("unreadable CA at load", func(t *testing.T) {
		ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
		defer cancel()
		bad := srv.ClientKey // a PEM file with no certificate
		h := &Handler{Redis: &RedisConfig{Addresses: []string{srv.TLSAddr}, Password: password, TLS: &TLSConfig{CA: bad}}, Zones: zone()}
		err := h.Provision(ctx)
		if err == nil || !strings.Contains(err.Error(), "redis tls ca "+bad+": no PEM certificate found") {
			t.Fatalf("Provision: %v; want the CA file named as holding no certificate", err)
		}
		if strings.Contains(err.Error(), password) {
			t.Fatalf("error %q shows the password", err)
		}
		_ = h.Cleanup()
	})
}

// status serves one request and returns its status: the next handler's 200, or the handler
// error's status code.
func status(t *testing.T, h *Handler) int {
	t.Helper()
	_, err, next := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
	var he caddyhttp.HandlerError
	switch {
	case err == nil && next:
		return 200
	case errors.As(err, &he):
		return he.StatusCode
	}
	t.Fatalf("serve: err %v, next %t", err, next)
	return 0
}

// TestEmptyResolvedRedisSettingRefused: a Redis address, username, password (or sentinel, or tls
// file) that was written but is empty once its placeholders are replaced is a load error naming
// the placeholder, both in `caddy validate` (caddy.Validate) and in `caddy run` (caddy.Load),
// instead of dialling the default address or connecting without AUTH. With the variable set
// the same config loads, and with no address written the default applies.
func TestEmptyResolvedRedisSettingRefused(t *testing.T) {
	srv := redistest.Start(t)
	const zone = "\n\t\tzone a {\n\t\t\tcapacity 5\n\t\t\trefill_rate 1\n\t\t}\n\t}\n\trespond \"ok\""
	for name, tc := range map[string]struct{ redis, want string }{
		"address":      {"address {env.UNSET_NAME}", "redis address {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME is not set, or empty): set it, or leave out the address line"},
		"host":         {"address {env.UNSET_NAME}:6379", "redis address {env.UNSET_NAME}:6379: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME"},
		"cluster seed": {"address " + srv.Addr + " {env.UNSET_NAME}", "redis address {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME"},
		"quoted empty": {`address ""`, `redis address "" is empty: give host:port, or leave out the address line for the default 127.0.0.1:6379`},
		"username":     {"address " + srv.Addr + "\n\t\t\tusername {env.UNSET_NAME}", "redis username {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME"},
		"password":     {"address " + srv.Addr + "\n\t\t\tpassword {env.UNSET_NAME}", "redis password {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME is not set, or empty): set it, or leave out the password line"},
		"sentinel":     {"address " + srv.Addr + "\n\t\t\tsentinel {env.UNSET_NAME}", "redis sentinel {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME"},
		"tls ca":       {"address " + srv.Addr + "\n\t\t\ttls {\n\t\t\t\tca {env.UNSET_NAME}\n\t\t\t}", "redis tls ca {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME is not set, or empty): set it, or leave out the ca line"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Setenv("UNSET_NAME", "")
			site := "\trate_limit_redis {\n\t\tredis {\n\t\t\t" + tc.redis + "\n\t\t}" + zone
			cs := &caddytest.Site{T: t}
			port := freeport.Must(t)
			if err := validateSite(site, port); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("caddy validate: error %v, want one saying %q", err, tc.want)
			}
			err := cs.Load(site, port)
			if err == nil {
				_ = caddy.Stop()
				t.Fatalf("caddy run: config loaded; want an error saying %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("caddy run: error %q does not say %q", err, tc.want)
			}
		})
	}

	t.Run("set", func(t *testing.T) {
		t.Setenv("UNSET_NAME", srv.Addr)
		cs := caddytest.Start(t, "\trate_limit_redis {\n\t\tredis {\n\t\t\taddress {env.UNSET_NAME}\n\t\t}"+zone)
		cs.Get("/").Expect(t, "address from the environment", 200, "ok", "X-RateLimit-Remaining", "4")
	})
}

// TestPasswordNeverShows: a config whose Redis password comes from {env.*}, against a
// redis-server with requirepass, with the right password and then a wrong one. Neither password
// appears in any log line (all of Caddy's and the handler's, at DEBUG), in any error returned
// (Provision, Validate, ServeHTTP, Caddy's load) or in the adapted JSON.
func TestPasswordNeverShows(t *testing.T) {
	right, wrong := "right-"+rand.Text(), "wrong-"+rand.Text()
	secrets := []string{right, wrong}
	srv := redistest.StartWithPassword(t, right)
	t.Setenv("RL_TEST_REDIS_PASSWORD", right)
	site := fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
			password {env.RL_TEST_REDIS_PASSWORD}
		}
		timeout 2s # a loaded machine must not make a decision fail: the test expects Redis's answers
		fail_mode closed
		log_key
		capacity 1
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr)
	lc := startLoggedCaddy(t, site)

	// The right password: Redis decides.
	lc.Get("/").Expect(t, "authenticated", 200, "ok", "X-RateLimit-Limit", "1")
	lc.Get("/").Expect(t, "denied by Redis", 429, "", "Retry-After", "3600")

	// A wrong one: Redis refuses every connection, the breaker opens, fail_mode closed answers.
	t.Setenv("RL_TEST_REDIS_PASSWORD", wrong)
	if err := lc.load(site); err != nil {
		t.Fatalf("reload: %v", err)
	}
	for i := 0; i < breakerTrips+2; i++ {
		lc.Get("/").Expect(t, "wrong password", 503, "", "Retry-After", "1")
	}

	// Errors returned by the handler itself, with the password from the environment and
	// written literally.
	var errs []error
	for _, password := range []string{"{env.RL_TEST_REDIS_PASSWORD}", wrong} {
		// pool_size apart from Caddy's handler: a client of its own, whose breaker is closed.
		redisCfg := func() *RedisConfig {
			return &RedisConfig{Addresses: []string{srv.Addr}, Password: password, PoolSize: 3}
		}
		zones := func() []*Zone { return []*Zone{{Name: "pw", Capacity: NumberOf(5), RefillRate: NumberOf(1)}} }
		// Provision fails: a TLS CA file that does not exist.
		h := &Handler{Redis: redisCfg(), Zones: zones()}
		h.Redis.TLS = &TLSConfig{CA: "/nonexistent/ca.pem"}
		errs = append(errs, provisionErr(t, h))
		// Validate fails: no zone.
		errs = append(errs, provisionErr(t, &Handler{Redis: redisCfg()}))
		// ServeHTTP fails: Redis refuses the password (fail_mode closed: the 503's error).
		observed, logs := observer.New(zapcore.DebugLevel)
		h = provisioned(t, &Handler{Redis: redisCfg(), FailMode: FailClosed, Zones: zones()})
		h.logger = zap.New(observed)
		_, err, _ := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
		var he caddyhttp.HandlerError
		if !errors.As(err, &he) || he.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("ServeHTTP with a wrong password: %v, want a 503", err)
		}
		if !strings.Contains(err.Error(), "WRONGPASS") {
			t.Fatalf("ServeHTTP with a wrong password: %v, want Redis's WRONGPASS", err)
		}
		errs = append(errs, err)
		for _, e := range logs.All() {
			b, _ := json.Marshal(e.ContextMap())
			for _, s := range secrets {
				if strings.Contains(e.Message+string(b), s) {
					t.Errorf("a log line of a provisioned handler holds a password: %s %s", e.Message, b)
				}
			}
		}
		if logs.Len() == 0 {
			t.Error("the handler logged nothing of the failure: the check above saw nothing")
		}
	}
	// Caddy's load of a JSON config that fails with a password in it.
	errs = append(errs, caddy.Load([]byte(fmt.Sprintf(`{"admin":{"disabled":true},"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:0"],
		"routes":[{"handle":[{"handler":"rate_limit_redis","redis":{"addresses":["a:1","b:2"],"db":3,"password":%q},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}]}]}}}}}`, wrong)), true))

	for _, err := range errs {
		if err == nil {
			t.Fatal("an expected error is nil")
		}
		for _, s := range secrets {
			for _, text := range []string{err.Error(), fmt.Sprintf("%+v", err), fmt.Sprintf("%#v", err)} {
				if strings.Contains(text, s) {
					t.Errorf("an error holds a password: %s", text)
				}
			}
		}
	}

	lines := lc.lines()
	if len(withMsg(ours(lines), "redis failing: circuit breaker open; fail_mode applies without calling redis")) != 1 ||
		len(withMsg(ours(lines), "rate limited")) != 1 || len(withMsg(lines, "handled request")) == 0 {
		t.Fatalf("the logs lack the lines this test reads for a password (breaker open, denial, access): %d lines", len(lines))
	}
	for _, l := range lines {
		for _, s := range secrets {
			if strings.Contains(l.raw, s) {
				t.Errorf("a log line holds a password: %s", l.raw)
			}
		}
	}
	for _, cfg := range lc.adapted {
		for _, s := range secrets {
			if strings.Contains(string(cfg), s) {
				t.Errorf("the adapted JSON holds a password: %s", cfg)
			}
		}
		if !strings.Contains(string(cfg), `"password":"{env.RL_TEST_REDIS_PASSWORD}"`) {
			t.Errorf("the adapted JSON lacks the placeholder: %s", cfg)
		}
	}

	// Why docs/caddyfile.md says {env.*}: Caddyfile {$VAR} is replaced when the Caddyfile is adapted,
	// so the password is then in the JSON config (and in Caddy's admin API).
	adapted, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(":80 {\n\trate_limit_redis {\n\t\tredis {\n\t\t\tpassword {$RL_TEST_REDIS_PASSWORD}\n\t\t}\n\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(adapted), wrong) {
		t.Errorf("{$VAR} no longer puts the value in the adapted JSON; the advice of docs/caddyfile.md needs revisiting: %s", adapted)
	}
}

// validateSite adapts the site as caddytest.Site.Load does and validates it as `caddy validate`
// does: provisioned, never started.
func validateSite(site string, port int) error {
	caddyfile := fmt.Sprintf("{\n\tadmin off\n\tauto_https off\n\tpersist_config off\n}\n:%d {\n\tbind 127.0.0.1\n%s\n}\n", port, site)
	cfgJSON, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	if err != nil {
		return err
	}
	var cfg caddy.Config
	if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
		return err
	}
	return caddy.Validate(&cfg)
}
