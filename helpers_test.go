package ratelimitredis

// The helpers that the package's tests share. They run a real redis-server (internal/redistest)
// and, for the tests that need one, Caddy in this process (internal/caddytest); the end-to-end
// tests, which configure Caddy only as a user would, are in e2e/.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// The handler, provisioned as Caddy would, and served with httptest.

// provisioned returns h provisioned and validated as Caddy would, cleaned up when the test ends.
// Unless h has one, it is given a registry of its own, which adminapi.New(h.live) serves.
func provisioned(t testing.TB, h *Handler) *Handler {
	t.Helper()
	if h.live == nil {
		h.live = newRegistry()
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Cleanup() })
	if err := h.Validate(); err != nil {
		t.Fatal(err)
	}
	return h
}

func serve(h *Handler, r *http.Request) (*httptest.ResponseRecorder, error, bool) {
	repl := caddy.NewReplacer()
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
	w := httptest.NewRecorder()
	nextCalled := false
	err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		nextCalled = true
		return nil
	}))
	return w, err, nextCalled
}

// Settings no config sets, for the tests that run Caddy.

// tunedHandler is the handler with the settings tests change that no config sets
// (Handler.breakerOpenFor, Handler.localKeys, Handler.now), for tests that run Caddy: the module
// http.handlers.rate_limit_redis_tuned and its directive, which exist in the test binary only.
// The directive takes the settings as arguments, then rate_limit_redis's block:
//
//	rate_limit_redis_tuned breaker_open_for=3s local_keys=64 clock=TestName {
//		...
//	}
type tunedHandler struct {
	Handler
	BreakerOpenFor caddy.Duration `json:"breaker_open_for,omitempty"`
	LocalKeys      int            `json:"local_keys,omitempty"`
	// Clock names a fakeClock of fakeClocks: the handler's Go-side clock (Handler.now).
	Clock string `json:"clock,omitempty"`
}

// fakeClock is a clock that moves only when a test advances it.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

// Now returns the clock's time.
func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

// Advance moves the clock forward by d.
func (c *fakeClock) Advance(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

// fakeClocks holds the clocks rate_limit_redis_tuned's clock=<name> setting names.
var fakeClocks sync.Map // string -> *fakeClock

// newFakeClock registers a fakeClock at the real time under t's name, for clock=<t.Name()>,
// until t ends.
func newFakeClock(t *testing.T) *fakeClock {
	c := &fakeClock{t: time.Now()}
	fakeClocks.Store(t.Name(), c)
	t.Cleanup(func() { fakeClocks.Delete(t.Name()) })
	return c
}

func init() {
	caddy.RegisterModule(new(tunedHandler))
	httpcaddyfile.RegisterHandlerDirective("rate_limit_redis_tuned", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		th := new(tunedHandler)
		return th, th.UnmarshalCaddyfile(h.Dispenser)
	})
	httpcaddyfile.RegisterDirectiveOrder("rate_limit_redis_tuned", httpcaddyfile.Before, "basic_auth")
}

func (*tunedHandler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.rate_limit_redis_tuned", New: func() caddy.Module { return new(tunedHandler) }}
}

// Provision sets the settings, then provisions the handler.
func (th *tunedHandler) Provision(ctx caddy.Context) error {
	th.breakerOpenFor, th.localKeys = time.Duration(th.BreakerOpenFor), th.LocalKeys
	if th.Clock != "" {
		c, ok := fakeClocks.Load(th.Clock)
		if !ok {
			return fmt.Errorf("no fake clock %q", th.Clock)
		}
		th.now = c.(*fakeClock).Now
	}
	return th.Handler.Provision(ctx)
}

// UnmarshalCaddyfile reads the settings from the directive's arguments, and the rest as
// rate_limit_redis's.
func (th *tunedHandler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name
	for d.NextArg() {
		name, value, _ := strings.Cut(d.Val(), "=")
		switch name {
		case "breaker_open_for":
			dur, err := caddy.ParseDuration(value)
			if err != nil {
				return d.Errf("%s: %v", name, err)
			}
			th.BreakerOpenFor = caddy.Duration(dur)
		case "local_keys":
			n, err := strconv.Atoi(value)
			if err != nil {
				return d.Errf("%s: %v", name, err)
			}
			th.LocalKeys = n
		case "clock":
			th.Clock = value
		default:
			return d.Errf("unknown setting %q", d.Val())
		}
		d.Delete() // rate_limit_redis takes no arguments
	}
	d.Reset()
	return th.Handler.UnmarshalCaddyfile(d)
}

