package e2e_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/repocheck"
)

// TestMigratingExamples runs each "after" Caddyfile of docs/migrating.md as written (the site on
// a free loopback port, the upstream a test server, the admin API off) against a real Redis,
// and checks the limit the "before" Caddyfile states: three requests a minute per client
// address, then a 429 with a Retry-After of at most the window plus the jitter, and in the
// second example a body naming the zone that denied.
func TestMigratingExamples(t *testing.T) {
	blocks := migratingBlocks(t, "caddyfile", `the 2 "after" examples`)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "upstream")
	}))
	t.Cleanup(upstream.Close)
	for i, b := range blocks {
		t.Run(b.Where, func(t *testing.T) {
			srv := redistest.Start(t)
			site := freeport.Must(t)
			caddyfile := "{\n\tadmin off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n}\n\n" + b.Text
			for _, r := range [][2]string{
				{"example.com {\n", fmt.Sprintf(":%d {\n\tbind 127.0.0.1\n", site)},
				{"reverse_proxy localhost:9000\n", "reverse_proxy " + strings.TrimPrefix(upstream.URL, "http://") + "\n"},
				// Decisions wait for Redis up to 5 s: one failed open would admit a 4th request.
				{"rate_limit_redis {\n", "rate_limit_redis {\n\t\ttimeout 5s\n"},
			} {
				if !strings.Contains(caddyfile, r[0]) {
					t.Fatalf("%s has no %q", b.Where, r[0])
				}
				caddyfile = strings.Replace(caddyfile, r[0], r[1], 1)
			}
			t.Setenv("REDIS_ADDR", srv.Addr)
			t.Cleanup(func() { _ = caddy.Stop() })
			if err := caddytest.LoadCaddyfile(t, caddyfile); err != nil {
				t.Fatal(err)
			}
			cs := &caddytest.Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(site)}
			r := threeThen429(t, cs, 60+[]int{0, 12}[i])
			if i == 1 && r.Body != "limited by zone per_network" {
				t.Fatalf("request 4: body %q, want the handle_errors body naming per_network", r.Body)
			}
		})
	}
}

