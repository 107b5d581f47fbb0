package ratelimitredis

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// caddyServer runs Caddy in this process with the given site block (a Caddyfile body served on
// a free loopback port), and stops it when the test ends. Caddy holds one config per process,
// so these tests do not run in parallel.
type caddyServer struct {
	t    *testing.T
	base string // http://127.0.0.1:port
}

// freeLoopbackPort returns a loopback TCP port that was free a moment ago, never one it (or
// redistest) returned before in this process: the sites of one test get distinct ports.
func freeLoopbackPort(t *testing.T) int {
	t.Helper()
	return freeport.Must(t)
}

func startCaddy(t *testing.T, site string) *caddyServer {
	t.Helper()
	port := freeLoopbackPort(t)
	cs := &caddyServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(port)}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := cs.load(site, port); err != nil {
		t.Fatal(err)
	}
	return cs
}

// load adapts the Caddyfile and loads it with loadServing, as `caddy run` or `caddy reload`
// would; the error is the adapter's, the loader's or the wait's.
func (cs *caddyServer) load(site string, port int) error {
	return loadCaddyfile(cs.t, caddytest.Caddyfile("off", "", []int{port}, []string{site}))
}

// loadCaddyfile adapts a whole Caddyfile and loads it (caddytest.LoadCaddyfile).
func loadCaddyfile(t testing.TB, caddyfile string) error {
	t.Helper()
	return caddytest.LoadCaddyfile(t, caddyfile)
}

// loadServing loads a JSON config and returns once it alone serves (caddytest.LoadServing).
func loadServing(t testing.TB, cfg []byte) error {
	t.Helper()
	return caddytest.LoadServing(t, cfg)
}

// servingClient returns a client for the config Caddy serves now (caddytest.Client).
func servingClient(timeout time.Duration) *http.Client { return caddytest.Client(timeout) }

type response struct {
	status int
	header http.Header
	body   string
}

func (cs *caddyServer) get(path string, header ...string) response {
	cs.t.Helper()
	return cs.do(http.MethodGet, path, header...)
}

// expect checks status, body and the named headers exactly (an empty value means absent).
func (r response) expect(t *testing.T, step string, status int, body string, headers ...string) {
	t.Helper()
	if r.status != status || r.body != body {
		t.Fatalf("%s: got %d %q, want %d %q", step, r.status, r.body, status, body)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		if got := r.header.Get(headers[i]); got != headers[i+1] {
			t.Fatalf("%s: header %s = %q, want %q (all: %v)", step, headers[i], got, headers[i+1], r.header)
		}
	}
}

func TestEndToEndTokenBucket(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		headers both
		capacity 3
		refill_rate 1/1h
	}
	respond "ok {http.rate_limit_redis.allowed} {http.rate_limit_redis.zone} {http.rate_limit_redis.remaining}"
	handle_errors {
		respond "limited zone={http.rate_limit_redis.zone} key={http.rate_limit_redis.key} limit={http.rate_limit_redis.limit} remaining={http.rate_limit_redis.remaining} retry={http.rate_limit_redis.retry_after} degraded={http.rate_limit_redis.degraded}" {err.status_code}
	}`, srv.Addr))

	// One token per hour: the bucket is full again 3600s per missing token after each request
	// (X-RateLimit-Reset), and its next token is always 3600s away (RateLimit's t).
	for i := 1; i <= 3; i++ {
		rem := strconv.Itoa(3 - i)
		reset := strconv.Itoa(3600 * i)
		cs.get("/").expect(t, "request "+strconv.Itoa(i), 200, "ok true default "+rem,
			"X-RateLimit-Limit", "3", "X-RateLimit-Remaining", rem, "X-RateLimit-Reset", reset,
			"RateLimit-Policy", `"default";q=3;w=10800`, "RateLimit", `"default";r=`+rem+`;t=3600`,
			"Retry-After", "")
	}
	cs.get("/").expect(t, "4th request", 429,
		"limited zone=default key=127.0.0.1 limit=3 remaining=0 retry=3600 degraded=false",
		"Retry-After", "3600", "X-RateLimit-Limit", "3", "X-RateLimit-Remaining", "0", "X-RateLimit-Reset", "10800",
		"RateLimit", `"default";r=0;t=3600`)
}

func TestEndToEndZonesFromDesign(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone api {
			key {http.request.header.X-API-Key} {client_ip}
			capacity 100
			refill_rate 10
		}
		zone login {
			match path /login
			key {client_ip}
			algorithm sliding_window
			limit 5
			window 1m
		}
	}
	respond "ok"
	handle_errors {
		respond "{http.rate_limit_redis.zone}" {err.status_code}
	}`, srv.Addr))

	// /login: the login zone (5/min) decides, having the least remaining share.
	for i := 1; i <= 5; i++ {
		cs.get("/login").expect(t, "login "+strconv.Itoa(i), 200, "ok",
			"X-RateLimit-Limit", "5", "X-RateLimit-Remaining", strconv.Itoa(5-i))
	}
	r := cs.get("/login")
	r.expect(t, "6th login", 429, "login", "X-RateLimit-Limit", "5", "X-RateLimit-Remaining", "0")
	if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); ra < 59 || ra > 60 {
		t.Fatalf("Retry-After = %q, want the ~60s until the first login leaves the window", r.header.Get("Retry-After"))
	}
	// The api zone was charged 5 tokens, not 6: the denied login charged no zone.
	cs.get("/").expect(t, "api by IP", 200, "ok", "X-RateLimit-Limit", "100", "X-RateLimit-Remaining", "94")
	// An API key is its own client.
	cs.get("/", "X-API-Key", "k1").expect(t, "api by key", 200, "ok", "X-RateLimit-Remaining", "99")
	if v := srv.Do("HGET", "rl:{k1}:api:tb", "t"); v == nil {
		t.Fatal("no bucket under the API key's hash tag")
	}
}

