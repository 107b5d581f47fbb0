package e2e_test

// The rate limit response headers (headers.go): the IETF RateLimit-Policy and RateLimit fields
// list every zone that applied, each item a valid Structured Field; RateLimit's t is the time
// until more quota, never after a 429's Retry-After; sub-second windows; which methods count;
// Retry-After jitter.

import (
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dunglas/httpsfv"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// sfItem is one member of an IETF RateLimit field: the policy name and its Integer parameters.
type sfItem struct {
	name   string
	params map[string]int64
}

// parseField parses the field name of r with a real RFC 8941/9651 parser (dunglas/httpsfv) and
// checks what both drafts require of its members: each an Item whose value is a String, with
// only Integer parameters, among them every one of required.
func parseField(t *testing.T, r caddytest.Response, name string, required ...string) []sfItem {
	t.Helper()
	values := r.Header.Values(name)
	if len(values) == 0 {
		t.Fatalf("%s missing (all: %v)", name, r.Header)
	}
	list, err := httpsfv.UnmarshalList(values)
	if err != nil {
		t.Fatalf("%s %q is not a Structured Field List: %v", name, values, err)
	}
	items := make([]sfItem, 0, len(list))
	for _, m := range list {
		item, ok := m.(httpsfv.Item)
		if !ok {
			t.Fatalf("%s %q: member %#v is not an Item", name, values, m)
		}
		policy, ok := item.Value.(string)
		if !ok {
			t.Fatalf("%s %q: item value %#v is a %T, want a String", name, values, item.Value, item.Value)
		}
		it := sfItem{name: policy, params: make(map[string]int64)}
		for _, p := range item.Params.Names() {
			v, _ := item.Params.Get(p)
			n, ok := v.(int64)
			if !ok || n < 0 {
				t.Fatalf("%s %q: parameter %s = %#v, want a non-negative Integer", name, values, p, v)
			}
			it.params[p] = n
		}
		for _, p := range required {
			if _, ok := it.params[p]; !ok {
				t.Fatalf("%s %q: item %q has no %s", name, values, policy, p)
			}
		}
		items = append(items, it)
	}
	return items
}

// ietf parses both IETF fields of r and checks them against each other and the response: the
// same policies in the same order, no policy twice, w > 0, and on a 429 with Retry-After, every
// t at most the Retry-After. It returns the RateLimit items.
func ietf(t *testing.T, step string, r caddytest.Response) []sfItem {
	t.Helper()
	policies := parseField(t, r, "RateLimit-Policy", "q", "w")
	limits := parseField(t, r, "RateLimit", "r", "t")
	if len(policies) != len(limits) {
		t.Fatalf("%s: %d policies, %d service limits: %v / %v", step, len(policies), len(limits), policies, limits)
	}
	seen := make(map[string]bool)
	for i := range policies {
		if policies[i].name != limits[i].name || seen[policies[i].name] {
			t.Fatalf("%s: policies %v and limits %v do not name the same zones once each", step, policies, limits)
		}
		seen[policies[i].name] = true
		if policies[i].params["w"] < 1 {
			t.Fatalf("%s: %v: w must be > 0", step, policies[i])
		}
	}
	if ra := r.Header.Get("Retry-After"); ra != "" {
		retry, err := strconv.ParseInt(ra, 10, 64)
		if err != nil {
			t.Fatalf("%s: Retry-After %q", step, ra)
		}
		for _, l := range limits {
			if l.params["t"] > retry {
				t.Fatalf("%s: %s t=%d is after Retry-After %d (%v)", step, l.name, l.params["t"], retry, r.Header)
			}
		}
	}
	return limits
}

// TestIETFFieldsEveryZone: RateLimit-Policy and RateLimit carry one item per zone
// that applied to the request, the deciding zone first, each a valid Structured Field List
// member; the legacy headers describe the deciding zone only.
func TestIETFFieldsEveryZone(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		headers both
		zone api {
			capacity 3
			refill_rate 1/2s
		}
		zone login {
			match path /login
			algorithm sliding_window
			limit 2
			window 1m
		}
	}
	respond "ok"`, srv.Addr))

	// One zone: a full bucket of 3 refilling 1 per 2s, one request taken; the next token is 2s
	// away, the bucket full again in 2s.
	r := cs.Get("/")
	r.Expect(t, "one zone", 200, "ok", "RateLimit-Policy", `"api";q=3;w=6`, "RateLimit", `"api";r=2;t=2`,
		"X-RateLimit-Limit", "3", "X-RateLimit-Remaining", "2", "X-RateLimit-Reset", "2")
	ietf(t, "one zone", r)

	// Two zones: api decides (1 of 3 left is less than login's 1 of 2), then login.
	r = cs.Get("/login")
	if r.Status != 200 || r.Header.Get("RateLimit-Policy") != `"api";q=3;w=6, "login";q=2;w=60` || r.Header.Get("X-RateLimit-Limit") != "3" {
		t.Fatalf("two zones: %d %v", r.Status, r.Header)
	}
	items := ietf(t, "two zones", r)
	if items[0].name != "api" || items[0].params["r"] != 1 || items[1].name != "login" || items[1].params["r"] != 1 || items[1].params["t"] != 60 {
		t.Fatalf("two zones: RateLimit %q, want api r=1 then login r=1 t=60", r.Header.Get("RateLimit"))
	}
	if tt := items[0].params["t"]; tt < 1 || tt > 2 {
		t.Fatalf("two zones: api t=%d, want the next token, 1 or 2s away", tt)
	}

	// login denies: it decides, and is first; api follows, uncharged. The legacy headers are
	// login's. Then the deny cache answers, listing what it knows.
	cs.Get("/login")
	for i := range 3 {
		step := "login denies " + strconv.Itoa(i)
		r = cs.Get("/login")
		if r.Status != 429 || r.Header.Get("X-RateLimit-Limit") != "2" || r.Header.Get("Retry-After") == "" {
			t.Fatalf("%s: %d %v", step, r.Status, r.Header)
		}
		items = ietf(t, step, r)
		if items[0].name != "login" || items[0].params["r"] != 0 {
			t.Fatalf("%s: RateLimit %q, want login first with r=0", step, r.Header.Get("RateLimit"))
		}
		if i == 0 && (len(items) != 2 || items[1].name != "api") {
			t.Fatalf("%s: RateLimit %q, want login then api", step, r.Header.Get("RateLimit"))
		}
	}

	// api alone, empty (already, or after this request): a 429 whose t is its Retry-After (only
	// time cures it).
	cs.Get("/")
	r = cs.Get("/")
	if r.Status != 429 {
		t.Fatalf("api empty: %d", r.Status)
	}
	items = ietf(t, "api empty", r)
	if len(items) != 1 || strconv.FormatInt(items[0].params["t"], 10) != r.Header.Get("Retry-After") {
		t.Fatalf("api empty: RateLimit %q, Retry-After %q: want one item whose t is the Retry-After",
			r.Header.Get("RateLimit"), r.Header.Get("Retry-After"))
	}
}

// TestRateLimitTTokenBucket: t is the whole seconds until the next token: after one
// request to a full bucket of 3 refilling 1 per 2s, 2; on every 429, the Retry-After exactly
// (cost 1: the next token is what the request waits for), while X-RateLimit-Reset keeps meaning
// the time until the bucket is full: 6s less the time since the first request at most (less at
// most twice that for a denial from the deny cache, whose times count from when the denying call
// was sent), measured on Redis's clock around the requests.
func TestRateLimitTTokenBucket(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		headers both
		capacity 3
		refill_rate 1/2s
	}
	respond "ok"`, srv.Addr))
	a := srv.Time()
	r := cs.Get("/")
	r.Expect(t, "first", 200, "ok", "RateLimit", `"default";r=2;t=2`, "X-RateLimit-Reset", "2")
	ietf(t, "first", r)
	for i := 2; i <= 3; i++ {
		r = cs.Get("/")
		items := ietf(t, "request "+strconv.Itoa(i), r)
		if tt := items[0].params["t"]; r.Status != 200 || tt < 1 || tt > 2 {
			t.Fatalf("request %d: %d, RateLimit %q: want t <= 2", i, r.Status, r.Header.Get("RateLimit"))
		}
	}
	// Empty now: time until full is about 6s, the next token about 2s away. The 3 tokens used
	// since a (the first request's decision or later) drain at 0.5/s, so the bucket is full in
	// 6s less the time since at most; a cached denial counts from its call's sending, which
	// lowers that by up to the time since a again.
	for i := range 5 {
		step := "denial " + strconv.Itoa(i)
		r = cs.Get("/")
		d := srv.Time()
		items := ietf(t, step, r)
		if r.Status != 429 || strconv.FormatInt(items[0].params["t"], 10) != r.Header.Get("Retry-After") {
			t.Fatalf("%s: %d, RateLimit %q, Retry-After %q: want t = Retry-After", step, r.Status, r.Header.Get("RateLimit"), r.Header.Get("Retry-After"))
		}
		lo := int(math.Ceil((6*time.Second - 2*d.Sub(a)).Seconds()))
		if reset, _ := strconv.Atoi(r.Header.Get("X-RateLimit-Reset")); reset < lo || reset > 6 {
			t.Fatalf("%s: X-RateLimit-Reset %d, want the time until full, %d to 6s", step, reset, lo)
		}
	}
}

