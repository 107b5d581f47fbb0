package ratelimitredis

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestMetricsDecisions: decisions_total counts an admitted request once in every zone that
// applied to it and a denied one only in the denying zone; a denial from the deny cache is
// `denied` plus a deny cache hit, with no Redis call observed; a cost above the quota is
// `denied`; a bad cost (400) is no decision. The Redis call histogram counts exactly the calls
// made. Read from the registry of Caddy's running config, after real requests. The handler's
// Go-side clock stands still, so the fourth login is within the deny cache's max_age of the third.
func TestMetricsDecisions(t *testing.T) {
	srv := redistest.Start(t)
	newFakeClock(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis_tuned clock=%s {
		redis {
			address %s
		}
		zone md_api {
			key {http.request.header.X-Client}
			capacity 3
			refill_rate 1/1h
			cost {http.request.header.X-Cost}
		}
		zone md_login {
			match path /login
			key {http.request.header.X-Client}
			algorithm sliding_window
			limit 2
			window 1h
		}
	}
	respond "ok"`, t.Name(), srv.Addr))
	reg := activeRegistry(t)
	zones := []string{"md_api", "md_login"}
	step := func(name string, do func(), want map[string]float64) {
		t.Helper()
		before := takeSnapshot(t, reg, zones...)
		do()
		expectDeltas(t, name, before, takeSnapshot(t, reg, zones...), want)
	}

	step("two logins, allowed in both zones", func() {
		cs.Get("/login", "X-Client", "a").Expect(t, "login 1", 200, "ok")
		cs.Get("/login", "X-Client", "a").Expect(t, "login 2", 200, "ok")
	}, map[string]float64{"md_api/allowed": 2, "md_login/allowed": 2, "calls": 2})
	step("a third login, denied by md_login only", func() {
		cs.Get("/login", "X-Client", "a").Expect(t, "login 3", 429, "", "X-RateLimit-Limit", "2")
	}, map[string]float64{"md_login/denied": 1, "calls": 1})
	step("the same login again, denied from the deny cache", func() {
		cs.Get("/login", "X-Client", "a").Expect(t, "login 4", 429, "", "X-RateLimit-Limit", "2")
	}, map[string]float64{"md_login/denied": 1, "cache_hit": 1})
	step("a cost above the quota: denied, no Retry-After", func() {
		cs.Get("/", "X-Client", "a", "X-Cost", "4").Expect(t, "cost 4", 429, "", "Retry-After", "")
	}, map[string]float64{"md_api/denied": 1, "calls": 1})
	step("a bad cost is no decision", func() {
		cs.Get("/", "X-Client", "a", "X-Cost", "x").Expect(t, "cost x", 400, "")
	}, nil)
	step("the last token, then md_api denies", func() {
		cs.Get("/", "X-Client", "a").Expect(t, "last token", 200, "ok", "X-RateLimit-Remaining", "0")
		cs.Get("/", "X-Client", "a").Expect(t, "no token", 429, "")
	}, map[string]float64{"md_api/allowed": 1, "md_api/denied": 1, "calls": 2})

	// Never a per-client series: 20 more clients add none.
	n, err := testutil.GatherAndCount(reg, metricDecisions)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		cs.Get("/", "X-Client", "client"+strconv.Itoa(i)).Expect(t, "another client", 200, "ok")
	}
	if m, _ := testutil.GatherAndCount(reg, metricDecisions); m != n {
		t.Fatalf("decisions_total has %d series after 20 new clients, had %d", m, n)
	}
	// Every zone's series exist from the start: 7 results per zone, and its empty keys.
	for _, z := range zones {
		if !seriesExists(t, reg, metricEmptyKeys, "zone", z) {
			t.Errorf("no %s series for zone %s", metricEmptyKeys, z)
		}
		for r := range numResults {
			if !seriesExists(t, reg, metricDecisions, "zone", z, "result", r.String()) {
				t.Errorf("no series for zone %s, result %s", z, r)
			}
		}
	}
	if problems, err := testutil.GatherAndLint(reg, metricDecisions, metricDuration, metricFailures, metricCacheHits, metricEmptyKeys); err != nil || len(problems) > 0 {
		t.Fatalf("metric lint: %v %v", problems, err)
	}
}

func seriesExists(t *testing.T, reg prometheus.Gatherer, name string, labels ...string) bool {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if !hasPair(labels, lp.GetName(), lp.GetValue()) {
					continue series
				}
			}
			return true
		}
	}
	return false
}

// TestMetricsFailModes: with Redis down, every request is counted in every zone that applied,
// as fail_open or fail_closed (also in dry_run, where the 503 is not sent); with fail_mode local
// as local while the in-process limiter admits and as local_denied, in the denying zone only,
// when it denies. The histogram observes the failed Redis calls, not the requests the open
// circuit breaker answered without one.
func TestMetricsFailModes(t *testing.T) {
	const requests = breakerTrips + 3
	for _, tc := range []struct {
		name, options string
		status        int
		want          map[string]float64
	}{
		{"open", "fail_mode open", 200, map[string]float64{"a/fail_open": requests, "b/fail_open": requests}},
		{"closed", "fail_mode closed", 503, map[string]float64{"a/fail_closed": requests, "b/fail_closed": requests}},
		{"closed dry_run", "fail_mode closed\n\t\tdry_run", 200, map[string]float64{"a/fail_closed": requests, "b/fail_closed": requests}},
		// Zone b (capacity 2) denies the third request and every later one; zone a (capacity 5)
		// admits, but is charged only when both admit.
		{"local", "fail_mode local", 0, map[string]float64{"a/local": 2, "b/local": 2, "b/local_denied": requests - 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redistest.Start(t)
			a, b := "mf_a_"+strings.ReplaceAll(tc.name, " ", "_"), "mf_b_"+strings.ReplaceAll(tc.name, " ", "_")
			// breaker_open_for=1m: every request after the trips meets the breaker open.
			cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis_tuned breaker_open_for=1m {
		redis {
			address %s
		}
		%s
		zone %s {
			capacity 5
			refill_rate 1/1h
		}
		zone %s {
			capacity 2
			refill_rate 1/1h
		}
	}
	respond "ok"`, srv.Addr, tc.options, a, b))
			reg := activeRegistry(t)
			srv.Stop()
			before := takeSnapshot(t, reg, a, b)
			for i := 1; i <= requests; i++ {
				r := cs.Get("/")
				want := tc.status
				if want == 0 { // local: two admitted, then 429
					want = 200
					if i > 2 {
						want = 429
					}
				}
				if r.Status != want {
					t.Fatalf("request %d: status %d, want %d", i, r.Status, want)
				}
			}
			want := map[string]float64{
				"calls":                breakerTrips, // then the breaker is open: no call
				"failure/called":       breakerTrips,
				"failure/circuit_open": requests - breakerTrips,
			}
			for k, v := range tc.want {
				k = strings.NewReplacer("a/", a+"/", "b/", b+"/").Replace(k)
				want[k] = v
			}
			expectDeltas(t, tc.name, before, takeSnapshot(t, reg, a, b), want)
		})
	}
}

