package ratelimitredis

// Plans and tiers (issue 21), end to end through Caddy and a real Redis: zone numbers from a
// `map` of the API key, over three handlers sharing Redis, under concurrent load; a reload that
// moves a key to another plan; a plan change with no reload, past the deny cache, for every
// algorithm; hostile values from a header; the admin API's view of such a zone.

import (
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// reloadableSites is startSites that can load new site bodies on the same ports, as `caddy
// reload` does.
func reloadableSites(t *testing.T, serverOptions string, sites ...string) ([]*caddyServer, func(sites ...string)) {
	t.Helper()
	ports := make([]int, len(sites))
	servers := make([]*caddyServer, len(sites))
	for i := range sites {
		ports[i] = freeLoopbackPort(t)
		servers[i] = &caddyServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(ports[i])}
	}
	load := func(sites ...string) {
		t.Helper()
		if err := loadCaddyfile(t, caddytest.Caddyfile("off", serverOptions, ports, sites)); err != nil {
			t.Fatalf("loading: %v", err)
		}
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	load(sites...)
	return servers, load
}

// burst sends n requests with the header X-API-Key: key at once, spread over servers, and
// returns how many were admitted; each response must be a 200 or a 429 with the plan's quota
// in X-RateLimit-Limit and RateLimit-Policy.
func burst(t *testing.T, servers []*caddyServer, key string, n int, quota int, window int) int {
	t.Helper()
	client := servingClient(10 * time.Second)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		admitted int
		problems []string
	)
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, servers[i%len(servers)].base+"/", nil)
			req.Header.Set("X-API-Key", key)
			<-start
			resp, err := client.Do(req)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				problems = append(problems, err.Error())
				return
			}
			resp.Body.Close()
			limit, policy := resp.Header.Get("X-RateLimit-Limit"), resp.Header.Get("RateLimit-Policy")
			wantPolicy := fmt.Sprintf(`"api";q=%d;w=%d`, quota, window)
			switch {
			case limit != strconv.Itoa(quota) || policy != wantPolicy:
				problems = append(problems, fmt.Sprintf("%d with X-RateLimit-Limit %q, RateLimit-Policy %q: want %d, %s", resp.StatusCode, limit, policy, quota, wantPolicy))
			case resp.StatusCode == 200:
				admitted++
			case resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "":
				problems = append(problems, fmt.Sprintf("status %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After")))
			}
		})
	}
	close(start)
	wg.Wait()
	if len(problems) > 0 {
		t.Fatalf("key %s: %d problems, the first: %s", key, len(problems), problems[0])
	}
	return admitted
}

// planSite is a site whose zone api takes its capacity and refill rate from a map of the API
// key: mappings is the map's body.
func planSite(addr, mappings string) string {
	return fmt.Sprintf(`
	map {http.request.header.X-API-Key} {plan_capacity} {plan_rate} {
%s
	}
	rate_limit_redis {
		redis {
			address %s
		}
		headers both
		timeout 2s # a loaded machine must not make a decision fail open: the test reads its headers
		zone api {
			key {http.request.header.X-API-Key}
			capacity {plan_capacity}
			refill_rate {plan_rate}
		}
	}
	respond "ok"`, mappings, addr)
}

// TestPlansEndToEnd: a map from the API key to a plan, three handlers (sites) sharing one Redis,
// 30 concurrent requests per key spread over the three: the free key gets exactly 3, the paid
// key exactly 10, every response with its own plan's numbers in the headers. Then the map is
// changed and Caddy reloaded: the free key, moved to the paid plan mid-window, gets exactly the
// difference at once (7; a token bucket stores what is used), and the paid key, moved to a plan
// of 25, exactly 15 more.
func TestPlansEndToEnd(t *testing.T) {
	srv := redistest.Start(t)
	before := planSite(srv.Addr, "\t\tkey-paid 10 10/1h\n\t\tdefault 3 3/1h")
	servers, reload := reloadableSites(t, "", before, before, before)
	if got := burst(t, servers, "key-free", 30, 3, 3600); got != 3 {
		t.Fatalf("free key: %d admitted of 30, want exactly 3", got)
	}
	if got := burst(t, servers, "key-paid", 30, 10, 3600); got != 10 {
		t.Fatalf("paid key: %d admitted of 30, want exactly 10", got)
	}
	after := planSite(srv.Addr, "\t\tkey-free 10 10/1h\n\t\tkey-paid 25 25/1h\n\t\tdefault 3 3/1h")
	reload(after, after, after)
	if got := burst(t, servers, "key-free", 30, 10, 3600); got != 7 {
		t.Fatalf("free key moved to the paid plan: %d admitted of 30, want exactly the difference, 7", got)
	}
	if got := burst(t, servers, "key-paid", 30, 25, 3600); got != 15 {
		t.Fatalf("paid key moved to a plan of 25: %d admitted of 30, want exactly 15", got)
	}
	if got := burst(t, servers, "key-other", 30, 3, 3600); got != 3 {
		t.Fatalf("another key on the default plan: %d admitted of 30, want exactly 3", got)
	}
}

