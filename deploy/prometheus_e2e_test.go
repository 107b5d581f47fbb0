// Package deploy_test runs the compose stack's monitoring for real, without Docker: the Caddy
// of this checkout serving deploy/Caddyfile against a real redis-server, scraped by a real
// Prometheus with deploy/prometheus.yml and the alerting rules of deploy/prometheus/.
package deploy_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// The files under test, relative to deploy/ (the test's working directory).
const (
	caddyfileFile  = "Caddyfile"
	prometheusFile = "prometheus.yml"
	rulesDir       = "prometheus" // docker-compose.yml mounts it where prometheus.yml's rule_files look
	rulesMount     = "rules"      // that place, relative to prometheus.yml
	dashboardFile  = "grafana/dashboards/rate-limit-redis.json"
)

// caddyBinaryEnv names the Caddy binary to run: `make test` and `make e2e` set it to bin/caddy,
// which they build from this checkout first.
const caddyBinaryEnv = "CADDY_BINARY"

// The test Prometheus scrapes and evaluates every second (the compose stack: every 5s).
const scrapeInterval = time.Second

// failingAlert is the alert that must fire while Redis is down and resolve once it is back.
const failingAlert = "RateLimitRedisFailing"

// TestPrometheusEndToEnd proves the dashboard and the alerting rules against a real Prometheus.
// It starts redis-server, the Caddy of this checkout with deploy/Caddyfile (ports moved to free
// loopback ports) and prometheus with deploy/prometheus.yml (the target moved to that Caddy,
// scrape and evaluation every second, the rules of deploy/prometheus/ as in the compose stack).
// Then it sends traffic that is allowed, denied, dry-run denied, answered from the deny cache,
// held for its turn and charged after the response (zone tokens, whose settlements fail while
// Redis is down), and, while Redis is stalled (SIGSTOP: slow calls, timeouts, the circuit
// breaker) and then killed, failed open; it waits until RateLimitRedisFailing fires, restarts
// Redis, sends traffic until Prometheus has seen Redis decide again, and waits until the alert
// resolves.
// Finally every PromQL query of the dashboard (Grafana's variables replaced as Grafana would)
// and every alerting rule's expression is evaluated over the test's span through Prometheus's
// HTTP API: each must return at least one series with the labels its legend shows (for an
// alert: the labels its annotations use), and each query of the dashboard a value other than 0.
//
// The rules are the deployed ones, `for:` and windows unchanged: RateLimitRedisFailing
// (rate[1m] > 0 for 1m) fires about 62s after Redis stops and resolves about 62s after it
// answers again, so the test takes 2 to 2.5 minutes.
func TestPrometheusEndToEnd(t *testing.T) {
	caddyBin := os.Getenv(caddyBinaryEnv)
	if caddyBin == "" {
		t.Skipf("%s is not set: run `make e2e` or `make test`, which build bin/caddy from this checkout and set it", caddyBinaryEnv)
	}
	promBin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Skip("prometheus is not installed, so this test cannot run: install the Debian package prometheus " +
			"(`apt-get install --no-install-recommends prometheus`; `make test` does when run as root)")
	}
	start := time.Now()
	work := t.TempDir()

	// Redis, and Caddy with deploy/Caddyfile.
	rdb := redistest.Start(t)
	sitePort, metricsPort, promPort := freePort(t), freePort(t), freePort(t)
	caddyfile := rewrite(t, caddyfileFile, [][2]string{
		{"\tadmin localhost:2019\n", "\tadmin off\n\tpersist_config off\n"},
		{"\n:8080 {\n", fmt.Sprintf("\n:%d {\n\tbind 127.0.0.1\n", sitePort)},
		{"\n:2020 {\n", fmt.Sprintf("\n:%d {\n\tbind 127.0.0.1\n", metricsPort)},
		// All the test's traffic comes from 127.0.0.1: the example's per-IP zone, meant to cap a
		// client rotating API keys, would otherwise deny every request of the test after its
		// first 40, allowed ones included (the zone still decides, and is still on the dashboard).
		{"\t\t\tcapacity 100\n\t\t\trefill_rate 10\n", "\t\t\tcapacity 100000\n\t\t\trefill_rate 1000\n"},
		// Zone login's near_limit is crossed a few times a minute, too few for its alert's rate
		// within the test: in zone api, each round's new API key crosses 20% with its first
		// request, ten crossings a second.
		{"\t\t\tcapacity 5\n\t\t\trefill_rate 1/10s\n", "\t\t\tcapacity 5\n\t\t\trefill_rate 1/10s\n\t\t\tnear_limit 20%\n"},
	})
	writeFile(t, filepath.Join(work, "Caddyfile"), caddyfile)
	caddyLog := startProcess(t, work, "caddy", caddyBin, []string{"REDIS_ADDR=" + rdb.Addr},
		"run", "--config", filepath.Join(work, "Caddyfile"), "--adapter", "caddyfile")
	site := fmt.Sprintf("http://127.0.0.1:%d", sitePort)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", metricsPort)
	poll(t, 30*time.Second, "Caddy serving its metrics at "+metricsURL, func() (bool, string) {
		code, body, err := get(metricsURL)
		return err == nil && code == 200 && strings.Contains(body, "caddy_rate_limit_redis_decisions_total"),
			fmt.Sprintf("%d %v; caddy log:\n%s", code, err, tail(caddyLog))
	})

	// Prometheus with deploy/prometheus.yml; rule_files find deploy/prometheus/ where
	// docker-compose.yml mounts it.
	promYAML := rewrite(t, prometheusFile, [][2]string{
		{"scrape_interval: 5s\n", "scrape_interval: 1s\n"},
		{"evaluation_interval: 5s\n", "evaluation_interval: 1s\n"},
		{`"caddy:2020"`, fmt.Sprintf(`"127.0.0.1:%d"`, metricsPort)},
	})
	writeFile(t, filepath.Join(work, "prometheus.yml"), promYAML)
	abs, err := filepath.Abs(rulesDir)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(abs, filepath.Join(work, rulesMount)); err != nil {
		t.Fatal(err)
	}
	prom := &promAPI{t: t, base: fmt.Sprintf("http://127.0.0.1:%d", promPort)}
	prom.log = startProcess(t, work, "prometheus", promBin, nil,
		"--config.file="+filepath.Join(work, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(work, "data"),
		fmt.Sprintf("--web.listen-address=127.0.0.1:%d", promPort),
		"--log.level=warn")
	poll(t, 60*time.Second, "Prometheus scraping Caddy", func() (bool, string) {
		var targets struct {
			ActiveTargets []struct{ Health, LastError, ScrapeURL string } `json:"activeTargets"`
		}
		if err := prom.tryGet("/api/v1/targets", nil, &targets); err != nil {
			return false, err.Error()
		}
		up := len(targets.ActiveTargets) == 1 && targets.ActiveTargets[0].Health == "up" && targets.ActiveTargets[0].ScrapeURL == metricsURL
		return up, fmt.Sprintf("targets %+v", targets.ActiveTargets)
	})
	ruleNames := loadRuleFiles(t)
	prom.alertingRules(ruleNames) // loaded

	// docs/compose.md's traffic, deploy/traffic.sh, as a user runs it: each line gets what its
	// comment says, and the alerts the page lists turn pending (their `for:` is minutes).
	checkTrafficScript(t, site)
	poll(t, 60*time.Second, "the alerts docs/compose.md promises for deploy/traffic.sh pending or firing", func() (bool, string) {
		alerts := prom.alerts()
		var missing []string
		for _, want := range composeAlerts {
			if !slices.ContainsFunc(alerts, func(a alert) bool {
				return a.Labels["alertname"] == want[0] && a.Labels["zone"] == want[1] && (a.State == "pending" || a.State == "firing")
			}) {
				missing = append(missing, want[0]+"{zone="+want[1]+"}")
			}
		}
		return len(missing) == 0, fmt.Sprintf("not pending: %v; alerts %+v", missing, alerts)
	})

	// Traffic, ten rounds a second until Redis decides again after the outage. A round: a new
	// API key on / (allowed), the same client on / (zone api: 5 burst, then 1 per 10s: denied,
	// often from the deny cache), /login without a password (basic_auth's 401, counted by zone
	// login: 3 a minute per IP, then denied), /search (zone search in dry_run: 10 a minute per
	// IP, then dry_run_denied) and /v1/chat without an API key (zone tokens: empty_key deny, a
	// 403 counted in empty_key_total), and /llm/v1/chat/completions (zone llm: charge openai_usage; the
	// stand-in reports no usage, so each is charged missing and counted in charge_missing_total). Beside the rounds, one API key's requests to /v1/chat
	// one after another (zone tokens: each reserves 100 and is charged the 40 reported, giving
	// 60 back; once its 1000 are spent, each is held for its turn, about 0.4s).
	traffic := startTraffic(t, site)
	poll(t, 60*time.Second, "Prometheus seeing decisions allowed, denied and dry_run_denied", func() (bool, string) {
		v := prom.query(`count(count by (result) (caddy_rate_limit_redis_decisions_total{result=~"allowed|denied|dry_run_denied"} > 0))`)
		return len(v) == 1 && v[0].Value == 3, fmt.Sprintf("%v; responses %s", v, traffic.counts())
	})

	// Redis stalls: calls time out after the module's 100ms, the circuit breaker opens and
	// probes every 500ms (each probe another 100ms call). Enough slow calls for the Redis
	// latency alert's expression to hold (over 1% of the calls so far: the test is shorter
	// than its 5m window), then Redis dies: connections are refused.
	// Redis stops while a request of zone tokens is held for its turn (once Prometheus has
	// seen one held), so that its settlement after the response fails.
	poll(t, 30*time.Second, "Prometheus seeing a request held for its turn", func() (bool, string) {
		v := prom.query(`max_over_time(caddy_rate_limit_redis_waiting[1m]) > 0`)
		return len(v) == 1, fmt.Sprintf("%v; responses %s", v, traffic.counts())
	})
	poll(t, 30*time.Second, "Caddy holding a request of zone tokens for its turn", func() (bool, string) {
		_, body, err := get(metricsURL)
		held := regexp.MustCompile(`(?m)^caddy_rate_limit_redis_waiting ([0-9.e+]+)$`).FindStringSubmatch(body)
		return err == nil && held != nil && held[1] != "0", fmt.Sprintf("%v %v; responses %s", held, err, traffic.counts())
	})
	outage := time.Now()
	rdb.Pause()
	poll(t, 60*time.Second, "Prometheus seeing 2% of the calls over 50ms, timeouts, the open circuit breaker and a failed settlement", func() (bool, string) {
		slow := prom.query(`(sum(caddy_rate_limit_redis_redis_duration_seconds_count) - sum(caddy_rate_limit_redis_redis_duration_seconds_bucket{le="0.05"}))
			/ sum(caddy_rate_limit_redis_redis_duration_seconds_count)`)
		failures := prom.query(`count(caddy_rate_limit_redis_backend_failures_total{reason=~"timeout|circuit_open"} > 0)`)
		settles := prom.query(`sum(caddy_rate_limit_redis_settle_failures_total)`)
		return len(slow) == 1 && slow[0].Value >= 0.02 && len(failures) == 1 && failures[0].Value == 2 && len(settles) == 1 && settles[0].Value > 0,
			fmt.Sprintf("share of slow calls %v, failure reasons seen %v, settlement failures %v", slow, failures, settles)
	})
	rdb.Stop()
	poll(t, 3*time.Minute, failingAlert+" firing for result fail_open", func() (bool, string) {
		alerts := prom.alerts()
		return slices.ContainsFunc(alerts, func(a alert) bool {
			return a.Labels["alertname"] == failingAlert && a.State == "firing" && a.Labels["result"] == "fail_open" &&
				a.Labels["instance"] == fmt.Sprintf("127.0.0.1:%d", metricsPort)
		}), fmt.Sprintf("alerts %+v; responses %s", alerts, traffic.counts())
	})
	t.Logf("%s firing %v after Redis stalled", failingAlert, time.Since(outage).Round(time.Second))
	if d := traffic.degraded(); d == 0 {
		t.Errorf("no response had X-RateLimit-Degraded: true while Redis was down (responses %s)", traffic.counts())
	}

	// Redis comes back: decisions are Redis's again, and the alert resolves. The traffic stops
	// once Prometheus has seen Redis deciding again: on a loaded machine a burst of calls over
	// the 100ms timeout is a failure too, and each would hold the alert for another minute.
	allowedBefore := prom.query(`sum(caddy_rate_limit_redis_decisions_total{result="allowed"})`)
	rdb.Restart()
	back := time.Now()
	poll(t, 30*time.Second, "an allowed request decided by Redis again", func() (bool, string) {
		code, h, err := traffic.request("/", "X-API-Key", "after-restart")
		return err == nil && code == 200 && h.Get("X-RateLimit-Degraded") == "" && h.Get("X-RateLimit-Remaining") == "4",
			fmt.Sprintf("%d %v %v", code, h, err)
	})
	poll(t, 30*time.Second, "Prometheus seeing requests allowed by Redis again", func() (bool, string) {
		allowed := prom.query(`sum(caddy_rate_limit_redis_decisions_total{result="allowed"})`)
		return len(allowed) == 1 && len(allowedBefore) == 1 && allowed[0].Value >= allowedBefore[0].Value+20,
			fmt.Sprintf("allowed %v, before the restart %v", allowed, allowedBefore)
	})
	traffic.stop()
	poll(t, 3*time.Minute, failingAlert+" resolved", func() (bool, string) {
		alerts := prom.alerts()
		return !slices.ContainsFunc(alerts, func(a alert) bool { return a.Labels["alertname"] == failingAlert }),
			fmt.Sprintf("alerts %+v; failures in the last minute %v", alerts,
				prom.query(`sum by (reason) (increase(caddy_rate_limit_redis_backend_failures_total[1m])) > 0`))
	})
	t.Logf("%s resolved %v after Redis answered again", failingAlert, time.Since(back).Round(time.Second))
	end := time.Now()
	t.Logf("responses: %s", traffic.counts())

	// Every rule evaluated without error.
	rules := prom.alertingRules(ruleNames)
	for _, r := range rules {
		if r.Health != "ok" || r.LastError != "" {
			t.Errorf("rule %s: health %q, last error %q", r.Name, r.Health, r.LastError)
		}
	}

	// Every query of the dashboard, as Grafana sends it, over the test's span.
	dash := readDashboard(t)
	step := 2 * time.Second
	vars := map[string]string{
		// Grafana: max(4 × the scrape interval, the step + the scrape interval).
		"__rate_interval": promDuration(max(4*scrapeInterval, step+scrapeInterval)),
	}
	for _, v := range dash.Templating.List {
		if v.AllValue == "" {
			t.Fatalf("%s: variable %q has no allValue: tell this test what \"All\" stands for", dashboardFile, v.Name)
		}
		vars[v.Name] = v.AllValue
	}
	queries := 0
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			queries++
			what := fmt.Sprintf("panel %q, query %s", p.Title, tg.RefID)
			expr, err := substitute(tg.Expr, vars)
			if err != nil {
				t.Errorf("%s: %v", what, err)
				continue
			}
			series := prom.queryRange(expr, start, end, step)
			checkSeries(t, what, expr, series, legendLabels(tg.LegendFormat), true, true)
		}
	}
	if queries == 0 {
		t.Errorf("%s: no query", dashboardFile)
	}
	// The zone variable's values: the zones of deploy/Caddyfile.
	for _, v := range dash.Templating.List {
		m := regexp.MustCompile(`^label_values\((\w+), *(\w+)\)$`).FindStringSubmatch(v.Definition)
		if m == nil {
			t.Errorf("variable %q: %q is not label_values(<metric>, <label>)", v.Name, v.Definition)
			continue
		}
		var values []string
		prom.get("/api/v1/label/"+m[2]+"/values", url.Values{"match[]": {m[1]}, "start": {unix(start)}, "end": {unix(end)}}, &values)
		if want := []string{"api", "ip", "llm", "login", "search", "tokens"}; !slices.Equal(values, want) {
			t.Errorf("variable %q (%s): values %v, want %v", v.Name, v.Definition, values, want)
		}
	}

	// Every alerting rule's expression held at some time of the test, with the labels its
	// annotations use.
	for _, r := range rules {
		series := prom.queryRange(r.Query, start, end, scrapeInterval)
		checkSeries(t, "alert "+r.Name, r.Query, series, annotationLabels(r.Annotations), false, false)
	}
	t.Logf("%d dashboard queries and %d alert expressions evaluated over %v; the test took %v",
		queries, len(rules), end.Sub(start).Round(time.Second), time.Since(start).Round(time.Second))
}

