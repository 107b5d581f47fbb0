package ratelimitredis

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// quotaBlock is a handler with a quota endpoint at /rl/quota limited by zone quota (3 per
// hour): zone api (10 per hour, with block and overrides) applies to every request, login (a
// sliding window of 5 per hour) to /login and the endpoint, trial is a shadow zone, and cost is
// the cost of zone api when cost is true.
func quotaBlock(redisAddr string, cost bool) string {
	costLine := ""
	if cost {
		costLine = "cost {header.X-Cost}"
	}
	return fmt.Sprintf(`rate_limit_redis {
			redis {
				address %s
			}
			timeout 5s
			headers both
			quota_endpoint /rl/quota quota
			zone api {
				key {header.X-API-Key} {client_ip}
				capacity 10
				refill_rate 1/1h
				block 1h
				overrides
				%s
			}
			zone login {
				match path /login /rl/quota
				key {header.X-API-Key} {client_ip}
				algorithm sliding_window
				limit 5
				window 1h
			}
			zone trial {
				key {header.X-API-Key} {client_ip}
				capacity 1
				refill_rate 1/1h
				dry_run
			}
			zone quota {
				key {header.X-API-Key} {client_ip}
				capacity 3
				refill_rate 1/1h
			}
		}`, redisAddr, costLine)
}

// quotaInstances is a site of three handlers of quotaBlock under /i1/, /i2/ and /i3/ (the
// prefix stripped), each with its own limiter and deny cache as three Caddy instances have.
func quotaInstances(redisAddr string, cost bool) string {
	var b strings.Builder
	for i := 1; i <= 3; i++ {
		fmt.Fprintf(&b, "\n\thandle_path /i%d/* {\n\t\t%s\n\t\trespond \"ok\"\n\t}", i, quotaBlock(redisAddr, cost))
	}
	return b.String()
}

// getQuota reads the quota of the client of key at path (an instance's endpoint), checks the
// 200, its content type and no-store, and decodes the body, which must have no field the reply
// lacks.
func getQuota(t *testing.T, s *caddytest.Site, path, key string) (quotaReply, caddytest.Response) {
	t.Helper()
	r := s.Get(path, "X-API-Key", key)
	if r.Status != http.StatusOK || r.Header.Get("Content-Type") != "application/json" || r.Header.Get("Cache-Control") != "no-store" {
		t.Fatalf("GET %s as a key of %d bytes: %d %v %s", path, len(key), r.Status, r.Header, r.Body)
	}
	var q quotaReply
	dec := json.NewDecoder(strings.NewReader(r.Body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&q); err != nil {
		t.Fatalf("GET %s: decoding %s: %v", path, r.Body, err)
	}
	return q, r
}

// keyState is a Redis key's value (DUMP) and time to live (PTTL, ms).
type keyState struct {
	dump string
	pttl int64
}

// redisKeys returns every key of srv but those of zone quota, with its value and time to live.
func redisKeys(t *testing.T, srv *redistest.Server) map[string]keyState {
	t.Helper()
	out := make(map[string]keyState)
	for _, k := range srv.Keys(t) {
		if strings.Contains(k, ":quota:") {
			continue
		}
		dump, _ := srv.Do("DUMP", k).(string)
		pttl, _ := srv.Do("PTTL", k).(int64)
		out[k] = keyState{dump, pttl}
	}
	return out
}

// sameState fails t unless after holds the keys of before with the same values, and times to
// live that no write lengthened (at most before's: they count down).
func sameState(t *testing.T, step string, before, after map[string]keyState) {
	t.Helper()
	if !slices.Equal(slices.Sorted(maps.Keys(before)), slices.Sorted(maps.Keys(after))) {
		t.Fatalf("%s: keys %v, were %v", step, slices.Sorted(maps.Keys(after)), slices.Sorted(maps.Keys(before)))
	}
	for k, b := range before {
		if a := after[k]; a.dump != b.dump || a.pttl > b.pttl || a.pttl < 0 {
			t.Fatalf("%s: key %s changed: PTTL %d, was %d; value changed %v", step, k, a.pttl, b.pttl, a.dump != b.dump)
		}
	}
}

// zoneOf returns the entry of zone name in q, failing t when there is none.
func zoneOf(t *testing.T, q quotaReply, name string) zoneQuota {
	t.Helper()
	for _, z := range q.Zones {
		if z.Zone == name {
			return z
		}
	}
	t.Fatalf("no zone %s in %+v", name, q)
	return zoneQuota{}
}

// TestQuotaShowsWhatTheNextRequestSees: after spending, the endpoint lists exactly the zones
// that apply to it, but its own and the shadow zone, each with the remaining the last response
// said; reading it twice changes no key of those zones (values and times to live); its
// headers are those of the zone with the least share left; and the next real request gets
// that remaining less its cost.
func TestQuotaShowsWhatTheNextRequestSees(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, quotaInstances(srv.Addr, false))
	for range 4 {
		cs.Get("/i1/x", "X-API-Key", "alice")
	}
	cs.Get("/i1/login", "X-API-Key", "alice")
	last := cs.Get("/i1/login", "X-API-Key", "alice") // api 6 of 10 spent, login 2 of 5
	last.Expect(t, "last request", 200, "ok", "X-RateLimit-Remaining", "4", "X-RateLimit-Limit", "10")

	before := redisKeys(t, srv)
	q, r := getQuota(t, cs, "/i1/rl/quota", "alice")
	getQuota(t, cs, "/i1/rl/quota", "alice")
	sameState(t, "read twice", before, redisKeys(t, srv))

	want := []zoneQuota{
		{Zone: "api", Algorithm: "token_bucket", Limit: 10, RefillRate: 1.0 / 3600, Remaining: 4, Reset: zoneOf(t, q, "api").Reset},
		{Zone: "login", Algorithm: "sliding_window", Limit: 5, WindowMs: 3_600_000, Remaining: 3, Reset: zoneOf(t, q, "login").Reset},
	}
	if !slices.Equal(q.Zones, want) {
		t.Fatalf("zones %+v, want %+v", q.Zones, want)
	}
	if api := q.Zones[0].Reset; api <= 6*3600-60 || api > 6*3600 {
		t.Fatalf("api reset %d s, want the 6 h until 6 tokens are back", api)
	}
	if login := q.Zones[1].Reset; login <= 3600-60 || login > 3600 {
		t.Fatalf("login reset %d s, want the hour until its newest entry leaves the window", login)
	}
	r.Expect(t, "headers", 200, r.Body, "X-RateLimit-Limit", "10", "X-RateLimit-Remaining", "4",
		"X-RateLimit-Reset", strconv.FormatInt(q.Zones[0].Reset, 10),
		"RateLimit-Policy", `"api";q=10;w=36000, "login";q=5;w=3600`)
	if rl := r.Header.Get("RateLimit"); !strings.HasPrefix(rl, `"api";r=4;t=`) || !strings.Contains(rl, `, "login";r=3;t=`) {
		t.Fatalf("RateLimit %q, want api r=4 then login r=3", rl)
	}
	cs.Get("/i1/x", "X-API-Key", "alice").Expect(t, "next request", 200, "ok", "X-RateLimit-Remaining", "3")
}

