package ratelimitredis

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// listZone is a token bucket zone of 1 request an hour per X-Client (a request without one
// skips it), with a 1m block (1h for a repeat offender) and overrides.
func listZone(name string) *Zone {
	return &Zone{
		Name: name, Key: []string{"{http.request.header.X-Client}"}, Capacity: NumberOf(1), RefillRate: NumberOf(1.0 / 3600),
		Block: caddy.Duration(time.Minute), BlockMax: caddy.Duration(time.Hour), Overrides: true, EmptyKey: EmptyKeySkip,
	}
}

// listRedis is the redis config of a test's handlers on addrs (more than one: a Redis Cluster),
// with a dial timeout that a loaded machine meets.
func listRedis(addrs ...string) *RedisConfig {
	return &RedisConfig{Addresses: addrs, Cluster: len(addrs) > 1, DialTimeout: caddy.Duration(5 * time.Second)}
}

// adminServe serves r with the admin API route of a that serves r's path, as Caddy's admin
// server calls it, and returns its error.
func adminServe(t *testing.T, a *adminapi.AdminAPI, w http.ResponseWriter, r *http.Request) error {
	t.Helper()
	for _, route := range a.Routes() {
		if route.Pattern == r.URL.Path {
			return route.Handler.ServeHTTP(w, r)
		}
	}
	t.Fatalf("no admin route serves %s", r.URL.Path)
	return nil
}

// adminCall calls the admin API route of a that serves path (with its query) and returns the
// status and body: the error's message for an error.
func adminCall(t *testing.T, a *adminapi.AdminAPI, method, path string) (int, string) {
	t.Helper()
	w := httptest.NewRecorder()
	err := adminServe(t, a, w, httptest.NewRequest(method, path, nil))
	var ae caddy.APIError
	switch {
	case errors.As(err, &ae):
		return ae.HTTPStatus, ae.Err.Error()
	case err != nil:
		return http.StatusInternalServerError, err.Error()
	}
	return http.StatusOK, w.Body.String()
}

// listPageOf calls a listing (path with its query) and decodes its page, which must have no
// field that adminapi.ListPage[T] lacks.
func listPageOf[T any](t *testing.T, a *adminapi.AdminAPI, path string) adminapi.ListPage[T] {
	t.Helper()
	code, body := adminCall(t, a, http.MethodGet, path)
	if code != http.StatusOK {
		t.Fatalf("GET %s: %d %s", path, code, body)
	}
	var p adminapi.ListPage[T]
	dec := json.NewDecoder(strings.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		t.Fatalf("GET %s: decoding %s: %v", path, body, err)
	}
	return p
}

// redisKeyOf is the Redis key of a listing's entry.
func redisKeyOf(e any) string {
	switch e := e.(type) {
	case adminapi.BlockEntry:
		return e.RedisKey
	case adminapi.OverrideEntry:
		return e.RedisKey
	}
	panic(fmt.Sprintf("%T is no listing's entry", e))
}

// listAll pages through the listing path (with its query) count entries at a time, and returns
// how many times each Redis key was listed and the number of pages.
func listAll[T adminapi.BlockEntry | adminapi.OverrideEntry](t *testing.T, a *adminapi.AdminAPI, path string, count int) (seen map[string]int, pages int) {
	t.Helper()
	seen = map[string]int{}
	cursor := ""
	for {
		p := listPageOf[T](t, a, fmt.Sprintf("%s&count=%d&cursor=%s", path, count, url.QueryEscape(cursor)))
		pages++
		for _, e := range p.Entries {
			seen[redisKeyOf(e)]++
		}
		if p.Cursor == "" {
			return seen, pages
		}
		if pages > 10_000 {
			t.Fatalf("%s: still a cursor after %d pages", path, pages)
		}
		cursor = p.Cursor
	}
}

// eachOnce fails unless seen holds every key of want exactly once and no other.
func eachOnce(t *testing.T, what string, seen map[string]int, want []string) {
	t.Helper()
	for _, k := range want {
		if seen[k] != 1 {
			t.Errorf("%s: %s listed %d times, want once", what, k, seen[k])
		}
	}
	if len(seen) != len(want) {
		t.Errorf("%s: %d keys listed, want %d", what, len(seen), len(want))
	}
}

