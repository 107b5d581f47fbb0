package ratelimitredis

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// adminCaddy is Caddy running in this process with its admin endpoint on a free loopback port,
// so that the admin API module is served as by `caddy run`.
type adminCaddy struct {
	*caddyServer
	admin string // http://127.0.0.1:port of the admin endpoint
	port  int    // of the site
}

// startCaddyAdmin is startCaddy with the admin endpoint on. When the test ends it loads a config
// with the admin endpoint off, which stops the admin server, then stops Caddy.
func startCaddyAdmin(t *testing.T, site string) *adminCaddy {
	t.Helper()
	port, adminPort := freeLoopbackPort(t), freeLoopbackPort(t)
	ac := &adminCaddy{
		caddyServer: &caddyServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(port)},
		admin:       "http://127.0.0.1:" + strconv.Itoa(adminPort),
		port:        port,
	}
	t.Cleanup(func() {
		_ = caddy.Load([]byte(`{"admin":{"disabled":true,"config":{"persist":false}},"logging":{"logs":{"default":{"level":"ERROR"}}}}`), true)
		_ = caddy.Stop()
	})
	ac.reload(t, site)
	return ac
}

// reload loads a new config with the same admin endpoint and site port, as `caddy reload` would,
// and returns once it serves alone (loadServing).
func (ac *adminCaddy) reload(t *testing.T, site string) {
	t.Helper()
	caddyfile := caddytest.Caddyfile(strings.TrimPrefix(ac.admin, "http://"), "", []int{ac.port}, []string{site})
	if err := loadCaddyfile(t, caddyfile); err != nil {
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
	resp, err := servingClient(10 * time.Second).Do(req)
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
	// A timeout reads "i/o timeout" or "context deadline exceeded", as the socket deadline or the
	// context's check comes first: msg ending in "<timeout>" accepts either.
	match := e.Error == msg
	if prefix, ok := strings.CutSuffix(msg, "<timeout>"); ok {
		match = e.Error == prefix+"i/o timeout" || e.Error == prefix+"context deadline exceeded"
	}
	if err != nil || got != status || !match {
		t.Fatalf("%s %s: %d %s, want %d {\"error\":%q}", method, path, got, body, status, msg)
	}
	return hdr
}

func TestAdminReadResetAllowedAgain(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone api {
			match path /
			key {http.request.header.X-Client}
			capacity 2
			refill_rate 1/1h
		}
		zone login {
			match path /login
			key {http.request.header.X-Client}
			algorithm sliding_window
			limit 3
			window 1h
		}
	}
	respond "ok"`, srv.Addr))

	zones := adminJSON[[]zoneInfo](t, ac, "GET", "/rate_limit_redis/zones", 200)
	wantZones := []zoneInfo{
		{Name: "api", Algorithm: "token_bucket", Capacity: 2, RefillRate: 1.0 / 3600, KeyPrefix: "rl:", Redis: []string{srv.Addr}},
		{Name: "login", Algorithm: "sliding_window", Limit: 3, WindowMs: 3_600_000, KeyPrefix: "rl:", Redis: []string{srv.Addr}},
	}
	if fmt.Sprint(zones) != fmt.Sprint(wantZones) {
		t.Fatalf("zones:\n got %+v\nwant %+v", zones, wantZones)
	}

	// Token bucket: alice takes both tokens and is denied; the denial is now in the deny cache.
	ac.get("/", "X-Client", "alice").expect(t, "alice 1", 200, "ok", "X-RateLimit-Remaining", "1")
	ac.get("/", "X-Client", "alice").expect(t, "alice 2", 200, "ok", "X-RateLimit-Remaining", "0")
	ac.get("/", "X-Client", "alice").expect(t, "alice 3", 429, "", "Retry-After", "3600")

	st := adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=alice", 200)
	if len(st) != 1 {
		t.Fatalf("state: %+v, want one entry", st)
	}
	s := st[0]
	// 1 token per hour: the refill since the last request is far below a token.
	if s.Zone != "api" || s.Key != "alice" || s.RedisKey != "rl:{alice}:api:tb" || fmt.Sprint(s.Redis) != "["+srv.Addr+"]" ||
		s.Algorithm != "token_bucket" || s.Limit != 2 || !s.Exists || s.Tokens == nil || *s.Tokens < 0 || *s.Tokens > 0.001 ||
		s.Count != nil || s.Remaining != 0 {
		t.Fatalf("state of alice, bucket empty: %+v", s)
	}
	if s.RetryAfterMs <= 3_590_000 || s.RetryAfterMs > 3_600_000 {
		t.Fatalf("retry_after_ms %d, want just under the hour until a token is back", s.RetryAfterMs)
	}
	if s.TTLMs <= 7_190_000 || s.TTLMs > 7_200_000 {
		t.Fatalf("ttl_ms %d, want just under the 2h until the bucket is full", s.TTLMs)
	}
	ac.get("/", "X-Client", "alice").expect(t, "alice still denied", 429, "")

	reset := adminJSON[[]resetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key=alice", 200)
	if fmt.Sprint(reset) != fmt.Sprint([]resetResult{{Zone: "api", Key: "alice", Candidate: 1, RedisKey: "rl:{alice}:api:tb", Redis: []string{srv.Addr}, Deleted: true, Broadcast: true}}) {
		t.Fatalf("reset: %+v", reset)
	}
	if n := srv.Do("EXISTS", "rl:{alice}:api:tb"); n != int64(0) {
		t.Fatalf("the bucket survived the reset (EXISTS = %v)", n)
	}
	// Allowed again with a full bucket: neither Redis nor this instance's deny cache denies.
	ac.get("/", "X-Client", "alice").expect(t, "alice after reset", 200, "ok", "X-RateLimit-Remaining", "1")
	st = adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=alice", 200)
	if s := st[0]; !s.Exists || s.Remaining != 1 || s.RetryAfterMs != 0 {
		t.Fatalf("state after reset and one request: %+v", s)
	}

	// Sliding window: the same with bob on /login (3 per hour).
	for i := 1; i <= 3; i++ {
		ac.get("/login", "X-Client", "bob").expect(t, "bob login "+strconv.Itoa(i), 200, "ok")
	}
	ac.get("/login", "X-Client", "bob").expect(t, "bob login 4", 429, "")
	st = adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=login&key=bob", 200)
	if s := st[0]; len(st) != 1 || s.RedisKey != "rl:{bob}:login:sw" || s.Algorithm != "sliding_window" || s.Limit != 3 ||
		!s.Exists || s.Count == nil || *s.Count != 3 || s.Tokens != nil || s.Remaining != 0 ||
		s.RetryAfterMs <= 3_590_000 || s.RetryAfterMs > 3_600_000 || s.TTLMs <= 3_590_000 || s.TTLMs > 3_600_000 {
		t.Fatalf("state of bob, window full: %+v", st)
	}
	reset = adminJSON[[]resetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=login&key=bob", 200)
	if len(reset) != 1 || !reset[0].Deleted || reset[0].RedisKey != "rl:{bob}:login:sw" {
		t.Fatalf("reset of bob: %+v", reset)
	}
	ac.get("/login", "X-Client", "bob").expect(t, "bob login after reset", 200, "ok", "X-RateLimit-Remaining", "2")
	if n := srv.Do("EXISTS", "rl:{alice}:api:tb"); n != int64(1) {
		t.Fatal("resetting bob touched alice")
	}

	// A client never seen: a full bucket, reported without creating a key; a reset of it
	// deletes nothing.
	st = adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=203.0.113.7", 200)
	if s := st[0]; s.Exists || s.Tokens == nil || *s.Tokens != 2 || s.Remaining != 2 || s.RetryAfterMs != 0 || s.TTLMs != 0 {
		t.Fatalf("state of a client never seen: %+v", s)
	}
	st = adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=login&key=203.0.113.7", 200)
	if s := st[0]; s.Exists || s.Count == nil || *s.Count != 0 || s.Remaining != 3 || s.TTLMs != 0 {
		t.Fatalf("window of a client never seen: %+v", s)
	}
	for _, k := range []string{"rl:{203.0.113.7}:api:tb", "rl:{203.0.113.7}:login:sw"} {
		if n := srv.Do("EXISTS", k); n != int64(0) {
			t.Fatalf("reading the state created %s", k)
		}
	}
	reset = adminJSON[[]resetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key=203.0.113.7", 200)
	if len(reset) != 1 || reset[0].Deleted {
		t.Fatalf("reset of a client never seen: %+v", reset)
	}
}

func TestAdminHostileKeyMapsToTheSameRedisKey(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-API-Key}
		capacity 1
		refill_rate 1/1h
	}
	respond "ok"`, srv.Addr))
	key := "tok en{with}braces/" + strings.Repeat("x", 100)
	ac.get("/", "X-API-Key", key).expect(t, "first", 200, "ok")
	ac.get("/", "X-API-Key", key).expect(t, "second", 429, "")
	st := adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=default&key="+url.QueryEscape(key), 200)
	if s := st[0]; !s.Exists || s.Remaining != 0 || s.Key != key || !strings.HasPrefix(s.RedisKey, "rl:{~") {
		t.Fatalf("state of a digested key: %+v", s)
	}
	reset := adminJSON[[]resetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=default&key="+url.QueryEscape(key), 200)
	if len(reset) != 1 || !reset[0].Deleted {
		t.Fatalf("reset: %+v", reset)
	}
	ac.get("/", "X-API-Key", key).expect(t, "after reset", 200, "ok")
}

