package e2e_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
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
	var blocks []repocheck.DocBlock
	for _, b := range repocheck.DocBlocks(t, "caddyfile") {
		if strings.HasPrefix(b.Where, "docs/migrating.md:") {
			blocks = append(blocks, b)
		}
	}
	if len(blocks) != 2 {
		t.Fatalf("docs/migrating.md has %d caddyfile blocks, want the 2 \"after\" examples", len(blocks))
	}
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
			for n := 1; n <= 3; n++ {
				cs.Get("/").Expect(t, "request "+strconv.Itoa(n), 200, "upstream")
			}
			r := cs.Get("/")
			if r.Status != 429 {
				t.Fatalf("request 4: %d %q, want 429", r.Status, r.Body)
			}
			jitter := []int{0, 12}[i]
			if ra, err := strconv.Atoi(r.Header.Get("Retry-After")); err != nil || ra < 1 || ra > 60+jitter {
				t.Fatalf("request 4: Retry-After %q, want 1 to %d seconds", r.Header.Get("Retry-After"), 60+jitter)
			}
			if i == 1 && r.Body != "limited by zone per_network" {
				t.Fatalf("request 4: body %q, want the handle_errors body naming per_network", r.Body)
			}
		})
	}
}