// liveHandler returns the one handler of the process's registry: that of the config Caddy runs.
func liveHandler(t testing.TB) *Handler {
	t.Helper()
	handlers.mu.RLock()
	defer handlers.mu.RUnlock()
	if len(handlers.handlers) != 1 {
		t.Fatalf("%d live handlers, want 1", len(handlers.handlers))
	}
	for h := range handlers.handlers {
		return h
	}
	return nil
}

// Configs that fail to load.

// wantLoadError loads a config whose one route is the rate_limit_redis handler handlerJSON (its
// JSON without "handler") and fails t unless loading fails with an error that says want.
func wantLoadError(t *testing.T, handlerJSON, want string) {
	t.Helper()
	err := loadHandlerJSON(t, handlerJSON)
	if err == nil {
		t.Fatalf("config loaded; want error %q", want)
	}
	if !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q does not say %q", err, want)
	}
}

// loadHandlerJSON loads a config whose one route has the handler of handlerJSON (without its
// "handler" key), and returns the load's error; Caddy is stopped if it loaded.
func loadHandlerJSON(t *testing.T, handlerJSON string) error {
	t.Helper()
	var handler map[string]any
	if err := json.Unmarshal([]byte(handlerJSON), &handler); err != nil {
		t.Fatal(err)
	}
	handler["handler"] = "rate_limit_redis"
	cfg, _ := json.Marshal(map[string]any{
		"admin": map[string]any{"disabled": true},
		"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"s": map[string]any{
			"listen": []string{"127.0.0.1:0"},
			"routes": []any{map[string]any{"handle": []any{handler}}},
		}}}},
	})
	err := caddy.Load(cfg, true)
	if err == nil {
		_ = caddy.Stop()
	}
	return err
}

// Caddy with its admin endpoint, for the admin API.

// adminCaddy is Caddy running in this process with its admin endpoint on a free loopback port,
// so that the admin API module is served as by `caddy run`.
type adminCaddy struct {
	*caddytest.Site
	admin string // http://127.0.0.1:port of the admin endpoint
	port  int    // of the site
}

// startCaddyAdmin is caddytest.Start with the admin endpoint on. When the test ends it loads a
// config with the admin endpoint off, which stops the admin server, then stops Caddy.
func startCaddyAdmin(t *testing.T, site string) *adminCaddy {
	t.Helper()
	port, adminPort := freeport.Must(t), freeport.Must(t)
	ac := &adminCaddy{
		Site:  &caddytest.Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(port)},
		admin: "http://127.0.0.1:" + strconv.Itoa(adminPort),
		port:  port,
	}
	t.Cleanup(func() {
		_ = caddy.Load([]byte(`{"admin":{"disabled":true,"config":{"persist":false}},"logging":{"logs":{"default":{"level":"ERROR"}}}}`), true)
		_ = caddy.Stop()
	})
	ac.reload(t, site)
	return ac
}

// reload loads a new config with the same admin endpoint and site port, as `caddy reload` would,
// and returns once it serves alone (caddytest.LoadServing).
func (ac *adminCaddy) reload(t *testing.T, site string) {
	t.Helper()
	caddyfile := caddytest.Caddyfile(strings.TrimPrefix(ac.admin, "http://"), "", []int{ac.port}, []string{site})
	if err := caddytest.LoadCaddyfile(t, caddyfile); err != nil {
		t.Fatalf("loading: %v", err)
	}
}

// call sends an admin API request and returns the status, the body and the response.
func (ac *adminCaddy) call(t *testing.T, method, path string) (int, string, http.Header) {
	t.Helper()
	req, err := http.NewRequest(method, ac.admin+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := caddytest.Client(10 * time.Second).Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b), resp.Header
}