// TestQuotaEndpointLimitedByItsZone: the endpoint's zone admits 3 reads, then refuses with a
// 429 and Retry-After; none of its reads charged zone api, which still admits 10 requests.
func TestQuotaEndpointLimitedByItsZone(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, quotaInstances(srv.Addr, false))
	for i := range 3 {
		q, _ := getQuota(t, cs, "/i1/rl/quota", "bob")
		if z := zoneOf(t, q, "api"); z.Remaining != 10 {
			t.Fatalf("read %d: api remaining %d, want 10: a read charges nothing", i, z.Remaining)
		}
	}
	r := cs.Get("/i1/rl/quota", "X-API-Key", "bob")
	if r.Status != http.StatusTooManyRequests || r.Header.Get("Retry-After") == "" || r.Header.Get("X-RateLimit-Limit") != "3" {
		t.Fatalf("4th read: %d %v, want a 429 of zone quota", r.Status, r.Header)
	}
	if got := cs.Statuses(11, "/i1/x", "X-API-Key", "bob"); got != "200 200 200 200 200 200 200 200 200 200 429" {
		t.Fatalf("api after the reads: %s, want 10 admitted", got)
	}
}

// TestQuotaOwnStateOnly: two clients each see their own state, and query parameters naming
// another client or zone change nothing: the key is the request's own.
func TestQuotaOwnStateOnly(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, quotaInstances(srv.Addr, false))
	for range 7 {
		cs.Get("/i1/x", "X-API-Key", "carol")
	}
	cs.Get("/i1/x", "X-API-Key", "dave")
	for _, c := range []struct {
		key, path string
		want      int64
	}{
		{"carol", "/i1/rl/quota", 3},
		{"dave", "/i1/rl/quota", 9},
		{"dave", "/i1/rl/quota?key=carol&zone=api", 9},
		{"erin", "/i1/rl/quota?key=carol&X-API-Key=carol", 10},
	} {
		q, _ := getQuota(t, cs, c.path, c.key)
		if z := zoneOf(t, q, "api"); z.Remaining != c.want {
			t.Fatalf("%s at %s: api remaining %d, want %d", c.key, c.path, z.Remaining, c.want)
		}
	}
}