// TestRateLimitTSlidingWindow: a sliding window's t is the time until its oldest
// entry leaves the window, to the second, on admissions and on 429s (where it is the
// Retry-After). Each response's t is checked against the bounds Redis's clock gives (TIME read
// before the request is sent and after its reply: the clock the script reads, so no skew or
// rounding between this process's clock and Redis's can widen them): the oldest entry was
// written between A and B, the response decided between C and D, so its next slot comes between
// A+W-D and B+W-C.
func TestRateLimitTSlidingWindow(t *testing.T) {
	srv := redistest.Start(t)
	const window = 3 * time.Second
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		timeout 2s # a loaded machine must not make a decision fail open: the test reads its headers
		headers ietf
		deny_cache off
		algorithm sliding_window
		limit 2
		window 3s
	}
	respond "ok"`, srv.Addr))
	ceilSeconds := func(d time.Duration) int64 { return int64(math.Ceil(d.Seconds())) }
	a := srv.Time()
	r := cs.Get("/")
	b := srv.Time()
	r.Expect(t, "first", 200, "ok", "RateLimit", `"default";r=1;t=3`)
	ietf(t, "first", r)
	deadline := time.Now().Add(10 * time.Second)
	sawLower, denials := false, 0
	for i := 2; !sawLower || denials < 3; i++ {
		if time.Now().After(deadline) {
			t.Fatalf("no t below 3 within 10s")
		}
		c := srv.Time()
		r = cs.Get("/")
		d := srv.Time()
		step := "request " + strconv.Itoa(i)
		items := ietf(t, step, r)
		got := items[0].params["t"]
		lo, hi := ceilSeconds(a.Add(window).Sub(d)), ceilSeconds(b.Add(window).Sub(c))
		if got < lo || got > hi {
			t.Fatalf("%s: t=%d, want the time until the oldest entry leaves: %d to %d", step, got, lo, hi)
		}
		switch {
		case i == 2 && r.Status != 200, i > 2 && r.Status != 429:
			t.Fatalf("%s: status %d", step, r.Status)
		case r.Status == 429:
			denials++
			if ra := r.Header.Get("Retry-After"); ra != strconv.FormatInt(got, 10) {
				t.Fatalf("%s: Retry-After %s, t=%d: want equal (the request waits for the oldest entry)", step, ra, got)
			}
		}
		sawLower = sawLower || got < 3
		time.Sleep(50 * time.Millisecond) // pacing the polls, not waiting for an outcome
	}
}

// TestRateLimitTCappedOnDenial: on a 429, an item of a zone that would have admitted the request
// has its r as it is (uncharged) and a t no later than the Retry-After (not the zone's own next
// unit: 3600s away beside a Retry-After of 10).
func TestRateLimitTCappedOnDenial(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		headers ietf
		zone burst {
			capacity 1
			refill_rate 1/10s
		}
		zone hourly {
			algorithm sliding_window
			limit 100
			window 1h
		}
	}
	respond "ok"`, srv.Addr))
	r := cs.Get("/")
	r.Expect(t, "first", 200, "ok", "RateLimit-Policy", `"burst";q=1;w=10, "hourly";q=100;w=3600`,
		"RateLimit", `"burst";r=0;t=10, "hourly";r=99;t=3600`)
	ietf(t, "first", r)
	r = cs.Get("/")
	r.Expect(t, "denied by burst", 429, "", "Retry-After", "10", "RateLimit", `"burst";r=0;t=10, "hourly";r=99;t=10`)
	ietf(t, "denied by burst", r)
}