// TestMigratingJSON runs the "after" handler of docs/migrating.md's JSON section as written (in
// a route before a test upstream, on a free loopback port) against a real Redis, after checking
// that it keeps every zone of the "before" handler with its name, window and max_events (as a
// sliding window's limit): three GET requests a minute per client address, then a 429 with a
// Retry-After of at most the window plus the jitter (72 s).
func TestMigratingJSON(t *testing.T) {
	blocks := migratingBlocks(t, "json", `the "before" and "after" handlers`)
	var before struct {
		Handler    string `json:"handler"`
		RateLimits map[string]struct {
			Window    string `json:"window"`
			MaxEvents int    `json:"max_events"`
		} `json:"rate_limits"`
	}
	if err := json.Unmarshal([]byte(blocks[0].Text), &before); err != nil || before.Handler != "rate_limit" {
		t.Fatalf("%s: %v, handler %q: want caddy-ratelimit's handler", blocks[0].Where, err, before.Handler)
	}
	var after map[string]any
	if err := json.Unmarshal([]byte(blocks[1].Text), &after); err != nil || after["handler"] != "rate_limit_redis" {
		t.Fatalf("%s: %v, handler %v: want this module's handler", blocks[1].Where, err, after["handler"])
	}
	var zones struct {
		Zones []struct {
			Name      string `json:"name"`
			Algorithm string `json:"algorithm"`
			Limit     int    `json:"limit"`
			Window    string `json:"window"`
		} `json:"zones"`
	}
	if err := json.Unmarshal([]byte(blocks[1].Text), &zones); err != nil {
		t.Fatal(err)
	}
	if len(zones.Zones) != len(before.RateLimits) {
		t.Fatalf("after has %d zones, before %d", len(zones.Zones), len(before.RateLimits))
	}
	for _, z := range zones.Zones {
		b, ok := before.RateLimits[z.Name]
		if !ok || z.Algorithm != "sliding_window" || z.Limit != b.MaxEvents || z.Window != b.Window {
			t.Fatalf("after's zone %+v does not keep before's %q: %+v", z, z.Name, b)
		}
	}

	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "upstream")
	}))
	t.Cleanup(upstream.Close)
	srv := redistest.Start(t)
	t.Setenv("REDIS_ADDR", srv.Addr)
	site := freeport.Must(t)
	// config is a whole Caddy config serving handler in a route before the upstream.
	config := func(handler map[string]any) []byte {
		cfg, err := json.Marshal(map[string]any{
			"admin":   map[string]any{"disabled": true, "config": map[string]any{"persist": false}},
			"logging": map[string]any{"logs": map[string]any{"default": map[string]any{"level": "ERROR"}}},
			"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"migrated": map[string]any{
				"listen": []string{fmt.Sprintf("127.0.0.1:%d", site)},
				"routes": []any{map[string]any{"handle": []any{handler, map[string]any{
					"handler":   "reverse_proxy",
					"upstreams": []any{map[string]any{"dial": strings.TrimPrefix(upstream.URL, "http://")}},
				}}}},
			}}}},
		})
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	t.Cleanup(func() { _ = caddy.Stop() })

	// The errors the page quotes for caddy-ratelimit's fields left in, one at a time under this
	// handler's name (Caddy names the first it meets): its zones, its distributed option, its
	// jitter as a fraction, and a key given as a string.
	var left map[string]any
	if err := json.Unmarshal([]byte(blocks[0].Text), &left); err != nil {
		t.Fatal(err)
	}
	leftIn := func(field string) map[string]any {
		return map[string]any{"handler": "rate_limit_redis", field: left[field]}
	}
	stringKey := maps.Clone(after)
	stringKey["zones"] = []any{map[string]any{"name": "z", "key": "static", "algorithm": "sliding_window", "limit": 3, "window": "1m"}}
	page, err := os.ReadFile("docs/migrating.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		handler map[string]any
		want    string
	}{
		{leftIn("rate_limits"), `json: unknown field "rate_limits"`},
		{leftIn("distributed"), `json: unknown field "distributed"`},
		{leftIn("jitter"), "cannot unmarshal number 0.2 into Go struct field Handler.jitter of type time.Duration"},
		{stringKey, "cannot unmarshal string into Go struct field Zone.zones.key of type []string"},
	} {
		if err := caddy.Load(config(c.handler), true); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Fatalf("loading %v: %v, want an error with %q", c.handler, err, c.want)
		}
		if !strings.Contains(strings.Join(strings.Fields(string(page)), " "), "`"+c.want+"`") {
			t.Fatalf("docs/migrating.md does not quote the error %q", c.want)
		}
	}

	after["timeout"] = "5s" // decisions wait for Redis up to 5 s: one failed open would admit a 4th request
	if err := caddytest.LoadServing(t, config(after)); err != nil {
		t.Fatal(err)
	}
	threeThen429(t, &caddytest.Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(site)}, 72)
}

// threeThen429 sends 4 GET requests to cs: the first three must get the upstream's 200, the
// fourth a 429 with a Retry-After of 1 to maxRetry seconds, which it returns.
func threeThen429(t *testing.T, cs *caddytest.Site, maxRetry int) caddytest.Response {
	t.Helper()
	for n := 1; n <= 3; n++ {
		cs.Get("/").Expect(t, "request "+strconv.Itoa(n), 200, "upstream")
	}
	r := cs.Get("/")
	if r.Status != 429 {
		t.Fatalf("request 4: %d %q, want 429", r.Status, r.Body)
	}
	if ra, err := strconv.Atoi(r.Header.Get("Retry-After")); err != nil || ra < 1 || ra > maxRetry {
		t.Fatalf("request 4: Retry-After %q, want 1 to %d seconds", r.Header.Get("Retry-After"), maxRetry)
	}
	return r
}

// migratingBlocks returns docs/migrating.md's code blocks of language lang, failing t unless
// there are two (what names them).
func migratingBlocks(t *testing.T, lang, what string) []repocheck.DocBlock {
	t.Helper()
	var blocks []repocheck.DocBlock
	for _, b := range repocheck.DocBlocks(t, lang) {
		if strings.HasPrefix(b.Where, "docs/migrating.md:") {
			blocks = append(blocks, b)
		}
	}
	if len(blocks) != 2 {
		t.Fatalf("docs/migrating.md has %d %s blocks, want %s", len(blocks), lang, what)
	}
	return blocks
}