// TestMetricsAcrossReload: every config load gets a new, empty registry from Caddy
// (caddy.Context.GetMetricsRegistry); the handler registers its collectors into it, so after
// `caddy reload` the metrics are in the new config's registry, served at /metrics by the new
// config's `metrics` handler, and keep counting from where they were.
func TestMetricsAcrossReload(t *testing.T) {
	srv := redistest.Start(t)
	site := fmt.Sprintf(`
	handle /metrics {
		metrics
	}
	handle {
		rate_limit_redis {
			redis {
				address %s
			}
			zone mr {
				key {http.request.header.X-Client}
				capacity 2
				refill_rate 1/1h
			}
		}
		respond "ok"
	}`, srv.Addr)
	cs := caddytest.Start(t, site)
	port, err := strconv.Atoi(strings.TrimPrefix(cs.Base, "http://127.0.0.1:"))
	if err != nil {
		t.Fatal(err)
	}
	reg1 := activeRegistry(t)
	base := takeSnapshot(t, reg1, "mr")

	cs.Get("/", "X-Client", "a").Expect(t, "1", 200, "ok")
	cs.Get("/", "X-Client", "a").Expect(t, "2", 200, "ok")
	cs.Get("/", "X-Client", "a").Expect(t, "3", 429, "")
	beforeReload := takeSnapshot(t, reg1, "mr")
	expectDeltas(t, "before the reload", base, beforeReload, map[string]float64{"mr/allowed": 2, "mr/denied": 1, "calls": 3})
	scraped(t, cs, "mr", "allowed", beforeReload["mr/allowed"])

	if err := cs.Load(site, port); err != nil {
		t.Fatalf("reload: %v", err)
	}
	reg2 := activeRegistry(t)
	if reg2 == reg1 {
		t.Fatal("the reload kept the registry; this test assumes Caddy makes a new one per config")
	}
	// The new registry holds the metrics, with the values they had.
	expectDeltas(t, "right after the reload", beforeReload, takeSnapshot(t, reg2, "mr"), nil)
	for _, name := range []string{metricDecisions, metricDuration, metricFailures, metricCacheHits} {
		if n, err := testutil.GatherAndCount(reg2, name); err != nil || n == 0 {
			t.Errorf("%s: %d series in the new config's registry (%v)", name, n, err)
		}
	}

	// The new handler has an empty deny cache: Redis denies again. Then another client.
	cs.Get("/", "X-Client", "a").Expect(t, "4", 429, "")
	cs.Get("/", "X-Client", "b").Expect(t, "5", 200, "ok")
	after := takeSnapshot(t, reg2, "mr")
	expectDeltas(t, "after the reload", beforeReload, after, map[string]float64{"mr/allowed": 1, "mr/denied": 1, "calls": 2})
	scraped(t, cs, "mr", "allowed", after["mr/allowed"])
	scraped(t, cs, "mr", "denied", after["mr/denied"])
}

// scraped checks that Caddy's /metrics (the `metrics` handler) shows decisions_total of zone
// and result at value.
func scraped(t *testing.T, cs *caddytest.Site, zone, result string, value float64) {
	t.Helper()
	r := cs.Get("/metrics")
	line := fmt.Sprintf(`%s{result=%q,zone=%q} %s`, metricDecisions, result, zone, strconv.FormatFloat(value, 'g', -1, 64))
	for l := range strings.SplitSeq(r.Body, "\n") {
		if l == line {
			return
		}
	}
	var ours []string
	for l := range strings.SplitSeq(r.Body, "\n") {
		if strings.HasPrefix(l, allMetricsPrefix) {
			ours = append(ours, l)
		}
	}
	t.Fatalf("/metrics (status %d) has no line %q; its lines of the module:\n%s", r.Status, line, strings.Join(ours, "\n"))
}
