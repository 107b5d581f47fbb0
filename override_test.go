package ratelimitredis

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// overrideInstances starts n instances (handlers of their own, served over HTTP, each with its
// own admin API) sharing redis (addrs; cluster for Redis Cluster), with zones.
func overrideInstances(t *testing.T, n int, addrs []string, cluster bool, zones func() []*Zone) (urls []string, admins []*adminapi.AdminAPI) {
	t.Helper()
	ok := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		_, err := io.WriteString(w, "ok")
		return err
	})
	for range n {
		h, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: addrs, Cluster: cluster}, Headers: HeadersLegacy, Zones: zones()}, ok)
		urls = append(urls, s.URL)
		admins = append(admins, adminapi.New(h.live))
	}
	return urls, admins
}

// getKey sends a request as the client of key on url and returns its status and
// X-RateLimit-Limit.
func getKey(t *testing.T, url, key string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-API-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("X-RateLimit-Limit")
}

// adminOverride calls the admin API's override endpoint of a and returns the status and body.
func adminOverride(t *testing.T, a *adminapi.AdminAPI, method, query, body string) (int, string) {
	t.Helper()
	w := httptest.NewRecorder()
	err := adminServe(t, a, w, httptest.NewRequest(method, "/rate_limit_redis/override?"+query, strings.NewReader(body)))
	if err != nil {
		var ae caddy.APIError
		if errors.As(err, &ae) {
			return ae.HTTPStatus, err.Error()
		}
		return http.StatusInternalServerError, err.Error()
	}
	return http.StatusOK, w.Body.String()
}

func apiZone(bucket bool) *Zone {
	z := &Zone{Name: "api", Key: []string{"{http.request.header.X-API-Key}"}, Overrides: true}
	if bucket {
		z.Capacity, z.RefillRate = NumberOf(2), NumberOf(1.0/3600)
	} else {
		z.Algorithm, z.Limit, z.Window = slidingWindowName, NumberOf(2), NumberOf(time.Hour)
	}
	return z
}

// expectStatuses sends one request per want on urls in turn (the client key) and checks each
// status and X-RateLimit-Limit.
func expectStatuses(t *testing.T, step string, urls []string, key string, limit string, want ...int) {
	t.Helper()
	for i, w := range want {
		code, lim := getKey(t, urls[i%len(urls)], key)
		if code != w || lim != limit {
			t.Fatalf("%s: request %d on instance %d: %d with X-RateLimit-Limit %q, want %d and %q", step, i+1, i%len(urls), code, lim, w, limit)
		}
	}
}