func TestEndToEndFailModes(t *testing.T) {
	for _, tc := range []struct {
		mode   string
		status int
		body   string
		hdrs   []string
	}{
		{"open", 200, "degraded=true allowed=true", []string{"X-RateLimit-Degraded", "true", "Retry-After", ""}},
		{"closed", 503, "err degraded=true allowed=false", []string{"Retry-After", "1", "X-RateLimit-Degraded", ""}},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			srv := redistest.Start(t)
			srv.Stop() // Caddy must start while Redis is down
			cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode %s
		capacity 10
		refill_rate 1
	}
	respond "degraded={http.rate_limit_redis.degraded} allowed={http.rate_limit_redis.allowed}"
	handle_errors {
		respond "err degraded={http.rate_limit_redis.degraded} allowed={http.rate_limit_redis.allowed}" {err.status_code}
	}`, srv.Addr, tc.mode))
			for i := 0; i < 3; i++ {
				cs.get("/").expect(t, "redis down", tc.status, tc.body, tc.hdrs...)
			}
			srv.Restart()
			// Redis is back: the next request is decided by Redis again (pooled connections
			// to the dead server are replaced on use).
			waitFor(t, 5*time.Second, "Redis decides again after it came back", func() bool {
				return cs.get("/").header.Get("X-RateLimit-Limit") == "10"
			})
			cs.get("/").expect(t, "redis back", 200, "degraded=false allowed=true", "X-RateLimit-Degraded", "", "X-RateLimit-Limit", "10")
		})
	}
}

func TestEndToEndDryRun(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		dry_run
		capacity 1
		refill_rate 1/1h
	}
	respond "allowed={http.rate_limit_redis.allowed} retry={http.rate_limit_redis.retry_after}"`, srv.Addr))
	cs.get("/").expect(t, "first", 200, "allowed=true retry=0", "X-RateLimit-Remaining", "0")
	cs.get("/").expect(t, "over the limit, dry run", 200, "allowed=false retry=3600",
		"X-RateLimit-Remaining", "0", "Retry-After", "")
}

func TestEndToEndCostPlaceholder(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		capacity 10
		refill_rate 1/1h
		cost {http.request.header.X-Cost}
	}
	respond "ok"`, srv.Addr))
	cs.get("/", "X-Cost", "4").expect(t, "cost 4", 200, "ok", "X-RateLimit-Remaining", "6")
	cs.get("/").expect(t, "no cost header counts 1", 200, "ok", "X-RateLimit-Remaining", "5")
	for _, bad := range []string{"abc", "0", "-3", "1.5", "NaN", "99999999999999999999"} {
		cs.get("/", "X-Cost", bad).expect(t, "cost "+bad, 400, "")
	}
	cs.get("/", "X-Cost", "11").expect(t, "cost above capacity", 429, "", "Retry-After", "", "X-RateLimit-Remaining", "5")
	cs.get("/", "X-Cost", "5").expect(t, "bad costs charged nothing", 200, "ok", "X-RateLimit-Remaining", "0")
}

func TestEndToEndHeadersOffAndIETF(t *testing.T) {
	srv := redistest.Start(t)
	for _, tc := range []struct {
		mode    string
		present []string
		absent  []string
	}{
		{"off", nil, []string{"X-RateLimit-Limit", "RateLimit", "RateLimit-Policy"}},
		{"ietf", []string{"RateLimit", "RateLimit-Policy"}, []string{"X-RateLimit-Limit"}},
		{"legacy", []string{"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}, []string{"RateLimit"}},
	} {
		cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		headers %s
		zone z%s {
			algorithm sliding_window
			limit 10
			window 10s
		}
	}
	respond "ok"`, srv.Addr, tc.mode, tc.mode))
		r := cs.get("/")
		for _, h := range tc.present {
			if r.header.Get(h) == "" {
				t.Errorf("headers %s: %s missing", tc.mode, h)
			}
		}
		for _, h := range tc.absent {
			if r.header.Get(h) != "" {
				t.Errorf("headers %s: %s present", tc.mode, h)
			}
		}
		if tc.mode == "ietf" {
			r.expect(t, "ietf", 200, "ok", "RateLimit-Policy", `"z`+tc.mode+`";q=10;w=10`, "RateLimit", `"z`+tc.mode+`";r=9;t=10`)
		}
		_ = caddy.Stop()
	}
}