func TestAdminErrors(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone api {
			capacity 5
			refill_rate 1
		}
	}
	respond "ok"`, srv.Addr))

	ac.expectError(t, "GET", "/rate_limit_redis/state?zone=nope&key=a", 404, `no rate_limit_redis zone named "nope" is loaded`)
	ac.expectError(t, "GET", "/rate_limit_redis/state?zone=api", 400, "query parameters zone and key are required")
	ac.expectError(t, "DELETE", "/rate_limit_redis/state?zone=api&key=", 400, "query parameters zone and key are required")
	ac.expectError(t, "GET", "/rate_limit_redis/state?key=a", 400, "query parameters zone and key are required")
	if hdr := ac.expectError(t, "POST", "/rate_limit_redis/state?zone=api&key=a", 405, "method POST not allowed: use GET or DELETE"); hdr.Get("Allow") != "GET, DELETE" {
		t.Fatalf("Allow: %q", hdr.Get("Allow"))
	}
	if hdr := ac.expectError(t, "DELETE", "/rate_limit_redis/zones", 405, "method DELETE not allowed: use GET"); hdr.Get("Allow") != "GET" {
		t.Fatalf("Allow: %q", hdr.Get("Allow"))
	}

	// Redis stalled: the admin call gives up after its 2s timeout with 504; Redis down: 502.
	srv.Pause()
	ac.expectError(t, "GET", "/rate_limit_redis/state?zone=api&key=a", 504, "redis: redis TIME: <timeout>")
	ac.expectError(t, "DELETE", "/rate_limit_redis/state?zone=api&key=a", 504, "redis: redis DEL rl:{a}:api:tb: <timeout>")
	srv.Resume()
	srv.Stop()
	ac.expectError(t, "GET", "/rate_limit_redis/state?zone=api&key=a", 502, "redis: redis TIME: dial tcp "+srv.Addr+": connect: connection refused")
	ac.expectError(t, "DELETE", "/rate_limit_redis/state?zone=api&key=a", 502, "redis: redis DEL rl:{a}:api:tb: dial tcp "+srv.Addr+": connect: connection refused")
}

func TestAdminZoneInSeveralHandlers(t *testing.T) {
	srv := redistest.Start(t)
	handler := func(prefix string, capacity int) string {
		return fmt.Sprintf(`rate_limit_redis {
			redis {
				address %s
			}
			key_prefix %s
			zone api {
				key {http.request.header.X-Client}
				capacity %d
				refill_rate 1/1h
			}
		}`, srv.Addr, prefix, capacity)
	}
	body := func(status int) string { // respond "ok", or a bare 429
		if status == 200 {
			return "ok"
		}
		return ""
	}
	// /a and /b: two handlers sharing the zone's state in Redis; /c: the same zone name under
	// another key prefix, so other state.
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	route /a {
		%s
	}
	route /b {
		%s
	}
	route /c {
		%s
	}
	respond "ok"`, handler("rl:", 2), handler("rl:", 2), handler("other:", 2)))

	zones := adminJSON[[]zoneInfo](t, ac, "GET", "/rate_limit_redis/zones", 200)
	if len(zones) != 2 || zones[0].KeyPrefix != "other:" || zones[1].KeyPrefix != "rl:" {
		t.Fatalf("zones: %+v, want api under other: and under rl:, once each", zones)
	}

	for _, step := range []struct {
		path   string
		status int
	}{{"/a", 200}, {"/b", 200}, {"/a", 429}, {"/b", 429}, {"/c", 200}, {"/c", 200}, {"/c", 429}} {
		// Each 429 is in the deny cache of the handler that denied it.
		ac.get(step.path, "X-Client", "alice").expect(t, "before reset "+step.path, step.status, body(step.status))
	}
	st := adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=alice", 200)
	if len(st) != 2 || st[0].RedisKey != "other:{alice}:api:tb" || st[1].RedisKey != "rl:{alice}:api:tb" ||
		st[0].Remaining != 0 || st[1].Remaining != 0 {
		t.Fatalf("state: %+v, want one entry per Redis key, both empty", st)
	}
	reset := adminJSON[[]resetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key=alice", 200)
	if len(reset) != 2 || !reset[0].Deleted || !reset[1].Deleted || reset[0].RedisKey != "other:{alice}:api:tb" || reset[1].RedisKey != "rl:{alice}:api:tb" {
		t.Fatalf("reset: %+v, want each Redis key deleted once", reset)
	}
	// Every handler's deny cache forgot alice: /a and /b admit her again, from the one bucket.
	for _, step := range []struct {
		path   string
		status int
	}{{"/a", 200}, {"/b", 200}, {"/a", 429}, {"/c", 200}} {
		ac.get(step.path, "X-Client", "alice").expect(t, "after reset "+step.path, step.status, body(step.status))
	}

	// A reload replaces the handlers: the admin API sees only the new config's zones.
	ac.reload(t, fmt.Sprintf(`
	route /a {
		%s
	}
	respond "ok"`, handler("rl:", 5)))
	zones = adminJSON[[]zoneInfo](t, ac, "GET", "/rate_limit_redis/zones", 200)
	if len(zones) != 1 || zones[0].Capacity != 5 || zones[0].KeyPrefix != "rl:" {
		t.Fatalf("zones after reload: %+v", zones)
	}
	st = adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=alice", 200)
	// The bucket keeps what it used (2): the larger capacity gives the difference at once.
	if len(st) != 1 || st[0].Limit != 5 || st[0].Remaining != 3 || st[0].RetryAfterMs != 0 {
		t.Fatalf("state after reload: %+v, want the new capacity 5 with 2 used: 3 remaining", st)
	}
}