// composeAlerts are the alerts (name, zone) that docs/compose.md says deploy/traffic.sh makes
// pending at once.
var composeAlerts = [][2]string{
	{"RateLimitDryRunWouldDeny", "search"},
	{"RateLimitZoneDenyingMany", "api"},
	{"RateLimitZoneDenyingMany", "login"},
	{"RateLimitZoneKeyEmpty", "tokens"},
	{"RateLimitChargeMissing", "llm"},
}

// checkTrafficScript runs deploy/traffic.sh against site for 12 passes and checks each line's
// statuses against its comment: / (zone api by IP, twice a pass) and /login (zone login) denied once their
// burst is spent, the demo login allowed until 3 failures count and denied after, the keyless
// /v1/chat 403, every other line 200.
func checkTrafficScript(t *testing.T, site string) {
	t.Helper()
	cmd := exec.Command("bash", "traffic.sh", site)
	cmd.Env = append(os.Environ(), "PASSES=12")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("deploy/traffic.sh: %v; its output:\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	columns := make([][]string, 9)
	for _, l := range lines {
		f := strings.Fields(l)
		if len(f) != len(columns) {
			t.Fatalf("deploy/traffic.sh printed %q, want %d statuses a line; its output:\n%s", l, len(columns), out)
		}
		for i, c := range f {
			columns[i] = append(columns[i], c)
		}
	}
	has := func(i int, code string) bool { return slices.Contains(columns[i], code) }
	all := func(i int, code string) bool {
		return !slices.ContainsFunc(columns[i], func(c string) bool { return c != code })
	}
	for _, c := range []struct {
		what string
		ok   bool
	}{
		{"/ : 200 then 429", columns[0][0] == "200" && has(0, "429")},
		{"/ again: 200 then 429", columns[1][0] == "200" && has(1, "429")},
		{"/login: 401 then 429", columns[2][0] == "401" && has(2, "429") && !has(2, "200")},
		{"/login as demo: 200 then 429", columns[3][0] == "200" && has(3, "429")},
		{"/v1/chat with a key: 200", all(4, "200")},
		{"/v1/chat without a key: 403", all(5, "403")},
		{"/llm/v1/chat/completions: 200", all(6, "200")},
		{"/search: 200 (dry_run)", all(7, "200")},
		{"/ with a new key: 200", all(8, "200")},
	} {
		if !c.ok {
			t.Errorf("deploy/traffic.sh, %s: got %v", c.what, columns)
		}
	}
}

// checkSeries checks the result of a range query: at least one series; every series with the
// labels want (exactly want, with exact), none empty; at least one value that is a number
// (and, with nonzero, not 0: the traffic made it move).
func checkSeries(t *testing.T, what, expr string, series []promSeries, want []string, exact, nonzero bool) {
	t.Helper()
	if len(series) == 0 {
		t.Errorf("%s: no series over the test, so it names a metric, a label or a label value that Caddy does not export, or the test's traffic never made it hold:\n    %s", what, expr)
		return
	}
	seen := false
	for _, s := range series {
		var got []string
		for l, v := range s.Metric {
			got = append(got, l)
			if v == "" {
				t.Errorf("%s: series %v has an empty label %s", what, s.Metric, l)
			}
		}
		slices.Sort(got)
		if exact && !slices.Equal(got, want) {
			t.Errorf("%s: series %v has the labels %v, want %v (what its legend shows):\n    %s", what, s.Metric, got, want, expr)
		}
		for _, l := range want {
			if !exact && !slices.Contains(got, l) {
				t.Errorf("%s: series %v has no label %s, which its annotations show:\n    %s", what, s.Metric, l, expr)
			}
		}
		for _, v := range s.Values {
			if !math.IsNaN(v) && !math.IsInf(v, 0) && (!nonzero || v != 0) {
				seen = true
			}
		}
	}
	if !seen {
		not := "NaN or ±Inf"
		if nonzero {
			not = "NaN, ±Inf or 0"
		}
		t.Errorf("%s: no value other than %s over the test (does the test's traffic exercise it?):\n    %s", what, not, expr)
	}
}

var (
	legendLabelRE     = regexp.MustCompile(`\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}`)
	annotationLabelRE = regexp.MustCompile(`\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)`)
	variableRE        = regexp.MustCompile(`\$(\{([a-zA-Z_]\w*)\}|([a-zA-Z_]\w*))`)
)

// legendLabels returns the labels a Grafana legend format shows ({{zone}} {{result}}), sorted.
func legendLabels(format string) []string {
	var labels []string
	for _, m := range legendLabelRE.FindAllStringSubmatch(format, -1) {
		labels = append(labels, m[1])
	}
	slices.Sort(labels)
	return slices.Compact(labels)
}

// annotationLabels returns the labels that an alert's annotations use ($labels.zone), sorted.
func annotationLabels(annotations map[string]string) []string {
	var labels []string
	for _, a := range annotations {
		for _, m := range annotationLabelRE.FindAllStringSubmatch(a, -1) {
			labels = append(labels, m[1])
		}
	}
	slices.Sort(labels)
	return slices.Compact(labels)
}

// substitute replaces Grafana's $name and ${name} variables in expr by vars; a variable vars
// does not have is an error.
func substitute(expr string, vars map[string]string) (string, error) {
	var missing []string
	out := variableRE.ReplaceAllStringFunc(expr, func(v string) string {
		m := variableRE.FindStringSubmatch(v)
		name := m[2] + m[3]
		val, ok := vars[name]
		if !ok {
			missing = append(missing, v)
		}
		return val
	})
	if len(missing) > 0 {
		return "", fmt.Errorf("variables %v: this test does not know what Grafana puts there", missing)
	}
	return out, nil
}

// promDuration writes d as a PromQL duration in whole seconds.
func promDuration(d time.Duration) string { return strconv.Itoa(int(d/time.Second)) + "s" }

func unix(t time.Time) string { return strconv.FormatFloat(float64(t.UnixMilli())/1000, 'f', 3, 64) }

// --- Prometheus's HTTP API --------------------------------------------------------------------

type promAPI struct {
	t    *testing.T
	base string
	log  *logFile
}

type promSample struct {
	Metric map[string]string
	Value  float64
}

type promSeries struct {
	Metric map[string]string
	Values []float64
}

type alert struct {
	Labels map[string]string
	State  string
}

type alertingRule struct {
	Name, Query, Health, LastError string
	Annotations                    map[string]string
}

// tryGet GETs an API path and decodes the data of a successful answer into data.
func (p *promAPI) tryGet(path string, params url.Values, data any) error {
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(p.base + path + "?" + params.Encode())
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var body struct {
		Status, ErrorType, Error string
		Data                     json.RawMessage
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return fmt.Errorf("GET %s: %d, %w", path, resp.StatusCode, err)
	}
	if body.Status != "success" {
		return fmt.Errorf("GET %s?%s: %s: %s", path, params.Encode(), body.ErrorType, body.Error)
	}
	return json.Unmarshal(body.Data, data)
}

func (p *promAPI) get(path string, params url.Values, data any) {
	p.t.Helper()
	if err := p.tryGet(path, params, data); err != nil {
		p.t.Fatalf("%v; prometheus log:\n%s", err, tail(p.log))
	}
}

// query evaluates an instant query now.
func (p *promAPI) query(expr string) []promSample {
	p.t.Helper()
	var data struct {
		ResultType string
		Result     []struct {
			Metric map[string]string
			Value  [2]any
		}
	}
	p.get("/api/v1/query", url.Values{"query": {expr}}, &data)
	if data.ResultType != "vector" {
		p.t.Fatalf("query %s: result type %q, want vector", expr, data.ResultType)
	}
	var out []promSample
	for _, r := range data.Result {
		out = append(out, promSample{Metric: r.Metric, Value: parseValue(p.t, r.Value)})
	}
	return out
}

// queryRange evaluates a range query from start to end.
func (p *promAPI) queryRange(expr string, start, end time.Time, step time.Duration) []promSeries {
	p.t.Helper()
	var data struct {
		ResultType string
		Result     []struct {
			Metric map[string]string
			Values [][2]any
		}
	}
	p.get("/api/v1/query_range", url.Values{"query": {expr}, "start": {unix(start)}, "end": {unix(end)}, "step": {promDuration(step)}}, &data)
	if data.ResultType != "matrix" {
		p.t.Fatalf("query %s: result type %q, want matrix", expr, data.ResultType)
	}
	var out []promSeries
	for _, r := range data.Result {
		s := promSeries{Metric: r.Metric}
		for _, v := range r.Values {
			s.Values = append(s.Values, parseValue(p.t, v))
		}
		out = append(out, s)
	}
	return out
}

// parseValue reads a sample [time, "value"] of the API.
func parseValue(t *testing.T, v [2]any) float64 {
	t.Helper()
	s, _ := v[1].(string)
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		t.Fatalf("sample %v: %v", v, err)
	}
	return f
}