// TestQuotaBlockAndOverride: a client blocked in zone api reads remaining 0 and the block's
// time left; a client with an override reads its numbers and the quota they give.
func TestQuotaBlockAndOverride(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, quotaInstances(srv.Addr, false))
	ac.put(t, "/rate_limit_redis/block?zone=api&key=frank&for=30m", "")
	ac.put(t, "/rate_limit_redis/override?zone=api&key=grace", `{"capacity": 20, "refill_rate": 2}`)
	ac.Get("/i1/x", "X-API-Key", "grace").Expect(t, "grace", 200, "ok", "X-RateLimit-Limit", "20", "X-RateLimit-Remaining", "19")

	q, r := getQuota(t, ac.Site, "/i1/rl/quota", "frank")
	z := zoneOf(t, q, "api")
	if z.Remaining != 0 || z.BlockedFor <= 1800-60 || z.BlockedFor > 1800 || z.RetryAfter != z.BlockedFor || z.Override != nil {
		t.Fatalf("blocked frank: %+v, want remaining 0 and 30 min blocked", z)
	}
	if r.Header.Get("X-RateLimit-Remaining") != "0" || r.Header.Get("X-RateLimit-Limit") != "10" {
		t.Fatalf("blocked frank's headers: %v, want api's remaining 0", r.Header)
	}
	q, r = getQuota(t, ac.Site, "/i1/rl/quota", "grace")
	z = zoneOf(t, q, "api")
	want := zoneQuota{Zone: "api", Algorithm: "token_bucket", Limit: 20, RefillRate: 2, Remaining: 19, Reset: 1,
		Override: &adminapi.OverrideNumbers{Capacity: 20, RefillRate: 2}}
	if z.Override == nil || *z.Override != *want.Override {
		t.Fatalf("grace: %+v, want the override %+v", z, want.Override)
	}
	z.Override = want.Override
	if z != want {
		t.Fatalf("grace: %+v, want %+v", z, want)
	}
	if r.Header.Get("RateLimit-Policy") != `"api";q=20;w=10, "login";q=5;w=3600` {
		t.Fatalf("grace's policy %q, want api with its override (the least share left) then login", r.Header.Get("RateLimit-Policy"))
	}
}

// TestQuotaThreeInstancesAgree: spent through three instances, the client reads the same
// remaining at each one's endpoint, and no read changes what another reads.
func TestQuotaThreeInstancesAgree(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, quotaInstances(srv.Addr, false))
	for i := range 6 {
		cs.Get(fmt.Sprintf("/i%d/x", i%3+1), "X-API-Key", "heidi")
	}
	cs.Get("/i2/login", "X-API-Key", "heidi")
	for i := 1; i <= 3; i++ {
		q, _ := getQuota(t, cs, fmt.Sprintf("/i%d/rl/quota", i), "heidi")
		if api, login := zoneOf(t, q, "api"), zoneOf(t, q, "login"); api.Remaining != 3 || login.Remaining != 4 {
			t.Fatalf("instance %d: api %d, login %d remaining, want 3 and 4", i, api.Remaining, login.Remaining)
		}
	}
	// Each instance decided zone quota once for heidi: the three share it in Redis.
	if r := cs.Get("/i3/rl/quota", "X-API-Key", "heidi"); r.Status != http.StatusTooManyRequests {
		t.Fatalf("4th read across the instances: %d, want 429", r.Status)
	}
}

