package ratelimitredis

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

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

	zones := adminJSON[[]adminapi.ZoneInfo](t, ac, "GET", "/rate_limit_redis/zones", 200)
	wantZones := []adminapi.ZoneInfo{
		{Name: "api", Algorithm: "token_bucket", Capacity: 2, RefillRate: 1.0 / 3600, KeyPrefix: "rl:", Redis: []string{srv.Addr}},
		{Name: "login", Algorithm: "sliding_window", Limit: 3, WindowMs: 3_600_000, KeyPrefix: "rl:", Redis: []string{srv.Addr}},
	}
	if fmt.Sprint(zones) != fmt.Sprint(wantZones) {
		t.Fatalf("zones:\n got %+v\nwant %+v", zones, wantZones)
	}

	// Token bucket: alice takes both tokens and is denied; the denial is now in the deny cache.
	ac.Get("/", "X-Client", "alice").Expect(t, "alice 1", 200, "ok", "X-RateLimit-Remaining", "1")
	ac.Get("/", "X-Client", "alice").Expect(t, "alice 2", 200, "ok", "X-RateLimit-Remaining", "0")
	ac.Get("/", "X-Client", "alice").Expect(t, "alice 3", 429, "", "Retry-After", "3600")

	st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=alice", 200)
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
	ac.Get("/", "X-Client", "alice").Expect(t, "alice still denied", 429, "")

	reset := adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key=alice", 200)
	if fmt.Sprint(reset) != fmt.Sprint([]adminapi.ResetResult{{ClientEntry: adminapi.ClientEntry{Zone: "api", Key: "alice", Candidate: 1, RedisKey: "rl:{alice}:api:tb", Redis: []string{srv.Addr}},
		Deleted: true, BroadcastResult: adminapi.BroadcastResult{Broadcast: true}}}) {
		t.Fatalf("reset: %+v", reset)
	}
	if n := srv.Do("EXISTS", "rl:{alice}:api:tb"); n != int64(0) {
		t.Fatalf("the bucket survived the reset (EXISTS = %v)", n)
	}
	// Allowed again with a full bucket: neither Redis nor this instance's deny cache denies.
	ac.Get("/", "X-Client", "alice").Expect(t, "alice after reset", 200, "ok", "X-RateLimit-Remaining", "1")
	st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=alice", 200)
	if s := st[0]; !s.Exists || s.Remaining != 1 || s.RetryAfterMs != 0 {
		t.Fatalf("state after reset and one request: %+v", s)
	}

	// Sliding window: the same with bob on /login (3 per hour).
	for i := 1; i <= 3; i++ {
		ac.Get("/login", "X-Client", "bob").Expect(t, "bob login "+strconv.Itoa(i), 200, "ok")
	}
	ac.Get("/login", "X-Client", "bob").Expect(t, "bob login 4", 429, "")
	st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=login&key=bob", 200)
	if s := st[0]; len(st) != 1 || s.RedisKey != "rl:{bob}:login:sw" || s.Algorithm != "sliding_window" || s.Limit != 3 ||
		!s.Exists || s.Count == nil || *s.Count != 3 || s.Tokens != nil || s.Remaining != 0 ||
		s.RetryAfterMs <= 3_590_000 || s.RetryAfterMs > 3_600_000 || s.TTLMs <= 3_590_000 || s.TTLMs > 3_600_000 {
		t.Fatalf("state of bob, window full: %+v", st)
	}
	reset = adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=login&key=bob", 200)
	if len(reset) != 1 || !reset[0].Deleted || reset[0].RedisKey != "rl:{bob}:login:sw" {
		t.Fatalf("reset of bob: %+v", reset)
	}
	ac.Get("/login", "X-Client", "bob").Expect(t, "bob login after reset", 200, "ok", "X-RateLimit-Remaining", "2")
	if n := srv.Do("EXISTS", "rl:{alice}:api:tb"); n != int64(1) {
		t.Fatal("resetting bob touched alice")
	}

	// A client never seen: a full bucket, reported without creating a key; a reset of it
	// deletes nothing.
	st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=203.0.113.7", 200)
	if s := st[0]; s.Exists || s.Tokens == nil || *s.Tokens != 2 || s.Remaining != 2 || s.RetryAfterMs != 0 || s.TTLMs != 0 {
		t.Fatalf("state of a client never seen: %+v", s)
	}
	st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=login&key=203.0.113.7", 200)
	if s := st[0]; s.Exists || s.Count == nil || *s.Count != 0 || s.Remaining != 3 || s.TTLMs != 0 {
		t.Fatalf("window of a client never seen: %+v", s)
	}
	for _, k := range []string{"rl:{203.0.113.7}:api:tb", "rl:{203.0.113.7}:login:sw"} {
		if n := srv.Do("EXISTS", k); n != int64(0) {
			t.Fatalf("reading the state created %s", k)
		}
	}
	reset = adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key=203.0.113.7", 200)
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
	ac.Get("/", "X-API-Key", key).Expect(t, "first", 200, "ok")
	ac.Get("/", "X-API-Key", key).Expect(t, "second", 429, "")
	st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=default&key="+url.QueryEscape(key), 200)
	if s := st[0]; !s.Exists || s.Remaining != 0 || s.Key != key || !strings.HasPrefix(s.RedisKey, "rl:{~") {
		t.Fatalf("state of a digested key: %+v", s)
	}
	reset := adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=default&key="+url.QueryEscape(key), 200)
	if len(reset) != 1 || !reset[0].Deleted {
		t.Fatalf("reset: %+v", reset)
	}
	ac.Get("/", "X-API-Key", key).Expect(t, "after reset", 200, "ok")
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
	// /block and /override check their requests as /state does, naming their own methods and
	// parameters.
	if hdr := ac.expectError(t, "GET", "/rate_limit_redis/block?zone=api&key=a&for=1m", 405, "method GET not allowed: use PUT"); hdr.Get("Allow") != "PUT" {
		t.Fatalf("Allow: %q", hdr.Get("Allow"))
	}
	ac.expectError(t, "PUT", "/rate_limit_redis/block?zone=api&key=a", 400, "query parameters zone, key and for are required")
	ac.expectError(t, "PUT", "/rate_limit_redis/block?zone=nope&key=a&for=1m", 404, `no rate_limit_redis zone named "nope" is loaded`)
	if hdr := ac.expectError(t, "POST", "/rate_limit_redis/override?zone=api&key=a", 405, "method POST not allowed: use GET, PUT or DELETE"); hdr.Get("Allow") != "GET, PUT, DELETE" {
		t.Fatalf("Allow: %q", hdr.Get("Allow"))
	}
	ac.expectError(t, "GET", "/rate_limit_redis/override?key=a", 400, "query parameters zone and key are required")
	ac.expectError(t, "GET", "/rate_limit_redis/override?zone=api&key=0%3Da", 400,
		"key: candidates are counted from 1 (0= is no client key's): give the key as {http.rate_limit_redis.key} shows it")

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

	zones := adminJSON[[]adminapi.ZoneInfo](t, ac, "GET", "/rate_limit_redis/zones", 200)
	if len(zones) != 2 || zones[0].KeyPrefix != "other:" || zones[1].KeyPrefix != "rl:" {
		t.Fatalf("zones: %+v, want api under other: and under rl:, once each", zones)
	}

	for _, step := range []struct {
		path   string
		status int
	}{{"/a", 200}, {"/b", 200}, {"/a", 429}, {"/b", 429}, {"/c", 200}, {"/c", 200}, {"/c", 429}} {
		// Each 429 is in the deny cache of the handler that denied it.
		ac.Get(step.path, "X-Client", "alice").Expect(t, "before reset "+step.path, step.status, body(step.status))
	}
	st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=alice", 200)
	if len(st) != 2 || st[0].RedisKey != "other:{alice}:api:tb" || st[1].RedisKey != "rl:{alice}:api:tb" ||
		st[0].Remaining != 0 || st[1].Remaining != 0 {
		t.Fatalf("state: %+v, want one entry per Redis key, both empty", st)
	}
	reset := adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key=alice", 200)
	if len(reset) != 2 || !reset[0].Deleted || !reset[1].Deleted || reset[0].RedisKey != "other:{alice}:api:tb" || reset[1].RedisKey != "rl:{alice}:api:tb" {
		t.Fatalf("reset: %+v, want each Redis key deleted once", reset)
	}
	// Every handler's deny cache forgot alice: /a and /b admit her again, from the one bucket.
	for _, step := range []struct {
		path   string
		status int
	}{{"/a", 200}, {"/b", 200}, {"/a", 429}, {"/c", 200}} {
		ac.Get(step.path, "X-Client", "alice").Expect(t, "after reset "+step.path, step.status, body(step.status))
	}

	// A reload replaces the handlers: the admin API sees only the new config's zones.
	ac.reload(t, fmt.Sprintf(`
	route /a {
		%s
	}
	respond "ok"`, handler("rl:", 5)))
	zones = adminJSON[[]adminapi.ZoneInfo](t, ac, "GET", "/rate_limit_redis/zones", 200)
	if len(zones) != 1 || zones[0].Capacity != 5 || zones[0].KeyPrefix != "rl:" {
		t.Fatalf("zones after reload: %+v", zones)
	}
	st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=alice", 200)
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
	if err := adminServe(t, adminapi.New(h.live), w, httptest.NewRequest(http.MethodDelete, "/rate_limit_redis/state?zone=nobroadcast&key=alice", nil)); err != nil {
		t.Fatal(err)
	}
	var reset []adminapi.ResetResult
	if err := json.Unmarshal(w.Body.Bytes(), &reset); err != nil {
		t.Fatalf("%v: %s", err, w.Body)
	}
	if len(reset) != 1 || !reset[0].Deleted || reset[0].Broadcast || !strings.Contains(reset[0].BroadcastError, "NOPERM") {
		t.Fatalf("reset: %s, want deleted, not broadcast, and Redis's refusal", w.Body)
	}
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

	shown := ac.Get("/").Body // the IP candidate's key, as the placeholder shows it
	if shown != "2=127.0.0.1" {
		t.Fatalf("placeholder %q, want 2=127.0.0.1", shown)
	}
	ac.Get("/").Expect(t, "by IP 2", 200, shown, "X-RateLimit-Remaining", "0")
	ac.Get("/").Expect(t, "by IP 3", 429, "")
	ac.Get("/", "X-API-Key", "127.0.0.1").Expect(t, "an API key equal to the IP", 200, "127.0.0.1", "X-RateLimit-Remaining", "1")

	st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape(shown), 200)
	if len(st) != 1 || st[0].Key != shown || st[0].Candidate != 2 || st[0].RedisKey != "rl:{2=127.0.0.1}:api:tb" ||
		!st[0].Exists || st[0].Remaining != 0 {
		t.Fatalf("state of %s: %+v", shown, st)
	}
	for _, key := range []string{"127.0.0.1", "1=127.0.0.1"} {
		st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape(key), 200)
		// 1=127.0.0.1 is used as 127.0.0.1, which is how a request shows it; 127.0.0.1 alone may
		// have meant the IP candidate, and the reply says so.
		if len(st) != 1 || st[0].Key != "127.0.0.1" || st[0].Candidate != 1 || st[0].RedisKey != "rl:{127.0.0.1}:api:tb" ||
			!st[0].Exists || st[0].Remaining != 1 || (st[0].Warning != "") != (key == "127.0.0.1") {
			t.Fatalf("state of %s: %+v", key, st)
		}
	}
	reset := adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape(shown), 200)
	if fmt.Sprint(reset) != fmt.Sprint([]adminapi.ResetResult{{ClientEntry: adminapi.ClientEntry{Zone: "api", Key: shown, Candidate: 2, RedisKey: "rl:{2=127.0.0.1}:api:tb", Redis: []string{srv.Addr}},
		Deleted: true, BroadcastResult: adminapi.BroadcastResult{Broadcast: true}}}) {
		t.Fatalf("reset: %+v", reset)
	}
	ac.Get("/").Expect(t, "by IP after the reset", 200, shown, "X-RateLimit-Remaining", "1")
	if srv.Do("EXISTS", "rl:{127.0.0.1}:api:tb") != int64(1) {
		t.Fatal("resetting the IP candidate's key deleted the API key's")
	}
	ac.expectError(t, "GET", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape("0=x"), 400,
		"key: candidates are counted from 1 (0= is no client key's): give the key as {http.rate_limit_redis.key} shows it")
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
		ac.Get("/", hdr...).Expect(t, key+" 1", 200, key)
		ac.Get("/", hdr...).Expect(t, key+" 2", 429, "")
		redisKey := limiter.StateKey("rl:", tbZone("api"), ks.Key(key))
		st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape(key), 200)
		if len(st) != 1 || st[0].Key != key || st[0].RedisKey != redisKey || !keyedTag.MatchString(hashTag(redisKey)) ||
			!st[0].Exists || st[0].Remaining != 0 {
			t.Fatalf("state of %s: %+v, want Redis key %s", key, st, redisKey)
		}
		reset := adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key="+url.QueryEscape(key), 200)
		if len(reset) != 1 || !reset[0].Deleted || reset[0].RedisKey != redisKey {
			t.Fatalf("reset of %s: %+v", key, reset)
		}
		ac.Get("/", hdr...).Expect(t, key+" after the reset", 200, key)
	}
}