// liveHandlers is the number of handlers in the process's registry.
func liveHandlers() int {
	handlers.mu.RLock()
	defer handlers.mu.RUnlock()
	return len(handlers.handlers)
}

func TestAdminRegistryForgetsHandlersOfAFailedLoad(t *testing.T) {
	before := liveHandlers()
	// The first handler provisions; the second fails validation, so the load fails and Caddy
	// cleans up the first.
	cfg := []byte(`{"admin":{"disabled":true},"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:0"],"routes":[{"handle":[
		{"handler":"rate_limit_redis","zones":[{"name":"a","capacity":1,"refill_rate":1}]},
		{"handler":"rate_limit_redis","fail_mode":"maybe","zones":[{"name":"b","capacity":1,"refill_rate":1}]}]}]}}}}}`)
	if err := caddy.Load(cfg, true); err == nil {
		_ = caddy.Stop()
		t.Fatal("config loaded; want the fail_mode error")
	}
	if n := liveHandlers(); n != before {
		t.Fatalf("%d live handlers after a failed load, want %d", n, before)
	}
}

// TestAdminResetNotBroadcast: a reset whose broadcast Redis refuses (the user lacks PUBLISH) is
// done, and its reply says that it was not broadcast, and why.
func TestAdminResetNotBroadcast(t *testing.T) {
	srv := redistest.Start(t)
	srv.Do("ACL", "SETUSER", "nopublish", "on", ">s3cret", "~*", "&*", "+@all", "-publish")
	h := provisioned(t, &Handler{
		Redis: &RedisConfig{Addresses: []string{srv.Addr}, Username: "nopublish", Password: "s3cret"},
		Zones: []*Zone{{Name: "nobroadcast", Key: []string{"alice"}, Capacity: NumberOf(1), RefillRate: NumberOf(1.0 / 3600)}},
	})
	if w, err, _ := serve(h, httptest.NewRequest(http.MethodGet, "/", nil)); err != nil || w.Code != 200 {
		t.Fatalf("first request: %d %v", w.Code, err)
	}
	w := httptest.NewRecorder()
	if err := (&AdminAPI{live: h.live}).handleState(w, httptest.NewRequest(http.MethodDelete, "/rate_limit_redis/state?zone=nobroadcast&key=alice", nil)); err != nil {
		t.Fatal(err)
	}
	var reset []resetResult
	if err := json.Unmarshal(w.Body.Bytes(), &reset); err != nil {
		t.Fatalf("%v: %s", err, w.Body)
	}
	if len(reset) != 1 || !reset[0].Deleted || reset[0].Broadcast || !strings.Contains(reset[0].BroadcastError, "NOPERM") {
		t.Fatalf("reset: %s, want deleted, not broadcast, and Redis's refusal", w.Body)
	}
}
