package ratelimitredis

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// caddyServer runs Caddy in this process with the given site block (a Caddyfile body served on
// a free loopback port), and stops it when the test ends. Caddy holds one config per process,
// so these tests do not run in parallel.
type caddyServer struct {
	t    *testing.T
	base string // http://127.0.0.1:port
}

// freeLoopbackPort returns a loopback TCP port that was free a moment ago.
func freeLoopbackPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func startCaddy(t *testing.T, site string) *caddyServer {
	t.Helper()
	port := freeLoopbackPort(t)
	cs := &caddyServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(port)}
	if err := cs.load(site, port); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	return cs
}

// load adapts the Caddyfile and loads it, as `caddy run` would; the error is the adapter's or
// the loader's.
func (cs *caddyServer) load(site string, port int) error {
	caddyfile := fmt.Sprintf("{\n\tadmin off\n\tauto_https off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n}\n:%d {\n\tbind 127.0.0.1\n%s\n}\n", port, site)
	cfg, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	if err != nil {
		return fmt.Errorf("adapting: %w", err)
	}
	for _, w := range warnings {
		cs.t.Logf("adapter warning: %s", w.String())
	}
	return caddy.Load(cfg, true)
}

type response struct {
	status int
	header http.Header
	body   string
}

func (cs *caddyServer) get(path string, header ...string) response {
	cs.t.Helper()
	req, err := http.NewRequest(http.MethodGet, cs.base+path, nil)
	if err != nil {
		cs.t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	client := &http.Client{Timeout: 5 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		cs.t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return response{status: resp.StatusCode, header: resp.Header, body: string(b)}
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

func TestConfigErrorsAtLoad(t *testing.T) {
	for name, tc := range map[string]struct{ json, want string }{
		"no zone":        {`{}`, "at least one zone is required"},
		"fail mode":      {`{"fail_mode":"maybe","zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, `fail_mode "maybe" must be open, closed or local`},
		"cluster db":     {`{"redis":{"addresses":["a:1","b:2"],"db":3},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis db 3: Redis Cluster has only database 0"},
		"tls ca":         {`{"redis":{"tls":{"ca":"/nonexistent/ca.pem"}},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis tls ca: open /nonexistent/ca.pem: no such file or directory"},
		"sentinel":       {`{"redis":{"sentinel":"m"},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis sentinel m needs the addresses of its Sentinels"},
		"dup zone":       {`{"zones":[{"name":"a","capacity":1,"refill_rate":1},{"name":"a","capacity":1,"refill_rate":1}]}`, `zone name "a" is used twice`},
		"braces":         {`{"key_prefix":"{x}","zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "key_prefix \"{x}\" must not contain { or }"},
		"both algos":     {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"limit":3}]}`, "zone a: limit and window belong to algorithm sliding_window, not token_bucket"},
		"cost > cap":     {`{"zones":[{"name":"a","capacity":2,"refill_rate":1,"cost":"3"}]}`, "zone a: cost 3 is larger than the zone's quota 2: no request could ever be admitted"},
		"cost":           {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"cost":"0"}]}`, `zone a: cost "0" must be a positive integer or a placeholder`},
		"zone fail mode": {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"fail_mode":"maybe"}]}`, `zone a: fail_mode "maybe" must be open, closed or local`},
		"empty key":      {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"empty_key":"drop"}]}`, `zone a: empty_key "drop" must be shared, skip or deny`},
	} {
		t.Run(name, func(t *testing.T) {
			var handler map[string]any
			if err := json.Unmarshal([]byte(tc.json), &handler); err != nil {
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
				t.Fatalf("config loaded; want error %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not say %q", err, tc.want)
			}
		})
	}
}