// TestPlanAdminAPI: the admin API lists a zone's placeholder numbers, and reads a client's
// state in it with the numbers given as query parameters, or the fallbacks; a number with
// neither is a 400 naming it.
func TestPlanAdminAPI(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	map {http.request.header.X-API-Key} {plan_capacity} {plan_rate} {plan_limit} {
		key-paid 10 10/1h 100
		default 3 3/1h 30
	}
	rate_limit_redis {
		redis {
			address %s
		}
		zone api {
			key {http.request.header.X-API-Key}
			capacity {plan_capacity}
			refill_rate {plan_rate} 1/1h
		}
		zone daily {
			key {http.request.header.X-API-Key}
			algorithm fixed_window
			limit {plan_limit} 30
			period day
		}
	}
	respond "ok"`, srv.Addr))
	for range 2 {
		ac.Get("/", "X-API-Key", "key-paid").Expect(t, "paid", 200, "ok")
	}
	zones := adminJSON[[]adminapi.ZoneInfo](t, ac, "GET", "/rate_limit_redis/zones", 200)
	if len(zones) != 2 || zones[0].Name != "api" || zones[0].Capacity != 0 || zones[0].RefillRate != 1.0/3600 ||
		zones[0].Placeholders["capacity"] != "{plan_capacity}" || zones[0].Placeholders["refill_rate"] != "{plan_rate}" ||
		zones[1].Limit != 30 || zones[1].Placeholders["limit"] != "{plan_limit}" || len(zones[1].Placeholders) != 1 {
		t.Fatalf("zones: %+v", zones)
	}
	ac.expectError(t, "GET", "/rate_limit_redis/state?zone=api&key=key-paid", 400,
		"zone api takes capacity from placeholders per request, with no fallback: give the numbers as query parameters (capacity=…)")
	ac.expectError(t, "GET", "/rate_limit_redis/state?zone=api&key=key-paid&capacity=-1", 400,
		`zone api: query parameter capacity: "-1" is out of range (1 to 9007199254740992)`)
	q := url.Values{"zone": {"api"}, "key": {"key-paid"}, "capacity": {"10"}, "refill_rate": {"10/1h"}}
	st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?"+q.Encode(), 200)
	if len(st) != 1 || st[0].Limit != 10 || st[0].Remaining != 8 || st[0].Numbers == nil ||
		*st[0].Numbers != (adminapi.StateNumbers{Capacity: 10, RefillRate: 10.0 / 3600}) {
		t.Fatalf("state with the paid numbers: %+v", st)
	}
	// The same state read under the free numbers (refill_rate's fallback): 2 used of 3.
	st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=key-paid&capacity=3", 200)
	if len(st) != 1 || st[0].Limit != 3 || st[0].Remaining != 1 || *st[0].Numbers != (adminapi.StateNumbers{Capacity: 3, RefillRate: 1.0 / 3600}) {
		t.Fatalf("state with the free numbers: %+v", st)
	}
	st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=daily&key=key-paid", 200)
	if len(st) != 1 || st[0].Limit != 30 || st[0].Count == nil || *st[0].Count != 2 || *st[0].Numbers != (adminapi.StateNumbers{Limit: 30}) {
		t.Fatalf("daily state with the fallback: %+v", st)
	}
}