// alerts returns the pending and firing alerts.
func (p *promAPI) alerts() []alert {
	p.t.Helper()
	var data struct{ Alerts []alert }
	p.get("/api/v1/alerts", nil, &data)
	return data.Alerts
}

// alertingRules returns the alerting rules Prometheus loaded, checking that they are the
// alerts of the rule files, each once.
func (p *promAPI) alertingRules(inFiles []string) []alertingRule {
	p.t.Helper()
	var data struct {
		Groups []struct {
			Name  string
			Rules []struct {
				alertingRule
				Type string
			}
		}
	}
	p.get("/api/v1/rules", url.Values{"type": {"alert"}}, &data)
	var rules []alertingRule
	var names []string
	for _, g := range data.Groups {
		for _, r := range g.Rules {
			rules = append(rules, r.alertingRule)
			names = append(names, r.Name)
		}
	}
	slices.Sort(names)
	if len(inFiles) == 0 || !slices.Equal(names, inFiles) {
		p.t.Fatalf("Prometheus loaded the alerts %v; %s/*.yml has %v", names, rulesDir, inFiles)
	}
	return rules
}

// loadRuleFiles returns the names of the alerts in deploy/prometheus/*.yml, sorted.
func loadRuleFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(rulesDir, "*.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range files {
		var rf struct {
			Groups []struct {
				Rules []struct{ Alert string }
			}
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := yaml.Unmarshal(b, &rf); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		for _, g := range rf.Groups {
			for _, r := range g.Rules {
				if r.Alert != "" {
					names = append(names, r.Alert)
				}
			}
		}
	}
	slices.Sort(names)
	return names
}

