package ratelimitredis

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// The docker-compose demo (docker-compose.yml, Dockerfile, deploy/): these tests read its files
// and check that they fit together and fit the module. `make test` also runs `docker-compose
// config -q` on the compose file.
const (
	dashboardFile      = "deploy/grafana/dashboards/rate-limit-redis.json"
	datasourcesFile    = "deploy/grafana/provisioning/datasources/prometheus.yml"
	dashboardsProvFile = "deploy/grafana/provisioning/dashboards/rate-limit-redis.yml"
	composeCaddyfile   = "deploy/Caddyfile"
	prometheusFile     = "deploy/prometheus.yml"
	alertRulesGlob     = "deploy/prometheus/*.yml"
	composeFile        = "docker-compose.yml"
)

// TestDashboardQueriesNameExportedMetrics checks that the dashboard is valid JSON with panels,
// that every panel has a query, and that every series each query (and the zone variable) names
// is one the module exports, with only labels that series has.
func TestDashboardQueriesNameExportedMetrics(t *testing.T) {
	t.Parallel()
	exported := exportedSeries(t)
	dash := readDashboard(t)
	if len(dash.Panels) == 0 {
		t.Fatalf("%s has no panels", dashboardFile)
	}
	named := map[string]bool{}
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q, query %s: no expr", p.Title, tg.RefID)
				continue
			}
			series, err := checkQuery(tg.Expr, exported)
			if err != nil {
				t.Errorf("panel %q, query %s: %v", p.Title, tg.RefID, err)
			}
			for _, s := range series {
				named[s] = true
			}
		}
	}
	for _, v := range dash.Templating.List {
		m := labelValuesRE.FindStringSubmatch(v.Definition)
		if m == nil {
			t.Errorf("variable %q: query %q is not label_values(<metric>, <label>)", v.Name, v.Definition)
			continue
		}
		if labels, ok := exported[m[1]]; !ok {
			t.Errorf("variable %q names %s, which the module does not export", v.Name, m[1])
		} else if !slices.Contains(labels, m[2]) {
			t.Errorf("variable %q: %s has no label %q (it has %v)", v.Name, m[1], m[2], labels)
		}
	}
	// The four views: decisions by result, the 429 rate, fail-open/closed events, Redis p99.
	for _, s := range []string{"caddy_rate_limit_redis_decisions_total", "caddy_rate_limit_redis_redis_duration_seconds_bucket"} {
		if !named[s] {
			t.Errorf("no panel queries %s", s)
		}
	}
	for _, title := range []string{"Decisions by result", "429 rate by zone", "Fail-open / fail-closed events", "Redis latency"} {
		if !slices.ContainsFunc(dash.Panels, func(p dashboardPanel) bool { return p.Title == title }) {
			t.Errorf("no panel %q", title)
		}
	}
}

// TestCheckQueryRejects shows that checkQuery catches what the dashboard test is there to catch.
func TestCheckQueryRejects(t *testing.T) {
	t.Parallel()
	exported := exportedSeries(t)
	for _, tc := range []struct{ expr, err string }{
		{`rate(caddy_rate_limit_redis_decision_total[5m])`, `names caddy_rate_limit_redis_decision_total, which the module does not export`},
		{`sum by (result) (rate(caddy_http_requests_total{code="429"}[5m]))`, `names caddy_http_requests_total, which the module does not export`},
		{`sum(rate(caddy_rate_limit_redis_decisions_total{reason="timeout"}[5m]))`, `selects caddy_rate_limit_redis_decisions_total by label "reason", which it does not have (it has [zone result])`},
		{`sum by (reason) (rate(caddy_rate_limit_redis_decisions_total[5m]))`, `groups by label "reason", which none of its series has`},
		{`histogram_quantile(0.99, sum by (le) (rate(caddy_rate_limit_redis_redis_duration_seconds[5m])))`, `names caddy_rate_limit_redis_redis_duration_seconds, which the module does not export`},
		{`histogram_quantile(0.99, sum by (le) (rate(caddy_rate_limit_redis_redis_duration_seconds_sum[5m])))`, `groups by label "le", which none of its series has`},
		{`rte(caddy_rate_limit_redis_deny_cache_hits_total[5m])`, `unknown function "rte"`},
		{`sum(rate({__name__="caddy_rate_limit_redis_deny_cache_hits_total"}[5m]))`, `a selector without a metric name at offset 9`},
		{`vector(1)`, `names no metric`},
		{`rate(caddy_rate_limit_redis_deny_cache_hits_total{zone="api}[5m])`, `unterminated string at offset 55`},
	} {
		_, err := checkQuery(tc.expr, exported)
		if err == nil || err.Error() != tc.err {
			t.Errorf("checkQuery(%s) = %v, want %s", tc.expr, err, tc.err)
		}
	}
	// and accepts every form the dashboard uses
	series, err := checkQuery(`sum by (zone) (rate(caddy_rate_limit_redis_decisions_total{zone=~"$zone", result="denied"}[$__rate_interval])) / on (zone) group_left sum by (zone) (increase(caddy_rate_limit_redis_decisions_total{result!~'a|b'}[1m:10s] offset 5m))`, exported)
	if err != nil || !slices.Equal(series, []string{"caddy_rate_limit_redis_decisions_total", "caddy_rate_limit_redis_decisions_total"}) {
		t.Errorf("checkQuery of a good query = %v, %v", series, err)
	}
}