// TestQuotaHostileInput: a method other than GET or HEAD is a 405 and a cost that is not a
// positive integer a 400, both writing nothing to Redis; a query of junk is ignored; an 8 KB
// key is read as a normal request's (its digest), never a failure; HEAD gives the headers
// without the body.
func TestQuotaHostileInput(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, quotaInstances(srv.Addr, true))
	for _, m := range []string{http.MethodPost, http.MethodDelete, "BREW"} {
		r := cs.Do(m, "/i1/rl/quota", "X-API-Key", "ivan")
		if r.Status != http.StatusMethodNotAllowed || r.Header.Get("Allow") != "GET, HEAD" {
			t.Fatalf("%s: %d %v, want 405 allowing GET, HEAD", m, r.Status, r.Header)
		}
	}
	if r := cs.Get("/i1/rl/quota", "X-API-Key", "ivan", "X-Cost", "-5"); r.Status != http.StatusBadRequest {
		t.Fatalf("bad cost: %d, want 400", r.Status)
	}
	if keys := srv.Keys(t); len(keys) != 0 {
		t.Fatalf("refused requests wrote %v", keys)
	}
	q, _ := getQuota(t, cs, "/i1/rl/quota?zone=%00&key=%7B%7D&&;;=x", "ivan")
	if z := zoneOf(t, q, "api"); z.Remaining != 10 {
		t.Fatalf("junk query: %+v", z)
	}
	huge := strings.Repeat("k", 8<<10)
	if r := cs.Get("/i1/x", "X-API-Key", huge); r.Status != 200 {
		t.Fatalf("8 KB key: %d", r.Status)
	}
	q, _ = getQuota(t, cs, "/i1/rl/quota", huge)
	if z := zoneOf(t, q, "api"); z.Remaining != 9 {
		t.Fatalf("8 KB key: api remaining %d, want 9", z.Remaining)
	}
	if r := cs.Do(http.MethodHead, "/i1/rl/quota", "X-API-Key", "ivan"); r.Status != 200 || r.Body != "" || r.Header.Get("X-RateLimit-Remaining") != "10" {
		t.Fatalf("HEAD: %d %q %v", r.Status, r.Body, r.Header)
	}
}

// TestQuotaEndpointConfig: quota_endpoint's errors name the line and what is wrong: its
// arguments, its path, its zone and the options it excludes.
func TestQuotaEndpointConfig(t *testing.T) {
	t.Parallel()
	const zones = "\tzone api {\n\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n\tzone q {\n\t\tcapacity 1\n\t\trefill_rate 1\n%s\t}\n}"
	block := func(top, inQ string) string {
		return "rate_limit_redis {\n" + top + fmt.Sprintf(zones, inQ)
	}
	for _, c := range []struct{ name, input, want string }{
		{"one argument", block("\tquota_endpoint /q\n", ""), "quota_endpoint takes a path and a zone name: quota_endpoint <path> <zone>, at Testfile:2"},
		{"relative path", block("\tquota_endpoint q q\n", ""), `quota_endpoint: path "q" must begin with / and hold no placeholder, *, ? or #: it is matched exactly, at Testfile:2`},
		{"wildcard", block("\tquota_endpoint /q* q\n", ""), `quota_endpoint: path "/q*" must begin with / and hold no placeholder, *, ? or #: it is matched exactly, at Testfile:2`},
		{"unknown zone", block("\tquota_endpoint /q nope\n", ""), `quota_endpoint: no zone of this handler is named "nope", at Testfile:2`},
		{"dry_run", block("\tquota_endpoint /q q\n\tdry_run\n", ""), "quota_endpoint: not with dry_run: the endpoint's zone must be able to refuse, at Testfile:2"},
		{"match", block("\tquota_endpoint /q q\n", "\t\tmatch path /q\n"), "quota_endpoint: zone q applies to the endpoint's requests only: leave its match out, at Testfile:2"},
		{"shadow", block("\tquota_endpoint /q q\n", "\t\tdry_run\n"), "quota_endpoint: zone q decides the endpoint's requests at once: leave out dry_run, max_wait, count_status, charge and cap_output, at Testfile:2"},
		{"skip", block("\tquota_endpoint /q q\n", "\t\tempty_key skip\n"), "quota_endpoint: zone q must limit every request to the endpoint: its empty_key must not be skip, at Testfile:2"},
		{"alone", "rate_limit_redis {\n\tquota_endpoint /q default\n\tcapacity 1\n\trefill_rate 1\n}", `quota_endpoint: needs a zone to report besides its own zone "default", at Testfile:2`},
	} {
		var h Handler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(c.input))
		if err == nil || err.Error() != c.want {
			t.Errorf("%s: error\n got %v\nwant %q", c.name, err, c.want)
		}
	}
	var h Handler
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(block("\tquota_endpoint /rl/quota q\n", ""))); err != nil {
		t.Fatalf("valid: %v", err)
	}
	if h.QuotaEndpoint == nil || *h.QuotaEndpoint != (QuotaEndpoint{Path: "/rl/quota", Zone: "q"}) {
		t.Fatalf("valid: %+v", h.QuotaEndpoint)
	}
}

// TestQuotaRedisDown: with Redis stopped, a read is a 503 with Retry-After: 1 and no-store
// (fail_mode open lets other requests through), never passed on.
func TestQuotaRedisDown(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, quotaInstances(srv.Addr, false))
	getQuota(t, cs, "/i1/rl/quota", "judy")
	srv.Stop()
	r := cs.Get("/i1/rl/quota", "X-API-Key", "judy")
	r.Expect(t, "redis down", http.StatusServiceUnavailable, "", "Retry-After", "1", "Cache-Control", "no-store")
	cs.Get("/i1/x", "X-API-Key", "judy").Expect(t, "fail open", 200, "ok")
}