// --- traffic ----------------------------------------------------------------------------------

type trafficGen struct {
	t    *testing.T
	site string
	done chan struct{}
	wg   sync.WaitGroup
	once sync.Once

	mu        sync.Mutex
	codes     map[string]int // "path code": responses
	degradedN int            // responses with X-RateLimit-Degraded: true
}

// startTraffic sends a round of requests every 100ms, and requests to /v1/chat one after
// another, until stop or the end of the test.
func startTraffic(t *testing.T, site string) *trafficGen {
	g := &trafficGen{t: t, site: site, done: make(chan struct{}), codes: map[string]int{}}
	g.wg.Add(2)
	go func() {
		defer g.wg.Done()
		tick := time.NewTicker(100 * time.Millisecond) // at most 10 a second (when not held)
		defer tick.Stop()
		for {
			g.send("/v1/chat", "X-API-Key", "llm")
			select {
			case <-g.done:
				return
			case <-tick.C:
			}
		}
	}()
	go func() {
		defer g.wg.Done()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for n := 0; ; n++ {
			for _, r := range [][]string{
				{"/", "X-API-Key", "k" + strconv.Itoa(n)},
				{"/"},
				{"/login", "X-API-Key", "l" + strconv.Itoa(n)},
				{"/search", "X-API-Key", "s" + strconv.Itoa(n)},
				{"/v1/chat"},
				{"/llm/v1/chat/completions", "X-API-Key", "c" + strconv.Itoa(n%4)},
			} {
				g.send(r[0], r[1:]...)
			}
			select {
			case <-g.done:
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(g.stop)
	return g
}

// send GETs path with the header name, value pairs given, and counts the response.
func (g *trafficGen) send(path string, header ...string) {
	code, h, err := g.request(path, header...)
	g.mu.Lock()
	defer g.mu.Unlock()
	if err != nil {
		g.codes[path+" error"]++
	} else {
		g.codes[path+" "+strconv.Itoa(code)]++
	}
	if h.Get("X-RateLimit-Degraded") == "true" {
		g.degradedN++
	}
}

// request GETs path with the header name, value pairs given.
func (g *trafficGen) request(path string, header ...string) (int, http.Header, error) {
	req, err := http.NewRequest(http.MethodGet, g.site+path, nil)
	if err != nil {
		return 0, http.Header{}, err
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return 0, http.Header{}, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, resp.Header, nil
}

func (g *trafficGen) stop() {
	g.once.Do(func() { close(g.done) })
	g.wg.Wait()
}

func (g *trafficGen) counts() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	keys := make([]string, 0, len(g.codes))
	for k := range g.codes {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s: %d, ", k, g.codes[k])
	}
	return strings.TrimSuffix(b.String(), ", ")
}

func (g *trafficGen) degraded() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.degradedN
}

// --- processes and files ----------------------------------------------------------------------

// logFile is a child process's output, kept in a file.
type logFile struct{ path string }

// startProcess starts a program with its output in dir/name.log, HOME and the XDG directories
// in dir, and kills it when the test ends (before t.TempDir is removed). A test that fails
// logs the end of the output.
func startProcess(t *testing.T, dir, name, bin string, env []string, args ...string) *logFile {
	t.Helper()
	lf := &logFile{path: filepath.Join(dir, name+".log")}
	out, err := os.Create(lf.path)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_CONFIG_HOME="+filepath.Join(dir, ".config"), "XDG_DATA_HOME="+filepath.Join(dir, ".local"))
	cmd.Env = append(cmd.Env, env...)
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", bin, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		out.Close()
		if t.Failed() {
			t.Logf("the end of %s's output:\n%s", name, tail(lf))
		}
	})
	return lf
}