func TestEndToEndHostileKeys(t *testing.T) {
	srv := redistest.Start(t)
	cs := startCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-API-Key}
		capacity 2
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr))
	huge := strings.Repeat("k", 10_000) // Caddy rejects headers over 16 kB by default (431) before any handler
	for _, k := range []string{huge, "}{", "{x}"} {
		cs.get("/", "X-API-Key", k).expect(t, "first", 200, "ok", "X-RateLimit-Remaining", "1")
		cs.get("/", "X-API-Key", k).expect(t, "second", 200, "ok", "X-RateLimit-Remaining", "0")
		cs.get("/", "X-API-Key", k).expect(t, "third", 429, "")
	}
	// No key header at all: every such request shares the zone's one key.
	cs.get("/").expect(t, "no key", 200, "ok", "X-RateLimit-Remaining", "1")
	cs.get("/").expect(t, "no key again", 200, "ok", "X-RateLimit-Remaining", "0")
	for _, k := range srv.Client().Keys(t.Context(), "*").Val() {
		if len(k) > 80 || strings.Count(k, "{") != 1 || strings.Count(k, "}") != 1 {
			t.Errorf("Redis key %q is unbounded or escapes its hash tag", k)
		}
	}
}

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

func TestConfigErrorsAtLoad(t *testing.T) {
	for name, tc := range map[string]struct{ json, want string }{
		"no zone":        {`{}`, "at least one zone is required"},
		"fail mode":      {`{"fail_mode":"maybe","zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, `fail_mode "maybe" must be open, closed or local`},
		"cluster db":     {`{"redis":{"addresses":["a:1","b:2"],"db":3},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis db 3: Redis Cluster has only database 0"},
		"tls ca":         {`{"redis":{"tls":{"ca":"/nonexistent/ca.pem"}},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis tls ca: open /nonexistent/ca.pem: no such file or directory"},
		"sentinel":       {`{"redis":{"sentinel":"m"},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis sentinel m needs the addresses of its Sentinels"},
		"dup zone":       {`{"zones":[{"name":"a","capacity":1,"refill_rate":1},{"name":"a","capacity":1,"refill_rate":1}]}`, `zone name "a" is used twice`},
		"braces":         {`{"key_prefix":"{x}","zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "key_prefix \"{x}\" must not contain { or }"},
		"both algos":     {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"limit":3}]}`, "zone a: limit belongs to algorithm sliding_window, not token_bucket"},
		"cost > cap":     {`{"zones":[{"name":"a","capacity":2,"refill_rate":1,"cost":"3"}]}`, "zone a: cost 3 is larger than capacity 2: no request could ever be admitted"},
		"cost":           {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"cost":"0"}]}`, `zone a: cost: "0" must be > 0`},
		"zone fail mode": {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"fail_mode":"maybe"}]}`, `zone a: fail_mode "maybe" must be open, closed or local`},
		"empty key":      {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"empty_key":"drop"}]}`, `zone a: empty_key "drop" must be shared, skip or deny`},
	} {
		t.Run(name, func(t *testing.T) { wantLoadError(t, tc.json, tc.want) })
	}
}

// TestCleanupLogsUnreturnedGrants: when a handler is cleaned up (a reload) while Redis is gone,
// the unspent tokens of its lease grants cannot be given back; it says so at warn level.
func TestCleanupLogsUnreturnedGrants(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{
		Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Timeout: caddy.Duration(2 * time.Second),
		Zones: []*Zone{{Name: "api", Key: []string{"k"}, Capacity: NumberOf(100), RefillRate: NumberOf(1.0 / 3600),
			Lease: &Lease{Max: 20, TTL: caddy.Duration(time.Minute)}}},
	})
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	key := limiter.StateKey("rl:", &h.Zones[0].lz, "k")
	for i := 0; srv.Do("HGET", key, "h") == nil; i++ { // a hot client: soon served from grants
		if i == 100 {
			t.Fatal("no grant taken after 100 requests of one client")
		}
		if w, err, _ := serve(h, httptest.NewRequest(http.MethodGet, "/", nil)); err != nil || w.Code != 200 {
			t.Fatalf("request %d: %d %v", i, w.Code, err)
		}
	}
	srv.Stop()
	if err := h.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if n := logs.FilterMessageSnippet("lease grants not returned to redis").FilterLevelExact(zapcore.WarnLevel).Len(); n != 1 {
		t.Fatalf("%d warnings of grants not returned, want 1: %v", n, logs.All())
	}
}