// TestDashboardDatasourceIsProvisioned checks that every panel, query and variable of the
// dashboard uses the Prometheus data source provisioned for Grafana, by its uid.
func TestDashboardDatasourceIsProvisioned(t *testing.T) {
	t.Parallel()
	var prov struct {
		Datasources []struct {
			Name, Type, UID, URL string
		}
	}
	readYAML(t, datasourcesFile, &prov)
	if len(prov.Datasources) != 1 || prov.Datasources[0].Type != "prometheus" || prov.Datasources[0].UID == "" {
		t.Fatalf("%s: want one prometheus data source with a uid, got %+v", datasourcesFile, prov.Datasources)
	}
	uid := prov.Datasources[0].UID
	dash := readDashboard(t)
	check := func(what string, ds *dashboardDatasource) {
		if ds == nil || ds.UID != uid || ds.Type != "prometheus" {
			t.Errorf("%s: datasource %+v, want prometheus uid %q (%s)", what, ds, uid, datasourcesFile)
		}
	}
	for _, p := range dash.Panels {
		check(fmt.Sprintf("panel %q", p.Title), p.Datasource)
		for _, tg := range p.Targets {
			check(fmt.Sprintf("panel %q query %s", p.Title, tg.RefID), tg.Datasource)
		}
	}
	for _, v := range dash.Templating.List {
		check(fmt.Sprintf("variable %q", v.Name), v.Datasource)
	}
}

