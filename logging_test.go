package ratelimitredis

import (
	"context"
	"crypto/rand"
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
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// loggedCaddy is Caddy run in this process (as startCaddy does) with every log at DEBUG, as
// JSON, written to files: Caddy's default log (which the handler's ctx.Logger() and the
// circuit breaker write to, and Caddy its own lines and handler errors) and the site's access log.
type loggedCaddy struct {
	*caddyServer
	port    int
	logDir  string
	adapted [][]byte // the JSON of every config loaded
}

func startLoggedCaddy(t *testing.T, site string) *loggedCaddy {
	t.Helper()
	port := freeLoopbackPort(t)
	lc := &loggedCaddy{
		caddyServer: &caddyServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(port)},
		port:        port,
		logDir:      t.TempDir(),
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := lc.load(site); err != nil {
		t.Fatal(err)
	}
	return lc
}

// load adapts and loads the site (again: a reload) with loadServing, keeping the adapted JSON.
func (lc *loggedCaddy) load(site string) error {
	caddyfile := fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
	log {
		output file %s {
			roll_disabled
		}
		format json
		level DEBUG
	}
}

:%d {
	bind 127.0.0.1
	log {
		output file %s {
			roll_disabled
		}
		format json
	}
%s
}
`, filepath.Join(lc.logDir, "caddy.log"), lc.port, filepath.Join(lc.logDir, "access.log"), site)
	cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	if err != nil {
		return fmt.Errorf("adapting: %w", err)
	}
	lc.adapted = append(lc.adapted, cfg)
	return loadServing(lc.t, cfg)
}

// logLine is one JSON log line, as written and as decoded.
type logLine struct {
	raw    string
	fields map[string]any
}

// lines returns every line written to the logs so far. Caddy writes them synchronously, so a
// request's lines are there once its response has come.
func (lc *loggedCaddy) lines() []logLine {
	lc.t.Helper()
	var out []logLine
	for _, name := range []string{"caddy.log", "access.log"} {
		b, err := os.ReadFile(filepath.Join(lc.logDir, name))
		if err != nil && !os.IsNotExist(err) {
			lc.t.Fatal(err)
		}
		for l := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
			if l == "" {
				continue
			}
			var f map[string]any
			if err := json.Unmarshal([]byte(l), &f); err != nil {
				lc.t.Fatalf("%s: a line that is not JSON: %q", name, l)
			}
			out = append(out, logLine{raw: l, fields: f})
		}
	}
	return out
}

// ours returns the lines of the handler's logger (ctx.Logger() and the circuit breaker).
func ours(lines []logLine) []logLine {
	var out []logLine
	for _, l := range lines {
		if l.fields["logger"] == "http.handlers.rate_limit_redis" {
			out = append(out, l)
		}
	}
	return out
}

func withMsg(lines []logLine, msg string) []logLine {
	var out []logLine
	for _, l := range lines {
		if l.fields["msg"] == msg {
			out = append(out, l)
		}
	}
	return out
}

// TestLogKey: the handler logs one debug line per denial (from Redis or from the deny cache)
// with the zone, limit, remaining, retry_after and how it was decided; the client key is in it
// only with log_key, and no other line of the handler ever holds it.
func TestLogKey(t *testing.T) {
	const key = "client-key-Zq7wX" // appears nowhere but in the requests' X-Client header
	for _, logKey := range []bool{false, true} {
		t.Run("log_key="+strconv.FormatBool(logKey), func(t *testing.T) {
			option := ""
			if logKey {
				option = "log_key"
			}
			srv := redistest.Start(t)
			lc := startLoggedCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		%s
		deny_cache {
			max_age 1h # the third request is answered from the cache however slow the machine
		}
		zone lk {
			key {http.request.header.X-Client}
			capacity 1
			refill_rate 1/1h
		}
	}
	respond "ok"`, srv.Addr, option))
			lc.get("/", "X-Client", key).expect(t, "allowed", 200, "ok")
			lc.get("/", "X-Client", key).expect(t, "denied by Redis", 429, "")
			lc.get("/", "X-Client", key).expect(t, "denied from the deny cache", 429, "")
			srv.Stop() // failures are logged too: they must not hold the key either
			lc.get("/", "X-Client", "another-"+key).expect(t, "redis down", 200, "ok")

			lines := ours(lc.lines())
			denials := withMsg(lines, "rate limited")
			if len(denials) != 2 {
				t.Fatalf("%d denial lines, want 2: %v", len(denials), lines)
			}
			if len(withMsg(lines, "rate limit decision failed")) != 1 {
				t.Fatalf("no failure line among %v", lines)
			}
			for i, l := range denials {
				f := l.fields
				if f["level"] != "debug" || f["zone"] != "lk" || f["limit"] != 1.0 || f["remaining"] != 0.0 ||
					f["retry_after"] != 3600.0 || f["cached"] != (i == 1) || f["dry_run"] != false {
					t.Errorf("denial line %s", l.raw)
				}
				if got, want := f["key"], map[bool]any{false: nil, true: key}[logKey]; got != want {
					t.Errorf("denial line: key %v, want %v: %s", got, want, l.raw)
				}
			}
			for _, l := range lines {
				if l.fields["msg"] != "rate limited" && strings.Contains(l.raw, key) {
					t.Errorf("a line of the handler holds the client key: %s", l.raw)
				}
				if !logKey && strings.Contains(l.raw, key) {
					t.Errorf("without log_key, a line of the handler holds the client key: %s", l.raw)
				}
			}
		})
	}
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
	lc.get("/").expect(t, "authenticated", 200, "ok", "X-RateLimit-Limit", "1")
	lc.get("/").expect(t, "denied by Redis", 429, "", "Retry-After", "3600")

	// A wrong one: Redis refuses every connection, the breaker opens, fail_mode closed answers.
	t.Setenv("RL_TEST_REDIS_PASSWORD", wrong)
	if err := lc.load(site); err != nil {
		t.Fatalf("reload: %v", err)
	}
	for i := 0; i < breakerTrips+2; i++ {
		lc.get("/").expect(t, "wrong password", 503, "", "Retry-After", "1")
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

// provisionErr provisions h (Provision, then Validate as Caddy does) and returns the error,
// cleaning up what Provision took.
func provisionErr(t *testing.T, h *Handler) error {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	err := h.Provision(ctx)
	if err == nil {
		err = h.Validate()
	}
	_ = h.Cleanup()
	return err
}