// setUp blocks or overrides each client in zone z of h, through the limiter as the admin API
// does.
func setUp(t *testing.T, h *Handler, zone string, block bool, clients []string) {
	t.Helper()
	for _, z := range h.Zones {
		if z.Name != zone {
			continue
		}
		for _, c := range clients {
			var err error
			if block {
				_, err = h.limiter.Block(t.Context(), &z.lz, c, time.Hour)
			} else {
				err = h.limiter.SetOverride(t.Context(), &z.lz, c, limiter.Override{Capacity: 7}, 0)
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		return
	}
	t.Fatalf("no zone %s", zone)
}

// clientNames returns n client keys: prefix and a number.
func clientNames(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%d", prefix, i)
	}
	return out
}

// keysOf returns the Redis keys of clients' blocks or overrides in zone z under prefix.
func keysOf(prefix, zone string, block bool, clients []string) []string {
	out := make([]string, len(clients))
	for i, c := range clients {
		if block {
			out[i] = limiter.BlockKey(prefix, tbZone(zone), c)
		} else {
			out[i] = limiter.OverrideKey(prefix, tbZone(zone), c)
		}
	}
	return out
}

// sentCommands returns the commands srv ran since its stats were reset, but those the tests
// send themselves and PING (the reset broadcast's health check).
func sentCommands(t *testing.T, srv *redistest.Server) []string {
	t.Helper()
	var sent []string
	for name, s := range commandStats(t, srv) {
		if s[0] > 0 && !slices.Contains(testCommands, name) && name != "ping" && name != "keys" && name != "dbsize" {
			sent = append(sent, name)
		}
	}
	slices.Sort(sent)
	return sent
}

// TestListBlocksAndOverrides: each listing reports every client of the zone with its fields (a
// natural block, an admin block, an ended block remembered for its strikes, a hashed key;
// overrides with and without an expiry), and sends Redis read commands only.
func TestListBlocksAndOverrides(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{Redis: listRedis(srv.Addr), Timeout: caddy.Duration(5 * time.Second), Zones: []*Zone{listZone("api")}})
	a := adminapi.New(h.live)
	long := "tok en{x}" + strings.Repeat("x", 80)
	for _, c := range []string{"alice", long} { // the second request is denied: a 1m block
		for i, admitted := range []bool{true, false} {
			r := httptest.NewRequest(http.MethodGet, "/", nil)
			r.Header.Set("X-Client", c)
			var he caddyhttp.HandlerError
			if _, err, next := serve(h, r); next != admitted || (!admitted && (!errors.As(err, &he) || he.StatusCode != 429)) {
				t.Fatalf("%s request %d: admitted %v, error %v; want admitted %v", c, i+1, next, err, admitted)
			}
		}
	}
	for _, c := range []struct{ method, path string }{
		{"PUT", "/rate_limit_redis/block?zone=api&key=bob&for=1h"},
		{"PUT", "/rate_limit_redis/block?zone=api&key=erin&for=1s"},
	} {
		if code, body := adminCall(t, a, c.method, c.path); code != 200 {
			t.Fatalf("%s %s: %d %s", c.method, c.path, code, body)
		}
	}
	for key, body := range map[string]string{"carol": `{"capacity": 5, "expires_in": "1h"}`, "dave": `{"capacity": 3, "refill_rate": "3/1m"}`} {
		if code, out := adminOverride(t, a, http.MethodPut, "zone=api&key="+key, body); code != 200 {
			t.Fatalf("PUT override %s: %d %s", key, code, out)
		}
	}
	redistest.WaitFor(t, 10*time.Second, "erin's 1s block to end", func() bool { return srv.Time().UnixMicro() > blockUntil(t, srv, "rl:{erin}:api:block") })

	srv.Do("CONFIG", "RESETSTAT")
	keysBefore := srv.Keys(t)
	blocks := listPageOf[adminapi.BlockEntry](t, a, "/rate_limit_redis/blocks?zone=api")
	overrides := listPageOf[adminapi.OverrideEntry](t, a, "/rate_limit_redis/overrides?zone=api")
	if sent := sentCommands(t, srv); !slices.Equal(sent, []string{"get", "hgetall", "pttl", "scan", "time"}) {
		t.Errorf("the listings sent %v, want only GET, HGETALL, PTTL, SCAN and TIME", sent)
	}
	if keys := srv.Keys(t); !sameSet(keys, keysBefore) {
		t.Errorf("keys after the listings: %v, before: %v", keys, keysBefore)
	}

	if blocks.Cursor != "" || len(blocks.Entries) != 4 {
		t.Fatalf("blocks: %+v, want 4 entries and no cursor", blocks)
	}
	slices.SortFunc(blocks.Entries, func(x, y adminapi.BlockEntry) int { return strings.Compare(x.RedisKey, y.RedisKey) })
	digest := limiter.ClientKey(long)
	want := []struct {
		key, redisKey   string
		hashed, blocked bool
		leftMs, lastMs  int64 // leftMs: the most left, less a minute of slack
	}{
		{"alice", "rl:{alice}:api:block", false, true, 60_000, 60_000},
		{"bob", "rl:{bob}:api:block", false, true, 3_600_000, 3_600_000},
		{"erin", "rl:{erin}:api:block", false, false, 0, 1000},
		{digest, "rl:{" + digest + "}:api:block", true, true, 60_000, 60_000},
	}
	for i, w := range want {
		e := blocks.Entries[i]
		if e.Zone != "api" || e.Key != w.key || e.RedisKey != w.redisKey || e.Hashed != w.hashed || e.Candidate != 1 ||
			!slices.Equal(e.Redis, []string{srv.Addr}) || e.Blocked != w.blocked || e.Strikes != 1 || e.LastBlockMs != w.lastMs ||
			e.LeftMs > w.leftMs || (w.blocked && e.LeftMs <= w.leftMs-60_000) || (e.BlockedUntilMs != nil) != w.blocked {
			t.Errorf("block %d: %+v, want %+v", i, e, w)
		}
		if e.BlockedUntilMs != nil {
			if until := blockUntil(t, srv, w.redisKey) / 1000; *e.BlockedUntilMs != until {
				t.Errorf("%s: blocked_until_ms %d, Redis holds %d", w.key, *e.BlockedUntilMs, until)
			}
		}
	}

	if overrides.Cursor != "" || len(overrides.Entries) != 2 {
		t.Fatalf("overrides: %+v, want 2 entries and no cursor", overrides)
	}
	slices.SortFunc(overrides.Entries, func(x, y adminapi.OverrideEntry) int { return strings.Compare(x.Key, y.Key) })
	carol, dave := overrides.Entries[0], overrides.Entries[1]
	if carol.Key != "carol" || carol.RedisKey != "rl:{carol}:api:ov" || carol.Hashed || carol.Capacity != 5 || carol.RefillRate != 0 ||
		carol.ExpiresInMs <= 3_540_000 || carol.ExpiresInMs > 3_600_000 {
		t.Errorf("carol's override: %+v, want capacity 5 for just under an hour", carol)
	}
	if dave.Key != "dave" || dave.RedisKey != "rl:{dave}:api:ov" || dave.Capacity != 3 || dave.RefillRate != 0.05 || dave.ExpiresInMs != 0 {
		t.Errorf("dave's override: %+v, want capacity 3, refill_rate 0.05, no expiry", dave)
	}
}