// TestComposeWiring checks that the files of the compose demo agree with each other: the
// Caddyfile adapts with no warning, keeps the admin API on loopback, and reaches Redis at the
// redis service; Prometheus scrapes the Caddyfile's metrics listener and loads every alerting
// rule file where compose mounts them; Grafana's provisioning finds the mounted dashboard and
// the prometheus service; images are pinned; the Dockerfile builds the Caddy version of the
// Makefile.
func TestComposeWiring(t *testing.T) {
	var compose struct {
		Services map[string]struct {
			Image       string
			Build       any
			Environment map[string]string
			Volumes     []string
		}
	}
	readYAML(t, composeFile, &compose)
	for _, name := range []string{"caddy", "redis", "prometheus", "grafana"} {
		if _, ok := compose.Services[name]; !ok {
			t.Fatalf("%s: no service %s", composeFile, name)
		}
	}
	for name, s := range compose.Services {
		if _, tag, ok := strings.Cut(s.Image, ":"); !ok || tag == "" || tag == "latest" {
			t.Errorf("%s: service %s: image %q has no pinned tag", composeFile, name, s.Image)
		}
	}
	caddySvc, grafanaSvc := compose.Services["caddy"], compose.Services["grafana"]
	if caddySvc.Build != "." {
		t.Errorf("%s: caddy builds %v, want . (the Dockerfile)", composeFile, caddySvc.Build)
	}
	if mountOf(caddySvc.Volumes, "./"+composeCaddyfile) != "/etc/caddy/Caddyfile" {
		t.Errorf("%s: caddy does not mount %s at /etc/caddy/Caddyfile: %v", composeFile, composeCaddyfile, caddySvc.Volumes)
	}

	// The Caddyfile, adapted with the environment compose gives Caddy.
	for k, v := range caddySvc.Environment {
		t.Setenv(k, v)
	}
	src, err := os.ReadFile(composeCaddyfile)
	if err != nil {
		t.Fatal(err)
	}
	cfgJSON, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt(src, map[string]any{"filename": composeCaddyfile})
	if err != nil {
		t.Fatalf("adapting %s: %v", composeCaddyfile, err)
	}
	if len(warnings) > 0 {
		t.Fatalf("adapting %s: warnings %v", composeCaddyfile, warnings)
	}
	var cfg struct {
		Admin struct{ Listen string }
		Apps  struct {
			HTTP struct {
				Servers map[string]struct {
					Listen []string
					Routes []struct {
						Match  []struct{ Path []string }
						Handle []struct {
							Handler string
							Redis   struct{ Addresses []string }
						}
					}
				}
			}
		}
	}
	if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.Admin.Listen != "localhost:2019" {
		t.Errorf("%s: admin listens on %q, want localhost:2019 (never outside the container)", composeCaddyfile, cfg.Admin.Listen)
	}
	var metricsListen []string
	var metricsPath string
	var redisAddrs []string
	for _, srv := range cfg.Apps.HTTP.Servers {
		for _, r := range srv.Routes {
			for _, h := range r.Handle {
				switch h.Handler {
				case "metrics":
					metricsListen = srv.Listen
					metricsPath = "/"
					if len(r.Match) == 1 && len(r.Match[0].Path) == 1 {
						metricsPath = r.Match[0].Path[0]
					}
				case "rate_limit_redis":
					redisAddrs = append(redisAddrs, h.Redis.Addresses...)
				}
			}
		}
	}
	if len(redisAddrs) == 0 {
		t.Errorf("%s: no rate_limit_redis handler", composeCaddyfile)
	}
	for _, a := range redisAddrs {
		if host, _, _ := net.SplitHostPort(a); compose.Services[host].Image == "" || !strings.HasPrefix(compose.Services[host].Image, "redis:") {
			t.Errorf("%s: Redis address %q is not the redis service of %s", composeCaddyfile, a, composeFile)
		}
	}
	if len(metricsListen) != 1 {
		t.Fatalf("%s: want one server with a metrics handler, listening on one address; got %v", composeCaddyfile, metricsListen)
	}
	_, metricsPort, err := net.SplitHostPort(metricsListen[0])
	if err != nil {
		t.Fatal(err)
	}

	var prom struct {
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			MetricsPath   string                       `yaml:"metrics_path"`
			StaticConfigs []struct{ Targets []string } `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	readYAML(t, prometheusFile, &prom)
	if len(prom.ScrapeConfigs) != 1 || len(prom.ScrapeConfigs[0].StaticConfigs) != 1 {
		t.Fatalf("%s: want one scrape config with one static config, got %+v", prometheusFile, prom.ScrapeConfigs)
	}
	sc := prom.ScrapeConfigs[0]
	if want := []string{"caddy:" + metricsPort}; !slices.Equal(sc.StaticConfigs[0].Targets, want) || sc.MetricsPath != metricsPath {
		t.Errorf("%s scrapes %v%s, want %v%s (the metrics listener of %s)", prometheusFile, sc.StaticConfigs[0].Targets, sc.MetricsPath, want, metricsPath, composeCaddyfile)
	}
	if mountOf(compose.Services["prometheus"].Volumes, "./"+prometheusFile) != "/etc/prometheus/prometheus.yml" {
		t.Errorf("%s: prometheus does not mount %s at /etc/prometheus/prometheus.yml", composeFile, prometheusFile)
	}
	// The alerting rules: rule_files (relative to prometheus.yml) find every rule file of
	// deploy/prometheus where compose mounts it.
	ruleFiles, err := filepath.Glob(alertRulesGlob)
	if err != nil || len(ruleFiles) == 0 {
		t.Fatalf("no alerting rules %s (%v)", alertRulesGlob, err)
	}
	var loaded []string
	for _, pattern := range prom.RuleFiles {
		inContainer := path.Join("/etc/prometheus", pattern)
		host := hostPathOf(compose.Services["prometheus"].Volumes, inContainer)
		if host == "" {
			t.Errorf("%s: rule_files %q is %s in the container, which no volume of prometheus in %s provides", prometheusFile, pattern, inContainer, composeFile)
			continue
		}
		matches, err := filepath.Glob(host)
		if err != nil {
			t.Fatal(err)
		}
		loaded = append(loaded, matches...)
	}
	if slices.Sort(loaded); !slices.Equal(loaded, ruleFiles) {
		t.Errorf("%s: rule_files %v load %v in the compose stack, want %v", prometheusFile, prom.RuleFiles, loaded, ruleFiles)
	}

	// Grafana: the provisioning directory, the dashboards directory the provider reads, the
	// home dashboard, and the data source URL.
	if mountOf(grafanaSvc.Volumes, "./deploy/grafana/provisioning") != "/etc/grafana/provisioning" {
		t.Errorf("%s: grafana does not mount ./deploy/grafana/provisioning at /etc/grafana/provisioning", composeFile)
	}
	var provider struct {
		Providers []struct {
			Type    string
			Options struct{ Path string }
		}
	}
	readYAML(t, dashboardsProvFile, &provider)
	dashDir := mountOf(grafanaSvc.Volumes, "./"+path.Dir(dashboardFile))
	if len(provider.Providers) != 1 || provider.Providers[0].Type != "file" || provider.Providers[0].Options.Path != dashDir || dashDir == "" {
		t.Errorf("%s: providers %+v, want one file provider reading %q (where %s mounts %s)", dashboardsProvFile, provider.Providers, dashDir, composeFile, path.Dir(dashboardFile))
	}
	if home := grafanaSvc.Environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]; home != path.Join(dashDir, path.Base(dashboardFile)) {
		t.Errorf("%s: grafana's home dashboard is %q, want %s", composeFile, home, path.Join(dashDir, path.Base(dashboardFile)))
	}
	var ds struct{ Datasources []struct{ URL string } }
	readYAML(t, datasourcesFile, &ds)
	if len(ds.Datasources) != 1 || ds.Datasources[0].URL != "http://prometheus:9090" {
		t.Errorf("%s: data sources %+v, want the URL http://prometheus:9090", datasourcesFile, ds.Datasources)
	}

	// The Dockerfile builds the Caddy version the Makefile builds.
	dockerfile, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	makefile, err := os.ReadFile("Makefile")
	if err != nil {
		t.Fatal(err)
	}
	tag := regexp.MustCompile(`(?m)^ARG CADDY_TAG=(\S+)$`).FindSubmatch(dockerfile)
	version := regexp.MustCompile(`(?m)^CADDY_VERSION \?= v(\S+)$`).FindSubmatch(makefile)
	if tag == nil || version == nil || string(tag[1]) != string(version[1]) {
		t.Errorf("Dockerfile builds Caddy %q, the Makefile %q", tag, version)
	}
}

// exportedSeries returns the series the module exports, each with its label names, derived
// from the collectors registerMetrics registers: a counter or gauge its name, a histogram its
// _bucket (with le), _sum and _count, a summary its name (with quantile), _sum and _count.
func exportedSeries(t *testing.T) map[string][]string {
	t.Helper()
	reg := prometheus.NewRegistry()
	rec := &recordingRegisterer{Registerer: reg}
	if err := registerMetrics(rec); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	kindOf := map[string]string{} // what Gather reports for collectors that always export
	for _, f := range families {
		kindOf[f.GetName()] = f.GetType().String()
	}
	series := map[string][]string{}
	for _, c := range rec.collectors {
		ch := make(chan *prometheus.Desc)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			m := descRE.FindStringSubmatch(d.String())
			if d.Err() != nil || m == nil {
				t.Fatalf("cannot read the name and labels of %s (%v)", d, d.Err())
			}
			name := m[1]
			var labels []string
			for l := range strings.SplitSeq(m[2], ",") {
				if l != "" {
					labels = append(labels, strings.TrimSuffix(strings.TrimPrefix(l, "c("), ")"))
				}
			}
			kind := kindOf[name]
			switch c.(type) {
			case *prometheus.CounterVec:
				kind = "COUNTER"
			case *prometheus.GaugeVec:
				kind = "GAUGE"
			case *prometheus.HistogramVec:
				kind = "HISTOGRAM"
			case *prometheus.SummaryVec:
				kind = "SUMMARY"
			}
			switch kind {
			case "COUNTER", "GAUGE":
				series[name] = labels
			case "HISTOGRAM":
				series[name+"_bucket"] = append(slices.Clone(labels), "le")
				series[name+"_sum"], series[name+"_count"] = labels, labels
			case "SUMMARY":
				series[name] = append(slices.Clone(labels), "quantile")
				series[name+"_sum"], series[name+"_count"] = labels, labels
			default:
				t.Fatalf("collector %T of %s: cannot tell its kind (%q)", c, name, kind)
			}
		}
	}
	if len(series) == 0 {
		t.Fatal("registerMetrics registers no metric")
	}
	return series
}

// descRE reads a Desc's String: its name and the names of its variable labels (a constrained
// label is written c(name)); the format is client_golang's, checked by exportedSeries.
var descRE = regexp.MustCompile(`^Desc\{fqName: "([a-zA-Z_:][a-zA-Z0-9_:]*)", .*, variableLabels: \{([^}]*)\}\}$`)

// recordingRegisterer notes each collector registered through it.
type recordingRegisterer struct {
	prometheus.Registerer
	collectors []prometheus.Collector
}

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	r.collectors = append(r.collectors, c)
	return r.Registerer.Register(c)
}

// checkQuery checks that every series expr selects is one of exported and is selected only by
// labels it has, and that every grouping label is a label of one of the series. It returns the
// series named, in order.
func checkQuery(expr string, exported map[string][]string) ([]string, error) {
	refs, err := parsePromQL(expr)
	if err != nil {
		return nil, err
	}
	if len(refs.selectors) == 0 {
		return nil, errors.New("names no metric")
	}
	var names, all []string
	for _, sel := range refs.selectors {
		labels, ok := exported[sel.metric]
		if !ok {
			return nil, fmt.Errorf("names %s, which the module does not export", sel.metric)
		}
		for _, l := range sel.labels {
			if !slices.Contains(labels, l) {
				return nil, fmt.Errorf("selects %s by label %q, which it does not have (it has %v)", sel.metric, l, labels)
			}
		}
		names = append(names, sel.metric)
		all = append(all, labels...)
	}
	for _, l := range refs.grouping {
		if !slices.Contains(all, l) {
			return nil, fmt.Errorf("groups by label %q, which none of its series has", l)
		}
	}
	return names, nil
}

// promqlRefs is what a PromQL expression refers to.
type promqlRefs struct {
	selectors []promqlSelector
	grouping  []string // the labels of by, without, on, ignoring, group_left and group_right
}

type promqlSelector struct {
	metric string
	labels []string // the label names of its matchers
}

// parsePromQL reads the series selectors and grouping labels of a PromQL expression, as far as
// the dashboard needs: functions must be known PromQL functions, selectors must name their
// metric, and Grafana's $variables may stand in ranges and strings. It is not a full parser:
// it does not check the grammar, only what the expression names.
func parsePromQL(s string) (promqlRefs, error) {
	var refs promqlRefs
	i := 0
	skipSpace := func() {
		for i < len(s) && strings.IndexByte(" \t\r\n", s[i]) >= 0 {
			i++
		}
	}
	ident := func() string {
		j := i
		for i < len(s) && (isIdentByte(s[i]) || (i > j && s[i] >= '0' && s[i] <= '9')) {
			i++
		}
		return s[j:i]
	}
	skipString := func() error {
		start, q := i, s[i]
		for i++; i < len(s); i++ {
			if s[i] == '\\' && q != '`' {
				i++
			} else if s[i] == q {
				i++
				return nil
			}
		}
		return fmt.Errorf("unterminated string at offset %d", start)
	}
	for skipSpace(); i < len(s); skipSpace() {
		c := s[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			if err := skipString(); err != nil {
				return refs, err
			}
		case c == '[': // a range or subquery: durations and variables
			j := strings.IndexByte(s[i:], ']')
			if j < 0 {
				return refs, fmt.Errorf("unterminated range at offset %d", i)
			}
			i += j + 1
		case c == '{':
			return refs, fmt.Errorf("a selector without a metric name at offset %d", i)
		case c == '$': // a Grafana variable
			i++
			if i < len(s) && s[i] == '{' {
				if j := strings.IndexByte(s[i:], '}'); j >= 0 {
					i += j + 1
				}
			} else {
				ident()
			}
		case c >= '0' && c <= '9' || c == '.': // a number or duration
			for i < len(s) && (isIdentByte(s[i]) || s[i] == '.' || s[i] >= '0' && s[i] <= '9') {
				i++
			}
		case isIdentByte(c):
			word := ident()
			skipSpace()
			switch {
			case promqlGrouping[word]:
				if i < len(s) && s[i] == '(' {
					end := strings.IndexByte(s[i:], ')')
					if end < 0 {
						return refs, fmt.Errorf("unterminated %s at offset %d", word, i)
					}
					for l := range strings.SplitSeq(s[i+1:i+end], ",") {
						if l = strings.TrimSpace(l); l != "" {
							refs.grouping = append(refs.grouping, l)
						}
					}
					i += end + 1
				}
			case promqlKeywords[word]:
			case promqlAggregations[word]:
			case i < len(s) && s[i] == '(':
				if !promqlFunctions[word] {
					return refs, fmt.Errorf("unknown function %q", word)
				}
			default:
				sel := promqlSelector{metric: word}
				if i < len(s) && s[i] == '{' {
					for i++; ; {
						skipSpace()
						if i < len(s) && s[i] == '}' {
							i++
							break
						}
						l := ident()
						if l == "" {
							return refs, fmt.Errorf("bad label matcher at offset %d", i)
						}
						sel.labels = append(sel.labels, l)
						skipSpace()
						for i < len(s) && strings.IndexByte("=!~", s[i]) >= 0 {
							i++
						}
						skipSpace()
						if i >= len(s) || strings.IndexByte("\"'`", s[i]) < 0 {
							return refs, fmt.Errorf("label %s: no string at offset %d", l, i)
						}
						if err := skipString(); err != nil {
							return refs, err
						}
						skipSpace()
						if i < len(s) && s[i] == ',' {
							i++
						}
					}
				}
				refs.selectors = append(refs.selectors, sel)
			}
		default: // operators and parentheses
			i++
		}
	}
	return refs, nil
}

