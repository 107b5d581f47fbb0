package ratelimitredis

import (
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestAdminKeyMappedAsARequestsKey: the admin API masks an IP address it is given to the zone's
// prefix, as a request's key is masked, so that a block, an override or a reset of an address
// reaches the requests from it; the reply says which key was used. A key no request of the zone
// can have is a 400 that writes nothing. A first candidate's value that is an IP address, in a
// zone whose IP address is another candidate, gets a warning.
func TestAdminKeyMappedAsARequestsKey(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone login {
			match path /login
			key {client_ip}
			ipv4_prefix 24
			algorithm sliding_window
			limit 3
			window 1h
			block 15m
			overrides
		}
		zone api {
			match path /api
			key {http.request.header.X-API-Key} {client_ip}
			capacity 5
			refill_rate 1/1h
			block 15m
		}
	}
	respond "ok"`, srv.Addr))

	// The request from 127.0.0.1 is keyed 127.0.0.0/24: a block of 127.0.0.1 is a block of it.
	ac.Get("/login").Expect(t, "before the block", 200, "ok")
	b := adminJSON[[]adminapi.BlockResult](t, ac, "PUT", "/rate_limit_redis/block?zone=login&key=127.0.0.1&for=1h", 200)
	if len(b) != 1 || b[0].Key != "127.0.0.0/24" || b[0].KeyGiven != "127.0.0.1" || b[0].RedisKey != "rl:{127.0.0.0/24}:login:block" || b[0].Warning != "" {
		t.Fatalf("block of 127.0.0.1: %+v", b)
	}
	ac.Get("/login").Expect(t, "blocked", 429, "", "Retry-After", "3600")
	st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=login&key=127.0.0.77", 200)
	if len(st) != 1 || st[0].Key != "127.0.0.0/24" || st[0].BlockedUntilMs == nil || st[0].Count == nil || *st[0].Count != 1 {
		t.Fatalf("state of 127.0.0.77: %+v", st)
	}
	reset := adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=login&key=127.0.0.9", 200)
	if len(reset) != 1 || reset[0].Key != "127.0.0.0/24" || !reset[0].Deleted {
		t.Fatalf("reset of 127.0.0.9: %+v", reset)
	}
	ac.Get("/login").Expect(t, "after the reset", 200, "ok")

	// An IPv6 address, in any of its spellings or as a longer network, is its /64.
	for key, want := range map[string]string{"::1": "::/64", "0:0:0:0:0:0:0:1": "::/64", "::1/128": "::/64", "2001:db8:1:2:3::7": "2001:db8:1:2::/64"} {
		st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=login&key="+url.QueryEscape(key), 200)
		if len(st) != 1 || st[0].Key != want || st[0].KeyGiven != key || st[0].RedisKey != "rl:{"+want+"}:login:sw" {
			t.Fatalf("state of %s: %+v, want key %s", key, st, want)
		}
	}
	st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=login&key="+url.QueryEscape("2001:db8:1:2::/64"), 200)
	if len(st) != 1 || st[0].Key != "2001:db8:1:2::/64" || st[0].KeyGiven != "" {
		t.Fatalf("state of 2001:db8:1:2::/64: %+v", st)
	}

	before := srv.Do("DBSIZE")
	ac.expectError(t, "PUT", "/rate_limit_redis/block?zone=login&key="+url.QueryEscape("2001:db8::/48")+"&for=1h", 400,
		"key: 2001:db8::/48 is a network of /48 bits, and zone login keys these addresses by their /64: no request's key is a wider network")
	ac.expectError(t, "PUT", "/rate_limit_redis/block?zone=api&key="+url.QueryEscape("3=x")+"&for=1h", 400,
		"key: zone api has 2 key candidate(s): no request's key is of candidate 3")
	if after := srv.Do("DBSIZE"); after != before {
		t.Fatalf("a refused call wrote to Redis: %v keys, %v before", after, before)
	}

	// An IP address as the first candidate is an API key: used as given, with a warning.
	b = adminJSON[[]adminapi.BlockResult](t, ac, "PUT", "/rate_limit_redis/block?zone=api&key=127.0.0.1&for=1h", 200)
	if len(b) != 1 || b[0].Key != "127.0.0.1" || b[0].RedisKey != "rl:{127.0.0.1}:api:block" ||
		!strings.Contains(b[0].Warning, "give 2=127.0.0.1") {
		t.Fatalf("block of API key 127.0.0.1: %+v", b)
	}
	ac.Get("/api").Expect(t, "the IP address is not blocked", 200, "ok")
	ac.Get("/api", "X-API-Key", "127.0.0.1").Expect(t, "the API key is", 429, "")
	b = adminJSON[[]adminapi.BlockResult](t, ac, "PUT", "/rate_limit_redis/block?zone=api&key="+url.QueryEscape("2=127.0.0.1")+"&for=1h", 200)
	if len(b) != 1 || b[0].Key != "2=127.0.0.1" || b[0].Warning != "" {
		t.Fatalf("block of 2=127.0.0.1: %+v", b)
	}
	ac.Get("/api").Expect(t, "the IP address is blocked", 429, "")
}

// TestAdminStateWithNumbersInForce: GET /state of a client with an override computes the limit,
// the remaining and the retry time with the override's numbers, as the response headers do,
// and shows them; of a blocked client it says nothing remains while the block lasts.
func TestAdminStateWithNumbersInForce(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone tb {
			match path /tb
			key {http.request.header.X-Client}
			capacity 10
			refill_rate 1/1h
			overrides
		}
		zone sw {
			match path /sw
			key {http.request.header.X-Client}
			algorithm sliding_window
			limit 10
			window 1h
			overrides
		}
		zone login {
			match path /login
			key {http.request.header.X-Client}
			algorithm sliding_window
			limit 5
			window 1h
			block 15m
		}
	}
	respond "ok"`, srv.Addr))

	for _, c := range []struct{ zone, body string }{{"tb", `{"capacity": 30}`}, {"sw", `{"limit": 30}`}} {
		ac.put(t, "/rate_limit_redis/override?zone="+c.zone+"&key=alice", c.body)
		for i := 1; i <= 5; i++ {
			ac.Get("/"+c.zone, "X-Client", "alice").Expect(t, fmt.Sprintf("%s request %d", c.zone, i), 200, "ok",
				"X-RateLimit-Limit", "30", "X-RateLimit-Remaining", fmt.Sprint(30-i))
		}
		st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone="+c.zone+"&key=alice", 200)
		if len(st) != 1 || st[0].Limit != 30 || st[0].Remaining != 25 || st[0].RetryAfterMs != 0 ||
			st[0].Numbers == nil || !st[0].Numbers.Override || st[0].Numbers.Capacity+st[0].Numbers.Limit != 30 {
			t.Fatalf("state of alice in %s, override 30 and 5 requests: %+v %+v", c.zone, st, st[0].Numbers)
		}
		// Without an override, the zone's numbers, and no numbers shown.
		ac.Get("/"+c.zone, "X-Client", "bob").Expect(t, c.zone+" bob", 200, "ok", "X-RateLimit-Limit", "10", "X-RateLimit-Remaining", "9")
		st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone="+c.zone+"&key=bob", 200)
		if len(st) != 1 || st[0].Limit != 10 || st[0].Remaining != 9 || st[0].Numbers != nil {
			t.Fatalf("state of bob in %s: %+v", c.zone, st)
		}
	}

	ac.Get("/login", "X-Client", "carol").Expect(t, "carol before the block", 200, "ok", "X-RateLimit-Remaining", "4")
	adminJSON[[]adminapi.BlockResult](t, ac, "PUT", "/rate_limit_redis/block?zone=login&key=carol&for=1h", 200)
	ac.Get("/login", "X-Client", "carol").Expect(t, "carol blocked", 429, "", "X-RateLimit-Remaining", "0")
	st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=login&key=carol", 200)
	if len(st) != 1 || st[0].BlockedUntilMs == nil || st[0].Remaining != 0 || st[0].RetryAfterMs <= 3_500_000 {
		t.Fatalf("state of blocked carol: %+v", st)
	}
}

// put sends a PUT with a JSON body to the admin API and fails the test unless it answers 200.
func (ac *adminCaddy) put(t *testing.T, path, body string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPut, ac.admin+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := caddytest.Client(10 * time.Second).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("PUT %s %s: %d %s", path, body, resp.StatusCode, b)
	}
}