// blockUntil reads when the block of Redis key key ends, in µs since the Unix epoch.
func blockUntil(t *testing.T, srv *redistest.Server, key string) int64 {
	t.Helper()
	v, _ := srv.Do("GET", key).(string)
	var until int64
	if _, err := fmt.Sscanf(v, "%d:", &until); err != nil {
		t.Fatalf("block %s: %q: %v", key, v, err)
	}
	return until
}

// sameSet reports whether a and b hold the same strings.
func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// TestListPagesEachClientOnce: paged a few entries at a time, a listing returns each of 250
// clients exactly once, and none of the zones whose names begin with the zone's or that it
// begins with, nor of another key prefix (one with glob characters) in the same Redis, nor keys
// that only look like the zone's or hold what its decisions cannot read.
func TestListPagesEachClientOnce(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{Redis: listRedis(srv.Addr), Zones: []*Zone{listZone("ap"), listZone("api"), listZone("api2")}})
	other := provisioned(t, &Handler{Redis: listRedis(srv.Addr), KeyPrefix: `x[1]?*\:`, Zones: []*Zone{listZone("api")}})
	clients := clientNames("client-", 250)
	for _, zone := range []string{"ap", "api", "api2"} {
		setUp(t, h, zone, true, clients)
		setUp(t, h, zone, false, clients)
	}
	few := clientNames("other-", 20)
	setUp(t, other, "api", true, few)
	setUp(t, other, "api", false, few)
	a, ao := adminapi.New(h.live), adminapi.New(other.live)
	// Keys that SCAN's pattern rl:{*}:api:block matches but that are no client's block of zone
	// api (no client key holds a brace): written by something else, never listed.
	for _, k := range []string{"rl:{x}:other}:api:block", "rl:{x{y}:api:block", "rl:{x}:other}:api:ov", "rl:{x{y}:api:ov"} {
		srv.Do("SET", k, "9999999999999999:1000000:1")
	}
	// Keys of the zone's form holding what the decisions cannot read (another type, a value of
	// another form): left out, and the rest listed.
	srv.Do("HSET", "rl:{junk}:api:block", "capacity", "1")
	srv.Do("SET", "rl:{junk2}:api:block", "forever")
	srv.Do("SET", "rl:{junk}:api:ov", "9999999999999999:1000000:1")
	srv.Do("HSET", "rl:{junk2}:api:ov", "capacity", "lots")

	for _, block := range []bool{true, false} {
		path, kind := "/rate_limit_redis/overrides?zone=api", "overrides"
		var all func(a *adminapi.AdminAPI, count int) (map[string]int, int)
		if block {
			path, kind = "/rate_limit_redis/blocks?zone=api", "blocks"
			all = func(a *adminapi.AdminAPI, count int) (map[string]int, int) {
				return listAll[adminapi.BlockEntry](t, a, path, count)
			}
		} else {
			all = func(a *adminapi.AdminAPI, count int) (map[string]int, int) {
				return listAll[adminapi.OverrideEntry](t, a, path, count)
			}
		}
		seen, pages := all(a, 7)
		eachOnce(t, kind+" 7 at a time", seen, keysOf("rl:", "api", block, clients))
		if pages < 250/8 {
			t.Errorf("%s 7 at a time: %d pages for 250 clients", kind, pages)
		}
		seen, pages = all(a, 1000)
		eachOnce(t, kind+" 1000 at a time", seen, keysOf("rl:", "api", block, clients))
		if pages != 1 {
			t.Errorf("%s 1000 at a time: %d pages for 250 clients, want 1", kind, pages)
		}
		seen, _ = all(ao, 3)
		eachOnce(t, kind+" under the prefix x[1]?*\\:", seen, keysOf(`x[1]?*\:`, "api", block, few))
	}
}