// TestPlanChangeWithoutReload: with the numbers from a header (as a trusted gateway in front
// would set it; X-RateLimit-Limit and {http.rate_limit_redis.limit} say them), a client denied under a quota of 3, with its denial in the deny cache, is
// decided by Redis under a quota of 10 and gets exactly the difference, 7, at once; back under
// 3 it is denied again, with Retry-After. For every algorithm: each stores what is used, so a
// larger quota admits the difference, never a fresh quota.
func TestPlanChangeWithoutReload(t *testing.T) {
	if s := time.Now().Unix() % 3600; s > 3590 {
		time.Sleep(time.Duration(3601-s) * time.Second) // the windows of 1h must not turn over during the test
	}
	srv := redistest.Start(t)
	servers, _ := reloadableSites(t, "", fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		deny_cache {
			max_age 1h # "quota 3 again" is answered from the cache however slow the machine
		}
		zone tb {
			match path /token_bucket
			key {http.request.header.X-Client}
			capacity {http.request.header.X-Quota}
			refill_rate 1/1h
		}
		zone sw {
			match path /sliding_window
			key {http.request.header.X-Client}
			algorithm sliding_window
			limit {http.request.header.X-Quota}
			window 1h
		}
		zone fw {
			match path /fixed_window
			key {http.request.header.X-Client}
			algorithm fixed_window
			limit {http.request.header.X-Quota}
			window 1h
		}
		zone sc {
			match path /sliding_window_counter
			key {http.request.header.X-Client}
			algorithm sliding_window_counter
			limit {http.request.header.X-Quota}
			window 1h
		}
	}
	respond "{http.rate_limit_redis.limit}"`, srv.Addr))
	cs := servers[0]
	for _, algorithm := range []string{"token_bucket", "sliding_window", "fixed_window", "sliding_window_counter"} {
		path := "/" + algorithm
		quota := func(q string) string {
			t.Helper()
			var codes []string
			for {
				r := cs.get(path, "X-Client", "alice", "X-Quota", q)
				if r.header.Get("X-RateLimit-Limit") != q || (r.status == 200 && r.body != q) {
					t.Fatalf("%s quota %s: X-RateLimit-Limit %q, {http.rate_limit_redis.limit} %q", algorithm, q, r.header.Get("X-RateLimit-Limit"), r.body)
				}
				codes = append(codes, strconv.Itoa(r.status))
				if r.status != 200 {
					return strings.Join(codes, " ")
				}
			}
		}
		if got := quota("3"); got != "200 200 200 429" {
			t.Fatalf("%s quota 3: %s", algorithm, got)
		}
		calls := srv.ScriptCalls()
		if r := cs.get(path, "X-Client", "alice", "X-Quota", "3"); r.status != 429 || srv.ScriptCalls() != calls {
			t.Fatalf("%s quota 3 again: %d with %d script calls, want 429 from the deny cache", algorithm, r.status, srv.ScriptCalls()-calls)
		}
		if got := quota("10"); got != strings.Repeat("200 ", 7)+"429" {
			t.Fatalf("%s moved to quota 10: %s, want exactly 7 more", algorithm, got)
		}
		r := cs.get(path, "X-Client", "alice", "X-Quota", "3")
		if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); r.status != 429 || ra < 1 || r.header.Get("X-RateLimit-Remaining") != "0" {
			t.Fatalf("%s back to quota 3 with 10 used: %d %v", algorithm, r.status, r.header)
		}
	}
}

// TestPlanHostileValues: zone numbers from a header a client could set, with the values of
// issue 21 and more: each is a 500 whose error (what Caddy logs, shown here by handle_errors)
// names the zone, the number, its placeholder and why, quoting at most 32 bytes of the value;
// none reaches Redis or charges anything. An empty value takes the fallback; without one it
// is a 500 too. In dry_run the request goes on.
func TestPlanHostileValues(t *testing.T) {
	srv := redistest.Start(t)
	site := func(dryRun string) string {
		return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		%s
		zone fallback {
			match path /fallback
			key {http.request.header.X-Client}
			capacity {http.request.header.X-Capacity} 5
			refill_rate 1/1h
		}
		zone bare {
			match path /bare
			key {http.request.header.X-Client}
			capacity {http.request.header.X-Capacity}
			refill_rate {http.request.header.X-Rate} 1/1h
		}
		zone window {
			match path /window
			key {http.request.header.X-Client}
			algorithm sliding_window
			limit {http.request.header.X-Limit} 5
			window {http.request.header.X-Window} 1h
		}
	}
	handle_errors {
		respond "{http.error.status_code} {http.error.message}"
	}
	respond "ok"`, srv.Addr, dryRun)
	}
	servers, _ := reloadableSites(t, "\t\tmax_header_size 256KB", site(""), site("dry_run"))
	cs, dry := servers[0], servers[1]
	digits := strings.Repeat("9", 100<<10)
	const capacityRange = " is out of range (1 to 9007199254740992)"
	const notRate = " is not a number of tokens, optionally per a duration (10, 100/1m)"
	for _, tc := range []struct {
		path, header, value, want string
	}{
		{"/fallback", "X-Capacity", "-1", `"-1"` + capacityRange},
		{"/fallback", "X-Capacity", "0", `"0"` + capacityRange},
		{"/fallback", "X-Capacity", "NaN", `"NaN" is not an integer`},
		{"/fallback", "X-Capacity", "1e309", `"1e309" is not an integer`},
		{"/fallback", "X-Capacity", "1.5", `"1.5" is not an integer`},
		{"/fallback", "X-Capacity", "9007199254740993", `"9007199254740993"` + capacityRange},
		{"/fallback", "X-Capacity", "99999999999999999999", `"99999999999999999999"` + capacityRange},
		{"/fallback", "X-Capacity", "{http.request.header.X-Capacity}", `"{http.request.header.X-Capacity}" is not an integer`},
		{"/fallback", "X-Capacity", digits, `"` + digits[:32] + `"… (102400 bytes) is too long: a number is at most 64 bytes`},
		{"/bare", "X-Rate", "NaN", `"NaN"` + notRate},
		{"/bare", "X-Rate", "1e309", `"1e309"` + notRate},
		{"/bare", "X-Rate", "-1", `"-1" must be > 0`},
		{"/bare", "X-Rate", "0", `"0" must be > 0`},
		{"/bare", "X-Rate", "5/0s", `"5/0s": the duration must be > 0`},
		{"/window", "X-Limit", "1000001", `"1000001" is out of range (1 to 1000000)`},
		{"/window", "X-Window", "0", `"0" is out of range (1ms to 366d)`},
		{"/window", "X-Window", "-1h", `"-1h" is out of range (1ms to 366d)`},
		{"/window", "X-Window", "1e309h", `"1e309h" is not a duration`},
		{"/window", "X-Window", "60", `"60" is not a duration`},
	} {
		zone := strings.TrimPrefix(tc.path, "/")
		headers := []string{"X-Client", "mallory", tc.header, tc.value}
		if zone == "bare" {
			headers = append(headers, "X-Capacity", "5")
		}
		placeholder := "{http.request.header." + tc.header + "}"
		number := map[string]string{"X-Capacity": "capacity", "X-Rate": "refill_rate", "X-Limit": "limit", "X-Window": "window"}[tc.header]
		want := fmt.Sprintf("500 zone %s: %s %s: %s", zone, number, placeholder, tc.want)
		cs.get(tc.path, headers...).expect(t, fmt.Sprintf("%s %s %.40q", tc.path, tc.header, tc.value), 500, want,
			"X-RateLimit-Limit", "", "Retry-After", "")
		dry.get(tc.path, headers...).expect(t, fmt.Sprintf("dry_run %s %s %.40q", tc.path, tc.header, tc.value), 200, "ok")
	}
	// The fill time of capacity and refill_rate together: 5 tokens at 1e-300/s.
	cs.get("/bare", "X-Client", "mallory", "X-Capacity", "5", "X-Rate", "1e-300").expect(t, "refill beyond 366d", 500,
		"500 zone bare: capacity 5 and refill_rate 1e-300: an empty bucket would take 5e+300s to refill; at most 366d is supported")
	// Empty: the fallback, or a 500 without one.
	cs.get("/bare", "X-Client", "mallory").expect(t, "empty without a fallback", 500,
		"500 zone bare: capacity {http.request.header.X-Capacity}: the placeholder is empty and capacity has no fallback "+
			"(write one after the placeholder: capacity {http.request.header.X-Capacity} <n>)")
	if n := srv.ScriptCalls(); n != 0 {
		t.Fatalf("%d script calls: a hostile number reached Redis", n)
	}
	cs.get("/fallback", "X-Client", "mallory", "X-Capacity", "").expect(t, "empty with a fallback", 200, "ok",
		"X-RateLimit-Limit", "5", "X-RateLimit-Remaining", "4")
	cs.get("/fallback", "X-Client", "mallory").expect(t, "absent with a fallback", 200, "ok",
		"X-RateLimit-Limit", "5", "X-RateLimit-Remaining", "3")
	cs.get("/window", "X-Client", "mallory").expect(t, "window, both empty: the fallbacks", 200, "ok",
		"X-RateLimit-Limit", "5", "X-RateLimit-Remaining", "4")
	cs.get("/bare", "X-Client", "mallory", "X-Capacity", "2").expect(t, "bare, a good value: nothing was charged before", 200, "ok",
		"X-RateLimit-Limit", "2", "X-RateLimit-Remaining", "1")
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
		ac.get("/", "X-API-Key", "key-paid").expect(t, "paid", 200, "ok")
	}
	zones := adminJSON[[]zoneInfo](t, ac, "GET", "/rate_limit_redis/zones", 200)
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
	st := adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?"+q.Encode(), 200)
	if len(st) != 1 || st[0].Limit != 10 || st[0].Remaining != 8 || st[0].Numbers == nil ||
		*st[0].Numbers != (stateNumbers{Capacity: 10, RefillRate: 10.0 / 3600}) {
		t.Fatalf("state with the paid numbers: %+v", st)
	}
	// The same state read under the free numbers (refill_rate's fallback): 2 used of 3.
	st = adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=api&key=key-paid&capacity=3", 200)
	if len(st) != 1 || st[0].Limit != 3 || st[0].Remaining != 1 || *st[0].Numbers != (stateNumbers{Capacity: 3, RefillRate: 1.0 / 3600}) {
		t.Fatalf("state with the free numbers: %+v", st)
	}
	st = adminJSON[[]clientState](t, ac, "GET", "/rate_limit_redis/state?zone=daily&key=key-paid", 200)
	if len(st) != 1 || st[0].Limit != 30 || st[0].Count == nil || *st[0].Count != 2 || *st[0].Numbers != (stateNumbers{Limit: 30}) {
		t.Fatalf("daily state with the fallback: %+v", st)
	}
}

// TestPlanNumberErrorLogged: an unusable number is logged at error level by the handler's
// logger with the zone and the reason, also when handle_errors handles the 500 (Caddy then logs
// the handler's error at debug level only), and the value is quoted by its first 32 bytes.
func TestPlanNumberErrorLogged(t *testing.T) {
	srv := redistest.Start(t)
	lc := startLoggedCaddy(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone plan {
			capacity {http.request.header.X-Capacity}
			refill_rate 1
		}
	}
	handle_errors {
		respond "sorry" 500
	}
	respond "ok"`, srv.Addr))
	lc.get("/", "X-Capacity", "-1"+strings.Repeat("0", 1000)).expect(t, "hostile capacity", 500, "sorry")
	lines := withMsg(ours(lc.lines()), "a zone number from a placeholder is unusable")
	want := `zone plan: capacity {http.request.header.X-Capacity}: "-1000000000000000000000000000000"… (1002 bytes) is too long: a number is at most 64 bytes`
	if len(lines) != 1 || lines[0].fields["level"] != "error" || lines[0].fields["zone"] != "plan" || lines[0].fields["error"] != want {
		t.Fatalf("log lines %v, want one error line with %q", lines, want)
	}
}