// tail returns the last 30 lines of a log.
func tail(lf *logFile) string {
	if lf == nil {
		return ""
	}
	f, err := os.Open(lf.path)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > 30 {
			lines = lines[1:]
		}
	}
	return strings.Join(lines, "\n")
}

// rewrite returns a file's text with each old string (which must be there, once) replaced.
func rewrite(t *testing.T, file string, replacements [][2]string) string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	for _, r := range replacements {
		if n := strings.Count(s, r[0]); n != 1 {
			t.Fatalf("%s has %q %d times, want once (this test moves it)", file, r[0], n)
		}
		s = strings.Replace(s, r[0], r[1], 1)
	}
	return s
}

func writeFile(t *testing.T, file, content string) {
	t.Helper()
	if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// freePort returns a loopback TCP port that was free a moment ago, never one returned before
// in this process: the three ports of the test are distinct.
func freePort(t *testing.T) int {
	t.Helper()
	return freeport.Must(t)
}

func get(u string) (int, string, error) {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(u)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// poll calls cond until it reports true, failing the test with cond's last detail if that has
// not happened within timeout.
func poll(t *testing.T, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, detail := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s: %s", timeout, what, detail)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// --- the dashboard ----------------------------------------------------------------------------

type dashboardPanel struct {
	Title   string
	Type    string
	Targets []struct {
		RefID        string `json:"refId"`
		Expr         string
		LegendFormat string `json:"legendFormat"`
	}
	Panels []dashboardPanel // a row's
}

type dashboard struct {
	Panels     []dashboardPanel
	Templating struct {
		List []struct {
			Name, Definition string
			AllValue         string `json:"allValue"`
		}
	}
}

// readDashboard reads the dashboard with the panels of rows flattened into Panels. (The root
// package's TestDashboardQueriesNameExportedMetrics checks its JSON strictly.)
func readDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	var flat []dashboardPanel
	var walk func([]dashboardPanel)
	walk = func(ps []dashboardPanel) {
		for _, p := range ps {
			if p.Type == "row" {
				walk(p.Panels)
			} else {
				flat = append(flat, p)
			}
		}
	}
	walk(d.Panels)
	d.Panels = flat
	return d
}