// TestListOnCluster: on a Redis Cluster of 3 primaries, a listing pages through every primary
// and returns each client once.
func TestListOnCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	h := provisioned(t, &Handler{Redis: listRedis(c.Addrs()...), Zones: []*Zone{listZone("api")}})
	clients := clientNames("client-", 120)
	setUp(t, h, "api", true, clients)
	setUp(t, h, "api", false, clients)
	for i, n := range c.Nodes {
		if got := len(n.Keys(t)); got < 20 {
			t.Fatalf("primary %d holds %d of the 240 keys: the clients are not spread", i, got)
		}
	}
	a := adminapi.New(h.live)
	seen, _ := listAll[adminapi.BlockEntry](t, a, "/rate_limit_redis/blocks?zone=api", 10)
	eachOnce(t, "blocks", seen, keysOf("rl:", "api", true, clients))
	seen, _ = listAll[adminapi.OverrideEntry](t, a, "/rate_limit_redis/overrides?zone=api", 10)
	eachOnce(t, "overrides", seen, keysOf("rl:", "api", false, clients))
	// The cursor's second part counts the 3 primaries from 0.
	if code, body := adminCall(t, a, http.MethodGet, "/rate_limit_redis/blocks?zone=api&cursor=0.2.0"); code != 200 {
		t.Errorf("the third primary's start: %d %s", code, body)
	}
	if code, body := adminCall(t, a, http.MethodGet, "/rate_limit_redis/blocks?zone=api&cursor=0.3.0"); code != 400 ||
		body != `cursor: "0.3.0" is not a cursor of this listing: give the cursor of the last page, or none to start again` {
		t.Errorf("a fourth primary: %d %s", code, body)
	}
}