// adminJSON calls the admin API, checks the status and decodes the body, which must have no
// field that T lacks.
func adminJSON[T any](t *testing.T, ac *adminCaddy, method, path string, status int) T {
	t.Helper()
	var out T
	got, body, hdr := ac.call(t, method, path)
	if got != status {
		t.Fatalf("%s %s: %d %s, want %d", method, path, got, body, status)
	}
	if ct := hdr.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("%s %s: Content-Type %q", method, path, ct)
	}
	dec := json.NewDecoder(strings.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&out); err != nil {
		t.Fatalf("%s %s: decoding %s: %v", method, path, body, err)
	}
	return out
}

// expectError calls the admin API and checks the status and the exact error message.
func (ac *adminCaddy) expectError(t *testing.T, method, path string, status int, msg string) http.Header {
	t.Helper()
	var e struct {
		Error string `json:"error"`
	}
	got, body, hdr := ac.call(t, method, path)
	err := json.Unmarshal([]byte(body), &e)
	// A timeout reads "i/o timeout" (with the socket's "read tcp a->b: " when a pooled
	// connection timed out) or "context deadline exceeded", as the socket deadline or the
	// context's check comes first: msg ending in "<timeout>" accepts any of them.
	match := e.Error == msg
	if prefix, ok := strings.CutSuffix(msg, "<timeout>"); ok {
		rest, _ := strings.CutPrefix(e.Error, prefix)
		match = strings.HasPrefix(e.Error, prefix) && (rest == "context deadline exceeded" ||
			regexp.MustCompile(`^(read tcp [0-9.:]+->[0-9.:]+: )?i/o timeout$`).MatchString(rest))
	}
	if err != nil || got != status || !match {
		t.Fatalf("%s %s: %d %s, want %d {\"error\":%q}", method, path, got, body, status, msg)
	}
	return hdr
}

// Caddy with every log written to files, read back as JSON lines.

// loggedCaddy is Caddy run in this process (as caddytest.Start does) with every log at DEBUG, as
// JSON, written to files: Caddy's default log (which the handler's ctx.Logger() and the
// circuit breaker write to, and Caddy its own lines and handler errors) and the site's access log.
type loggedCaddy struct {
	*caddytest.Site
	port    int
	logDir  string
	adapted [][]byte // the JSON of every config loaded
}

func startLoggedCaddy(t *testing.T, site string) *loggedCaddy {
	t.Helper()
	port := freeport.Must(t)
	lc := &loggedCaddy{
		Site:   &caddytest.Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(port)},
		port:   port,
		logDir: t.TempDir(),
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := lc.load(site); err != nil {
		t.Fatal(err)
	}
	return lc
}

// load adapts and loads the site (again: a reload) with caddytest.LoadServing, keeping the
// adapted JSON.
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
	return caddytest.LoadServing(lc.T, cfg)
}

// logLine is one JSON log line, as written and as decoded.
type logLine struct {
	raw    string
	fields map[string]any
}

// lines returns every line written to the logs so far. Caddy writes them synchronously, so a
// request's lines are there once its response has come.
func (lc *loggedCaddy) lines() []logLine {
	lc.T.Helper()
	var out []logLine
	for _, name := range []string{"caddy.log", "access.log"} {
		b, err := os.ReadFile(filepath.Join(lc.logDir, name))
		if err != nil && !os.IsNotExist(err) {
			lc.T.Fatal(err)
		}
		for l := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
			if l == "" {
				continue
			}
			var f map[string]any
			if err := json.Unmarshal([]byte(l), &f); err != nil {
				lc.T.Fatalf("%s: a line that is not JSON: %q", name, l)
			}
			out = append(out, logLine{raw: l, fields: f})
		}
	}
	return out
}