func isIdentByte(c byte) bool {
	return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

func setOf(words string) map[string]bool {
	m := map[string]bool{}
	for w := range strings.FieldsSeq(words) {
		m[w] = true
	}
	return m
}

var (
	promqlGrouping     = setOf("by without on ignoring group_left group_right")
	promqlKeywords     = setOf("and or unless bool offset atan2 inf nan Inf NaN")
	promqlAggregations = setOf("sum avg count min max group stddev stdvar topk bottomk quantile count_values limitk limit_ratio")
	promqlFunctions    = setOf(`abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil
		changes clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
		days_in_month deg delta deriv double_exponential_smoothing end exp floor histogram_avg
		histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar
		histogram_sum holt_winters hour idelta increase irate label_join label_replace last_over_time
		ln log10 log2 mad_over_time max_over_time min_over_time minute month pi predict_linear
		present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort sort_by_label
		sort_by_label_desc sort_desc sqrt start stddev_over_time stdvar_over_time sum_over_time tan tanh
		time timestamp vector year`)
)

// labelValuesRE reads a Grafana variable query label_values(<metric>, <label>).
var labelValuesRE = regexp.MustCompile(`^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)$`)

// The parts of a Grafana dashboard these tests read.
type dashboardDatasource struct{ Type, UID string }

type dashboardPanel struct {
	Title      string
	Type       string
	Datasource *dashboardDatasource
	Targets    []struct {
		RefID      string `json:"refId"`
		Expr       string
		Datasource *dashboardDatasource
	}
	Panels []dashboardPanel // a row's
}

type dashboard struct {
	Panels     []dashboardPanel
	Templating struct {
		List []struct {
			Name, Definition string
			Datasource       *dashboardDatasource
		}
	}
}

// readDashboard reads the dashboard, strictly (valid JSON, nothing after it), with the panels
// of rows flattened into Panels.
func readDashboard(t *testing.T) dashboard {
	t.Helper()
	f, err := os.Open(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := json.NewDecoder(f)
	var d dashboard
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		t.Fatalf("%s: more after the dashboard object (%v)", dashboardFile, err)
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

// readYAML decodes a YAML file into v; keys v has no field for are ignored.
func readYAML(t *testing.T, file string, v any) {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
}

// hostPathOf returns the host path (relative, without ./) that a compose volume list puts at
// the container path p, or "".
func hostPathOf(volumes []string, p string) string {
	for _, v := range volumes {
		parts := strings.Split(v, ":")
		if len(parts) < 2 {
			continue
		}
		if rel, ok := strings.CutPrefix(p, parts[1]+"/"); ok || p == parts[1] {
			return path.Join(strings.TrimPrefix(parts[0], "./"), rel)
		}
	}
	return ""
}

// mountOf returns where a compose volume list mounts host (a ./path), or "".
func mountOf(volumes []string, host string) string {
	for _, v := range volumes {
		parts := strings.Split(v, ":")
		if len(parts) >= 2 && parts[0] == host {
			return parts[1]
		}
	}
	return ""
}