// TestListHostileInput: a listing's bad parameters are each a 400 naming the fault, with no
// Redis command sent and nothing written.
func TestListHostileInput(t *testing.T) {
	srv := redistest.Start(t)
	plain := &Zone{Name: "plain", Key: []string{"{http.request.header.X-Client}"}, Capacity: NumberOf(1), RefillRate: NumberOf(1)}
	h := provisioned(t, &Handler{Redis: listRedis(srv.Addr), Zones: []*Zone{listZone("api"), plain}})
	setUp(t, h, "api", true, clientNames("c", 3))
	a := adminapi.New(h.live)
	listPageOf[adminapi.BlockEntry](t, a, "/rate_limit_redis/blocks?zone=api") // connections open
	keysBefore := srv.Keys(t)
	srv.Do("CONFIG", "RESETSTAT")

	countErr := func(v string) string { return fmt.Sprintf("count: %q must be one integer from 1 to 1000", v) }
	cursorErr := func(v string) string {
		return fmt.Sprintf("cursor: %q is not a cursor of this listing: give the cursor of the last page, or none to start again", v)
	}
	for _, list := range []string{"blocks", "overrides"} {
		base := "/rate_limit_redis/" + list + "?zone=api"
		for _, c := range []struct{ path, msg string }{
			{"/rate_limit_redis/" + list, "query parameter zone is required"},
			{"/rate_limit_redis/" + list + "?zone=", "query parameter zone is required"},
			{"/rate_limit_redis/" + list + "?zone=nope", `no rate_limit_redis zone named "nope" is loaded`},
			{"/rate_limit_redis/" + list + "?zone=ap%2A", `no rate_limit_redis zone named "ap*" is loaded`},
			{base + "&count=abc", countErr("abc")},
			{base + "&count=", countErr("")},
			{base + "&count=0", countErr("0")},
			{base + "&count=-1", countErr("-1")},
			{base + "&count=1001", countErr("1001")},
			{base + "&count=1e3", countErr("1e3")},
			{base + "&count=99999999999999999999", countErr("99999999999999999999")},
			{base + "&count=5&count=6", countErr("5,6")},
			{base + "&cursor=x", cursorErr("x")},
			{base + "&cursor=0.0", cursorErr("0.0")},
			{base + "&cursor=0.0.0.0", cursorErr("0.0.0.0")},
			{base + "&cursor=1.0.0", cursorErr("1.0.0")},
			{base + "&cursor=-1.0.0", cursorErr("-1.0.0")},
			{base + "&cursor=0.1.0", cursorErr("0.1.0")},
			{base + "&cursor=0.0.-1", cursorErr("0.0.-1")},
			{base + "&cursor=0.0.18446744073709551616", cursorErr("0.0.18446744073709551616")},
		} {
			if code, msg := adminCall(t, a, http.MethodGet, c.path); code != 400 || msg != c.msg {
				t.Errorf("GET %s: %d %q, want 400 %q", c.path, code, msg, c.msg)
			}
		}
		if code, msg := adminCall(t, a, http.MethodPost, base); code != 405 || msg != "method POST not allowed: use GET" {
			t.Errorf("POST %s: %d %q, want 405", base, code, msg)
		}
	}
	for path, msg := range map[string]string{
		"/rate_limit_redis/blocks?zone=plain":    "zone plain has no block: no client of it is ever blocked",
		"/rate_limit_redis/overrides?zone=plain": "zone plain has no overrides: add `overrides` to its block to set a client's numbers at run time",
	} {
		if code, got := adminCall(t, a, http.MethodGet, path); code != 400 || got != msg {
			t.Errorf("GET %s: %d %q, want 400 %q", path, code, got, msg)
		}
	}
	if sent := sentCommands(t, srv); len(sent) > 0 {
		t.Errorf("bad requests sent %v to Redis", sent)
	}
	if keys := srv.Keys(t); !sameSet(keys, keysBefore) {
		t.Errorf("keys after the bad requests: %v, before: %v", keys, keysBefore)
	}
}