// ours returns the lines of the handler's logger (ctx.Logger() and the circuit breaker), of
// rate_limit_redis or of rate_limit_redis_tuned.
func ours(lines []logLine) []logLine {
	var out []logLine
	for _, l := range lines {
		if lg := l.fields["logger"]; lg == "http.handlers.rate_limit_redis" || lg == "http.handlers.rate_limit_redis_tuned" {
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

// authMsg is the start of the warning logged at load for a key placeholder of authentication.
const authMsg = "a key placeholder is set by authentication"

// The metrics of the running config.

// The metric names, as a dashboard queries them.
const (
	metricDecisions  = "caddy_rate_limit_redis_decisions_total"
	metricDuration   = "caddy_rate_limit_redis_redis_duration_seconds"
	metricFailures   = "caddy_rate_limit_redis_backend_failures_total"
	metricCacheHits  = "caddy_rate_limit_redis_deny_cache_hits_total"
	allMetricsPrefix = "caddy_rate_limit_redis_"
)

// activeRegistry is the metrics registry of Caddy's running config: what its admin /metrics
// endpoint and `metrics` handler serve.
func activeRegistry(t *testing.T) *prometheus.Registry {
	t.Helper()
	ctx := caddy.ActiveContext()
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		t.Fatal("no metrics registry in the active Caddy context")
	}
	return reg
}

// metricValue gathers reg and returns the value of the series of the family name whose labels
// are exactly labels (name, value pairs): a counter's or gauge's value, or a histogram's sample
// count.
// A series that does not exist is 0.
func metricValue(t *testing.T, reg prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gathering metrics: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labels)/2 {
				continue
			}
			for _, lp := range m.GetLabel() {
				if !hasPair(labels, lp.GetName(), lp.GetValue()) {
					continue series
				}
			}
			if h := m.GetHistogram(); h != nil {
				return float64(h.GetSampleCount())
			}
			if g := m.GetGauge(); g != nil {
				return g.GetValue()
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

func hasPair(pairs []string, name, value string) bool {
	for i := 0; i+1 < len(pairs); i += 2 {
		if pairs[i] == name && pairs[i+1] == value {
			return true
		}
	}
	return false
}

// snapshot is the values of the series the tests watch, read from one registry.
type snapshot map[string]float64

// takeSnapshot reads the series the tests watch: for every zone given, its decisions_total of
// every result; the Redis call histogram's count; the failures of a Redis call and those of the
// open circuit breaker; the deny cache hits.
func takeSnapshot(t *testing.T, reg prometheus.Gatherer, zones ...string) snapshot {
	t.Helper()
	s := snapshot{
		"calls":     metricValue(t, reg, metricDuration),
		"cache_hit": metricValue(t, reg, metricCacheHits),
	}
	// A refused connection is a timeout or a redis_error depending on where go-redis's dial
	// retries are when the deadline passes: the reasons of a call are summed.
	for _, reason := range []string{"redis_error", "timeout", "bad_response"} {
		s["failure/called"] += metricValue(t, reg, metricFailures, "reason", reason)
	}
	s["failure/circuit_open"] = metricValue(t, reg, metricFailures, "reason", "circuit_open")
	for _, z := range zones {
		for r := range numResults {
			s[z+"/"+r.String()] = metricValue(t, reg, metricDecisions, "zone", z, "result", r.String())
		}
	}
	return s
}

// expectDeltas checks that every watched series moved from before to after by exactly the delta
// given in want (series not in want: by 0).
func expectDeltas(t *testing.T, step string, before, after snapshot, want map[string]float64) {
	t.Helper()
	for k := range want {
		if _, ok := before[k]; !ok {
			t.Fatalf("%s: series %q is not watched", step, k)
		}
	}
	var bad []string
	for k, b := range before {
		if d := after[k] - b; d != want[k] {
			bad = append(bad, fmt.Sprintf("%s +%v, want +%v", k, d, want[k]))
		}
	}
	if len(bad) > 0 {
		t.Fatalf("%s: %s", step, strings.Join(bad, "; "))
	}
}

const metricEmptyKeys = "caddy_rate_limit_redis_empty_key_total"

// Redis keys.

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

// heldUpstream is an upstream whose every request waits until the test ends.
func heldUpstream(t *testing.T) *httptest.Server {
	release := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-release }))
	t.Cleanup(up.Close)
	t.Cleanup(func() { close(release) })
	return up
}