// TestSubSecondWindows: a window under a second is advertised as the rate per
// second over w=1 (10 per 100ms is q=100;w=1), not rounded up to 1s (q=10;w=1, a tenth of the
// rate); t rounds up to 1.
func TestSubSecondWindows(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		headers both
		zone window {
			match path /window
			algorithm sliding_window
			limit 10
			window 100ms
		}
		zone bucket {
			match path /bucket
			capacity 10
			refill_rate 100
		}
	}
	respond "ok"`, srv.Addr))
	r := cs.Get("/window")
	r.Expect(t, "window", 200, "ok", "RateLimit-Policy", `"window";q=100;w=1`, "RateLimit", `"window";r=9;t=1`,
		"X-RateLimit-Limit", "10", "X-RateLimit-Reset", "1")
	ietf(t, "window", r)
	r = cs.Get("/bucket")
	r.Expect(t, "bucket", 200, "ok", "RateLimit-Policy", `"bucket";q=100;w=1`, "RateLimit", `"bucket";r=9;t=1`)
	ietf(t, "bucket", r)
	// A burst over the window: every 429 has t = Retry-After = 1.
	denied := 0
	for i := range 30 {
		r = cs.Get("/window")
		ietf(t, "burst "+strconv.Itoa(i), r)
		if r.Status == 429 {
			denied++
			if r.Header.Get("Retry-After") != "1" || !strings.HasSuffix(r.Header.Get("RateLimit"), ";t=1") {
				t.Fatalf("burst %d: Retry-After %q, RateLimit %q", i, r.Header.Get("Retry-After"), r.Header.Get("RateLimit"))
			}
		}
	}
	if denied == 0 {
		t.Logf("no denial in the burst: the machine is slower than 10 requests per 100ms")
	}
}

// preflightExample is the zone of docs/responses.md ("Methods") that leaves CORS preflights
// (OPTIONS) uncounted.
const preflightExample = `rate_limit_redis {
	zone api {
		match {
			not method OPTIONS
		}
		key {client_ip}
		capacity 100
		refill_rate 10
	}
}`

// TestMethodsCount: every method counts, HEAD and OPTIONS included, unless a zone's
// match leaves them out, as the example of docs/responses.md does for preflights.
func TestMethodsCount(t *testing.T) {
	doc, err := os.ReadFile("docs/responses.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), "  "+strings.ReplaceAll(preflightExample, "\n", "\n  ")) { // in a list item
		t.Fatalf("docs/responses.md lost the preflight example:\n%s", preflightExample)
	}
	srv := redistest.Start(t)
	redisBlock := "rate_limit_redis {\n\tredis {\n\t\taddress " + srv.Addr + "\n\t}\n\theaders legacy\n"
	countAll := strings.Replace(strings.Replace(preflightExample, "rate_limit_redis {\n", redisBlock, 1),
		"\t\tmatch {\n\t\t\tnot method OPTIONS\n\t\t}\n", "", 1)
	example := strings.Replace(strings.Replace(preflightExample, "rate_limit_redis {\n", redisBlock, 1), "zone api", "zone api2", 1)
	sites := caddytest.StartSites(t, "", countAll+"\nrespond \"ok\"", example+"\nrespond \"ok\"")

	remaining := 100
	for _, method := range []string{"GET", "HEAD", "OPTIONS", "POST", "OPTIONS"} {
		remaining--
		r := sites[0].Do(method, "/")
		if r.Status != 200 || r.Header.Get("X-RateLimit-Remaining") != strconv.Itoa(remaining) {
			t.Fatalf("no match, %s: %d, X-RateLimit-Remaining %q, want %d", method, r.Status, r.Header.Get("X-RateLimit-Remaining"), remaining)
		}
	}
	remaining = 100
	for _, method := range []string{"OPTIONS", "GET", "OPTIONS", "HEAD", "OPTIONS", "OPTIONS", "GET"} {
		r := sites[1].Do(method, "/", "Origin", "https://app.example", "Access-Control-Request-Method", "PUT")
		want := ""
		if method != "OPTIONS" {
			remaining--
			want = strconv.Itoa(remaining)
		}
		if r.Status != 200 || r.Header.Get("X-RateLimit-Remaining") != want {
			t.Fatalf("not method OPTIONS, %s: %d, X-RateLimit-Remaining %q, want %q", method, r.Status, r.Header.Get("X-RateLimit-Remaining"), want)
		}
	}
}

// TestJitter: with jitter, a 429's Retry-After is the exact wait plus 0 to jitter
// whole seconds, not constant across denials, and the placeholder carries the value sent; a
// zone's jitter 0 turns it off; the exact wait (RateLimit's t, X-RateLimit-Reset, the deny
// cache) is unchanged, so a client is admitted as soon as the exact wait has passed.
func TestJitter(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		headers both
		jitter 10s
		zone api {
			match path /api
			capacity 1
			refill_rate 1/1h
		}
		zone calm {
			match path /calm
			jitter 0
			capacity 1
			refill_rate 1/1h
		}
		zone quick {
			match path /quick
			jitter 30s
			capacity 1
			refill_rate 1/2s
		}
	}
	respond "ok"
	handle_errors {
		respond "{http.rate_limit_redis.retry_after}" {err.status_code}
	}`, srv.Addr))

	// A bucket of 1: the exact wait is the time until full, X-RateLimit-Reset, and t.
	for _, tc := range []struct {
		path   string
		jitter int64
	}{{"/api", 10}, {"/calm", 0}} {
		cs.Get(tc.path)
		seen := make(map[int64]bool)
		for i := range 200 {
			r := cs.Get(tc.path)
			step := fmt.Sprintf("%s denial %d", tc.path, i)
			items := ietf(t, step, r)
			exact, _ := strconv.ParseInt(r.Header.Get("X-RateLimit-Reset"), 10, 64)
			retry, err := strconv.ParseInt(r.Header.Get("Retry-After"), 10, 64)
			if r.Status != 429 || err != nil || r.Body != r.Header.Get("Retry-After") {
				t.Fatalf("%s: %d %q, Retry-After %q: want a 429 whose body (the placeholder) is its Retry-After", step, r.Status, r.Body, r.Header.Get("Retry-After"))
			}
			if items[0].params["t"] != exact || retry < exact || retry > exact+tc.jitter {
				t.Fatalf("%s: Retry-After %d, t=%d, exact %d: want t exact and Retry-After in [exact, exact+%d]",
					step, retry, items[0].params["t"], exact, tc.jitter)
			}
			seen[retry-exact] = true
		}
		if tc.jitter > 0 && len(seen) < 2 {
			t.Fatalf("%s: Retry-After exceeded the exact wait by the same %v every time", tc.path, seen)
		}
		if tc.jitter == 0 && (len(seen) != 1 || !seen[0]) {
			t.Fatalf("%s: jitter 0, but Retry-After exceeded the exact wait by %v", tc.path, seen)
		}
	}

	// 1 token per 2s and up to 30s of jitter: admitted again after about 2s, whatever the
	// Retry-After said.
	start := time.Now()
	cs.Get("/quick").Expect(t, "quick", 200, "ok")
	jittered := false
	for {
		r := cs.Get("/quick")
		if r.Status == 200 {
			break
		}
		if ra, _ := strconv.Atoi(r.Header.Get("Retry-After")); ra > 2 {
			jittered = true
		}
		if time.Since(start) > 5*time.Second {
			t.Fatalf("still denied after %v; the exact wait is 2s", time.Since(start))
		}
		time.Sleep(50 * time.Millisecond) // pacing the polls
	}
	if elapsed := time.Since(start); elapsed < 2*time.Second {
		t.Fatalf("admitted after %v, before the token", elapsed)
	}
	if !jittered {
		t.Logf("every Retry-After of /quick happened to draw no jitter")
	}
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
		cs := caddytest.Start(t, fmt.Sprintf(`
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
		r := cs.Get("/")
		for _, h := range tc.present {
			if r.Header.Get(h) == "" {
				t.Errorf("headers %s: %s missing", tc.mode, h)
			}
		}
		for _, h := range tc.absent {
			if r.Header.Get(h) != "" {
				t.Errorf("headers %s: %s present", tc.mode, h)
			}
		}
		if tc.mode == "ietf" {
			r.Expect(t, "ietf", 200, "ok", "RateLimit-Policy", `"z`+tc.mode+`";q=10;w=10`, "RateLimit", `"z`+tc.mode+`";r=9;t=10`)
		}
		_ = caddy.Stop()
	}
}