// TestListOnSentinel: with Sentinel, a listing pages through the current primary.
func TestListOnSentinel(t *testing.T) {
	ss := redistest.StartSentinels(t, time.Second)
	h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: ss.Addrs(), Sentinel: ss.Master, DialTimeout: caddy.Duration(5 * time.Second)},
		Zones: []*Zone{listZone("api")}})
	clients := clientNames("client-", 40)
	setUp(t, h, "api", true, clients)
	setUp(t, h, "api", false, clients)
	a := adminapi.New(h.live)
	seen, _ := listAll[adminapi.BlockEntry](t, a, "/rate_limit_redis/blocks?zone=api", 6)
	eachOnce(t, "blocks", seen, keysOf("rl:", "api", true, clients))
	seen, _ = listAll[adminapi.OverrideEntry](t, a, "/rate_limit_redis/overrides?zone=api", 6)
	eachOnce(t, "overrides", seen, keysOf("rl:", "api", false, clients))
}

// TestListPageBounded: among 20,000 keys of which 3 are the zone's, a page of count 1 makes at
// most adminapi.MaxScanCalls SCAN calls and returns a cursor to go on with; the pages together list the
// 3 clients once each.
func TestListPageBounded(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{Redis: listRedis(srv.Addr), Zones: []*Zone{listZone("api")}})
	args := []any{"MSET"}
	for i := range 20_000 {
		args = append(args, fmt.Sprintf("other:{%d}:api:tb", i), "1")
	}
	srv.Do(args...)
	clients := clientNames("c", 3)
	setUp(t, h, "api", true, clients)
	a := adminapi.New(h.live)
	srv.Do("CONFIG", "RESETSTAT")
	first := listPageOf[adminapi.BlockEntry](t, a, "/rate_limit_redis/blocks?zone=api&count=1")
	if scans := commandStats(t, srv)["scan"][0]; scans < 1 || scans > adminapi.MaxScanCalls {
		t.Errorf("the first page made %d SCAN calls, want 1 to %d", scans, adminapi.MaxScanCalls)
	}
	if first.Cursor == "" {
		t.Errorf("the first page of count 1 among 20,003 keys ended the listing: %+v", first)
	}
	seen, pages := listAll[adminapi.BlockEntry](t, a, "/rate_limit_redis/blocks?zone=api", 1)
	eachOnce(t, "blocks", seen, keysOf("rl:", "api", true, clients))
	t.Logf("%d pages of count 1 among 20,003 keys", pages)
}

// TestListZoneInSeveralHandlers: a zone in three handlers, two of them with one key prefix and
// the third with another, on one Redis: a listing goes through both prefixes and returns each
// client once.
func TestListZoneInSeveralHandlers(t *testing.T) {
	srv := redistest.Start(t)
	live := newRegistry()
	var hs []*Handler
	for _, prefix := range []string{"rl:", "rl:", "b:"} {
		hs = append(hs, provisioned(t, &Handler{live: live, Redis: listRedis(srv.Addr), KeyPrefix: prefix, Zones: []*Zone{listZone("api")}}))
	}
	first, second := clientNames("a", 30), clientNames("b", 20)
	setUp(t, hs[0], "api", true, first)
	setUp(t, hs[2], "api", true, second)
	seen, _ := listAll[adminapi.BlockEntry](t, adminapi.New(live), "/rate_limit_redis/blocks?zone=api", 4)
	eachOnce(t, "blocks", seen, append(keysOf("rl:", "api", true, first), keysOf("b:", "api", true, second)...))
}