// TestQuotaOnCluster: on a 3-primary Redis Cluster, clients whose keys live on different nodes
// each read what they spent.
func TestQuotaOnCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	cs := caddytest.Start(t, quotaInstances(strings.Join(c.Addrs(), " "), false))
	nodes := make(map[*redistest.Server]bool)
	for i := range 6 {
		key := fmt.Sprintf("client-%d", i)
		nodes[c.NodeOf(int(c.Nodes[0].Do("CLUSTER", "KEYSLOT", key).(int64)))] = true
		for range i {
			cs.Get("/i1/x", "X-API-Key", key)
		}
		q, _ := getQuota(t, cs, "/i2/rl/quota", key)
		if z := zoneOf(t, q, "api"); z.Remaining != int64(10-i) {
			t.Fatalf("%s: api remaining %d, want %d", key, z.Remaining, 10-i)
		}
	}
	if len(nodes) < 2 {
		t.Fatalf("the clients' keys are on %d node, want several", len(nodes))
	}
}

// TestQuotaDocsExampleProbing: caddyfile.md's quota endpoint example, as written there: its own
// zone is keyed on the client's address, so a client that sends a new X-API-Key with every read
// is held to the endpoint's 5 reads a minute like one that keeps its key.
func TestQuotaDocsExampleProbing(t *testing.T) {
	block := docExample(t, "docs/caddyfile.md", func(text string) bool {
		return strings.Contains(text, "quota_endpoint /rate-limit/quota quota")
	})
	srv := redistest.Start(t)
	block = strings.Replace(block, "rate_limit_redis {", "rate_limit_redis {\n\tredis {\n\t\taddress "+srv.Addr+"\n\t}", 1)
	site := caddytest.Start(t, block+"\nrespond ok\n")
	var got []string
	for i := range 8 {
		got = append(got, strconv.Itoa(site.Get("/rate-limit/quota", "X-API-Key", "probe"+strconv.Itoa(i)).Status))
	}
	if s := strings.Join(got, " "); s != "200 200 200 200 200 429 429 429" {
		t.Fatalf("8 reads with a fresh X-API-Key each: %s, want 200 ×5 then 429", s)
	}
}

// zoneDecisions is the sum of zone's decisions_total series, every result.
func zoneDecisions(zone string) float64 {
	var n float64
	for _, res := range resultNames {
		n += testutil.ToFloat64(metrics.decisions.WithLabelValues(zone, res))
	}
	return n
}

// TestQuotaReadIsOneDecision: the endpoint answers a read in front of the rate limit, deciding
// it once, in its own zone alone (decisions_total: one allowed there, none in the zone it
// reads), and a request passed on is never decided in the endpoint's zone.
func TestQuotaReadIsOneDecision(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`route {
		rate_limit_redis {
			redis {
				address %s
			}
			quota_endpoint /rl/quota qonce_own
			zone qonce_api {
				key {header.X-API-Key}
				capacity 10
				refill_rate 1/1h
			}
			zone qonce_own {
				key {header.X-API-Key}
				capacity 3
				refill_rate 1/1h
			}
		}
		respond "ok"
	}`, srv.Addr))
	allowed := resultAllowed.String()
	own0, api0 := zoneDecisions("qonce_own"), zoneDecisions("qonce_api")
	ownAllowed0 := testutil.ToFloat64(metrics.decisions.WithLabelValues("qonce_own", allowed))
	getQuota(t, cs, "/rl/quota", "kim")
	if own, api := zoneDecisions("qonce_own")-own0, zoneDecisions("qonce_api")-api0; own != 1 || api != 0 {
		t.Fatalf("a read: %v decisions in its zone, %v in zone qonce_api; want 1 and 0", own, api)
	}
	if got := testutil.ToFloat64(metrics.decisions.WithLabelValues("qonce_own", allowed)) - ownAllowed0; got != 1 {
		t.Fatalf("a read: %v allowed in its zone, want 1", got)
	}
	cs.Get("/x", "X-API-Key", "kim").Expect(t, "a request passed on", 200, "ok", "X-RateLimit-Limit", "10")
	if own, api := zoneDecisions("qonce_own")-own0, zoneDecisions("qonce_api")-api0; own != 1 || api != 1 {
		t.Fatalf("after a request passed on: %v decisions in the endpoint's zone, %v in zone qonce_api; want 1 and 1", own, api)
	}
}