// testOverrideAcrossInstances: an override set on one instance's admin API changes the next
// decision on another; its DELETE, and its expiry, restore the zone's numbers.
func testOverrideAcrossInstances(t *testing.T, addrs []string, cluster bool) {
	for _, bucket := range []bool{true, false} {
		name := "sliding_window"
		if bucket {
			name = "token_bucket"
		}
		t.Run(name, func(t *testing.T) {
			urls, admins := overrideInstances(t, 3, addrs, cluster, func() []*Zone { return []*Zone{apiZone(bucket)} })
			key := "alice-" + name
			expectStatuses(t, "the zone's numbers", urls, key, "2", 200, 200, 429)
			raise := `{"capacity": 5}`
			if !bucket {
				raise = `{"limit": 5}`
			}
			if code, body := adminOverride(t, admins[1], http.MethodPut, "zone=api&key="+key, raise); code != 200 {
				t.Fatalf("PUT override: %d %s", code, body)
			}
			// The next decision, on another instance, uses the override: 3 more, then denied.
			// (Instance 2 denied the client last: its deny cache may answer until the PUT's
			// broadcast reaches it, within its max_age.)
			expectStatuses(t, "raised to 5 on instance 1", urls[:2], key, "5", 200, 200, 200, 429)
			if code, body := adminOverride(t, admins[2], http.MethodGet, "zone=api&key="+key, ""); code != 200 || !strings.Contains(body, `"exists":true`) {
				t.Fatalf("GET override: %d %s", code, body)
			}
			if code, body := adminOverride(t, admins[0], http.MethodDelete, "zone=api&key="+key, ""); code != 200 || !strings.Contains(body, `"exists":true`) {
				t.Fatalf("DELETE override: %d %s", code, body)
			}
			expectStatuses(t, "deleted: the zone's 2 again", urls[1:], key, "2", 429)
			// A temporary raise: admitted while it lasts, the zone's numbers once it expires.
			raise = `{"capacity": 10, "expires_in": "300ms"}`
			if !bucket {
				raise = `{"limit": 10, "expires_in": "300ms"}`
			}
			if code, body := adminOverride(t, admins[0], http.MethodPut, "zone=api&key="+key, raise); code != 200 {
				t.Fatalf("PUT temporary override: %d %s", code, body)
			}
			expectStatuses(t, "raised to 10 for 300ms", urls[:1], key, "10", 200)
			deadline := time.Now().Add(10 * time.Second)
			for {
				code, lim := getKey(t, urls[1], key)
				if code == 429 && lim == "2" {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("10s after a 300ms override: %d with X-RateLimit-Limit %q, want 429 and 2", code, lim)
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

func TestOverrideAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	testOverrideAcrossInstances(t, []string{srv.Addr}, false)
}

func TestOverrideOnCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	testOverrideAcrossInstances(t, c.Addrs(), true)
}

// TestOverrideCut: an override may lower a client's numbers: the cut client is denied, the
// others keep the zone's.
func TestOverrideCut(t *testing.T) {
	srv := redistest.Start(t)
	urls, admins := overrideInstances(t, 2, []string{srv.Addr}, false, func() []*Zone { return []*Zone{apiZone(true)} })
	if code, body := adminOverride(t, admins[0], http.MethodPut, "zone=api&key=abuser", `{"capacity": 1, "refill_rate": "1/1h"}`); code != 200 {
		t.Fatalf("PUT: %d %s", code, body)
	}
	expectStatuses(t, "cut to 1", urls, "abuser", "1", 200, 429)
	expectStatuses(t, "another client", urls, "bob", "2", 200, 200, 429)
}

// TestOverrideBadBody: an override is validated as the Caddyfile's numbers are; a bad body is a
// 400 that names the field, and nothing is written.
func TestOverrideBadBody(t *testing.T) {
	srv := redistest.Start(t)
	_, admins := overrideInstances(t, 1, []string{srv.Addr}, false, func() []*Zone {
		plain := &Zone{Name: "plain", Capacity: NumberOf(2), RefillRate: NumberOf(1.0)}
		return []*Zone{apiZone(true), plain}
	})
	for _, c := range []struct{ query, body, want string }{
		{"zone=api&key=a", `{"capacity": 0.5}`, `zone api: capacity: "0.5" is not an integer`},
		{"zone=api&key=a", `{"capacity": 9007199254740993}`, "zone api: capacity: \"9007199254740993\" is out of range (1 to 9007199254740992)"},
		{"zone=api&key=a", `{"limit": 5}`, "zone api: limit belongs to algorithm sliding_window, not token_bucket"},
		{"zone=api&key=a", `{"refill_rate": "x/1m"}`, `zone api: refill_rate: "x/1m" is not a number of tokens`},
		{"zone=api&key=a", `{"max_cost": 3}`, "zone api: max_cost 3 is larger than capacity 2"},
		{"zone=api&key=a", `{"capacity": "{http.vars.plan}"}`, "zone api: capacity: an override is a number, not a placeholder"},
		{"zone=api&key=a", `{"capacity": 5, "burst": 1}`, `unknown field "burst"`},
		{"zone=api&key=a", `{}`, "zone api: an override sets at least one of the zone's numbers"},
		{"zone=api&key=a", `{"capacity": 5, "expires_in": "-1s"}`, `expires_in "-1s" must be at least 1ms`},
		{"zone=api&key=a", `{"capacity": 5, "expires_in": "0s"}`, `expires_in "0s" must be at least 1ms`},
		{"zone=api&key=a", `{"capacity": 5, "expires_in": 0}`, "expires_in 0 must be at least 1ms"},
		{"zone=api&key=a", `{"capacity": 5, "expires_in": 1}`, "expires_in 1 must be at least 1ms"},
		{"zone=api&key=a", `{"capacity": 5, "expires_in": "1us"}`, `expires_in "1us" must be at least 1ms`},
		{"zone=api&key=a", `{"capacity": 5, "expires_in": "400d"}`, `expires_in "400d" is out of range (at most 366d)`},
		{"zone=plain&key=a", `{"capacity": 5}`, "zone plain has no overrides"},
	} {
		code, body := adminOverride(t, admins[0], http.MethodPut, c.query, c.body)
		if code != 400 || !strings.Contains(body, c.want) {
			t.Errorf("PUT %s %s: %d %s, want 400 with %q", c.query, c.body, code, body, c.want)
		}
	}
	if keys := srv.Do("KEYS", "*ov"); len(keys.([]any)) != 0 {
		t.Fatalf("keys after bad bodies: %v, want none", keys)
	}
	var st []adminapi.OverrideState
	_, body := adminOverride(t, admins[0], http.MethodGet, "zone=api&key=a", "")
	if err := json.Unmarshal([]byte(body), &st); err != nil || len(st) != 1 || st[0].Exists {
		t.Fatalf("GET after bad bodies: %s %v, want no override", body, err)
	}
}

// TestOverrideRaisesSlidingWindowCost: on a sliding_window zone whose cost is a placeholder (its
// max_cost at most 1000, set at load), a client's override that raises limit raises the largest
// cost admitted with it; a client without one is still bounded by the zone's own limit, with no
// Retry-After (waiting never cures it). Ported from correctness-5/ov_range.py.
func TestOverrideRaisesSlidingWindowCost(t *testing.T) {
	srv := redistest.Start(t)
	urls, admins := overrideInstances(t, 1, []string{srv.Addr}, false, func() []*Zone {
		return []*Zone{{Name: "w", Key: []string{"{http.request.header.X-API-Key}"}, Algorithm: slidingWindowName,
			Limit: NumberOf(100), Window: NumberOf(time.Minute), Cost: "{http.request.header.X-Cost}", Overrides: true}}
	})
	if code, body := adminOverride(t, admins[0], http.MethodPut, "zone=w&key=alice", `{"limit": 1000}`); code != http.StatusOK {
		t.Fatalf("PUT override: %d %s", code, body)
	}
	for _, c := range []struct {
		key, cost string
		status    int
		retry     bool
	}{
		{"alice", "500", http.StatusOK, false},
		{"alice", "400", http.StatusOK, false},
		{"bob", "101", http.StatusTooManyRequests, false},
		{"bob", "100", http.StatusOK, false},
	} {
		req, err := http.NewRequest(http.MethodGet, urls[0], nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-API-Key", c.key)
		req.Header.Set("X-Cost", c.cost)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status || (resp.Header.Get("Retry-After") != "") != c.retry {
			t.Fatalf("%s, cost %s: %d (Retry-After %q), want %d (a Retry-After: %v)", c.key, c.cost, resp.StatusCode, resp.Header.Get("Retry-After"), c.status, c.retry)
		}
	}
}

// TestOverrideRaisesChargedBudget: overrides on zones that settle after the response, over 3
// handlers (as 3 instances) sharing Redis: an LLM zone charging the tokens the upstream reports
// (capacity 1000 a day, a reservation of 100, 300 reported) and a login zone counting 401s
// (limit 3 an hour). Alice spends her 1000 tokens: the 5th request is refused. A PUT of her
// override to capacity 10,000, with no reload, admits her next 10 requests with the limit in
// force, each charged exactly 300 (1200 + 3000 in the bucket, less the refill at 1000 a day);
// bob, without an override, is still refused. Carol's override of limit 5 on the login zone
// lets 5 wrong logins through to the upstream's 401, and refuses the 6th.
func TestOverrideRaisesChargedBudget(t *testing.T) {
	srv := redistest.Start(t)
	up := startUpstream(t, 300)
	var site strings.Builder
	for i := 1; i <= 3; i++ {
		fmt.Fprintf(&site, `
	route /i%d/* {
		rate_limit_redis {
			redis {
				address %s
			}
			timeout 5s
			zone llm {
				match path */chat
				key {http.request.header.X-API-Key}
				capacity 1000
				refill_rate 1000/1d
				cost 100
				charge openai_usage total
				overrides
			}
			zone login {
				match path */login
				key {http.request.header.X-API-Key}
				algorithm sliding_window_counter
				limit 3
				window 1h
				count_status 401
				overrides
			}
		}
		reverse_proxy %s
	}`, i, srv.Addr, up.URL)
	}
	ac := startCaddyAdmin(t, site.String())
	// expect sends request n of client key to p on handler n%3 and checks its status and, when
	// not empty, its X-RateLimit-Limit.
	expect := func(step string, n int, p, key string, status int, limit string) {
		t.Helper()
		r := ac.Get(fmt.Sprintf("/i%d/%s", n%3+1, p), "X-API-Key", key)
		if r.Status != status || limit != "" && r.Header.Get("X-RateLimit-Limit") != limit {
			t.Fatalf("%s: %d with X-RateLimit-Limit %q, want %d and %q", step, r.Status, r.Header.Get("X-RateLimit-Limit"), status, limit)
		}
	}
	for _, key := range []string{"alice", "bob"} {
		for n := range 4 {
			expect(fmt.Sprintf("%s request %d", key, n+1), n, "chat", key, 200, "1000")
		}
	}
	expect("alice's 5th, 1200 of 1000 spent", 0, "chat", "alice", 429, "")
	ac.put(t, "/rate_limit_redis/override?zone=llm&key=alice", `{"capacity": 10000}`)
	start := time.Now()
	for n := range 10 {
		expect(fmt.Sprintf("alice raised, request %d", n+1), n, "chat", "alice", 200, "10000")
	}
	u, err := strconv.ParseFloat(fmt.Sprint(srv.Do("HGET", "rl:{alice}:llm:tb", "u")), 64)
	refill := time.Since(start).Seconds()*1000/86400 + 1 // and the second before the PUT
	if err != nil || u > 4200 || u < 4200-refill {
		t.Fatalf("alice's bucket holds %v used (%v), want 1200 + 10 × 300 = 4200, less at most %.2f refilled", u, err, refill)
	}
	expect("bob's 5th, no override", 1, "chat", "bob", 429, "")

	ac.put(t, "/rate_limit_redis/override?zone=login&key=carol", `{"limit": 5}`)
	for n := range 5 {
		expect(fmt.Sprintf("carol's wrong login %d", n+1), n, "login", "carol", 401, "5")
	}
	expect("carol's 6th wrong login", 2, "login", "carol", 429, "")
}
