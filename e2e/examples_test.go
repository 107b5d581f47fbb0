package e2e_test

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// composeCaddyfile is the Caddyfile of the docker-compose demo.
const composeCaddyfile = "deploy/Caddyfile"

// TestExamplesAreSafe runs Caddyfile.example and deploy/Caddyfile (ports moved to free loopback
// ports, the admin API off) against a real Redis and checks what makes them safe as written: a
// client inventing a new X-API-Key per request is stopped by the ip zone, and the login zone
// covers /login/, /login/… and /LOGIN as well as /login.
func TestExamplesAreSafe(t *testing.T) {
	for _, ex := range []struct {
		file       string
		ipBurst    int     // the ip zone's capacity
		ipPerSec   float64 // its refill rate, per second
		ipRefillAs string  // as the file writes it
	}{
		{"Caddyfile.example", 40, 0.5, "1 per 2s"},
		{composeCaddyfile, 100, 10, "10 a second"}, // deploy/traffic.sh sends about 9 a second from one address
	} {
		file := ex.file
		t.Run(file, func(t *testing.T) {
			srv := redistest.Start(t)
			src, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			site := freeport.Must(t)
			caddyfile := string(src)
			for _, r := range [][2]string{
				{"\tadmin localhost:2019\n", "\tadmin off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n"},
				{"\tadmin {$ADMIN_ADDRESS:localhost:2019}\n", "\tadmin off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n"},
				{"\n:8080 {\n", fmt.Sprintf("\n:%d {\n\tbind 127.0.0.1\n", site)},
				{"\n{$SITE_ADDRESS::8080} {\n", fmt.Sprintf("\n:%d {\n\tbind 127.0.0.1\n", site)},
				{"\n:2020 {\n", fmt.Sprintf("\n:%d {\n\tbind 127.0.0.1\n", freeport.Must(t))},
			} {
				caddyfile = strings.Replace(caddyfile, r[0], r[1], 1)
			}
			t.Setenv("REDIS_ADDR", srv.Addr)
			t.Cleanup(func() { _ = caddy.Stop() })
			if err := caddytest.LoadCaddyfile(t, caddyfile); err != nil {
				t.Fatal(err)
			}
			cs := &caddytest.Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(site)}

			// 3 logins per minute per IP, whatever the form of the path (each with a new API
			// key, so that only the login and ip zones can deny). deploy/Caddyfile's /login asks
			// for a password (basic_auth): a 401, which its zone login counts (count_status).
			login := 200
			if file == composeCaddyfile {
				login = 401
			}
			for i, path := range []string{"/login", "/login/", "/LOGIN/x"} {
				if r := cs.Get(path, "X-API-Key", "login"+strconv.Itoa(i)); r.Status != login {
					t.Fatalf("login %d (%s): %d %q, want %d", i+1, path, r.Status, r.Body, login)
				}
			}
			for _, path := range []string{"/login", "/login/", "/login/x", "/Login", "/login%2F"} {
				r := cs.Get(path, "X-API-Key", "login-4"+path)
				if r.Status != 429 || !strings.Contains(r.Body, `"zone":"login"`) {
					t.Fatalf("4th login (%s): %d %q, want 429 from zone login", path, r.Status, r.Body)
				}
			}
			// What docs/caddyfile.md warns of: a form the match does not list is not the login zone's.
			if r := cs.Get("/login;jsessionid=1", "X-API-Key", "login-5"); r.Status != login {
				t.Fatalf("/login;jsessionid=1: %d %q; docs/caddyfile.md says path /login /login/* does not match it", r.Status, r.Body)
			}

			// A new API key per request: each has a full api bucket, but the ip zone (a burst
			// of ex.ipBurst, then ex.ipRefillAs) stops them. 4 requests of the IP are spent above.
			start := time.Now()
			admitted := 0
			for ; admitted <= 10*ex.ipBurst; admitted++ {
				r := cs.Get("/", "X-API-Key", "rotated-"+strconv.Itoa(admitted))
				if r.Status == 429 {
					if !strings.Contains(r.Body, `"zone":"ip"`) {
						t.Fatalf("rotated key %d: %q, want a 429 from zone ip", admitted, r.Body)
					}
					break
				}
				if r.Status != 200 {
					t.Fatalf("rotated key %d: %d %q", admitted, r.Status, r.Body)
				}
			}
			refilled := int(time.Since(start).Seconds()*ex.ipPerSec) + 1
			if want := ex.ipBurst - 4; admitted < want || admitted > want+refilled {
				t.Fatalf("%d rotated keys admitted, want %d (%d less the 4 above) plus at most %d refilled", admitted, want, ex.ipBurst, refilled)
			}
		})
	}
}

// TestComposeCaddyfileServesMetrics runs deploy/Caddyfile (its ports moved to free loopback
// ports, the admin API off) against a real Redis: the site answers through rate_limit_redis,
// and the metrics listener that Prometheus scrapes serves the module's metrics.
func TestComposeCaddyfileServesMetrics(t *testing.T) {
	srv := redistest.Start(t)
	src, err := os.ReadFile(composeCaddyfile)
	if err != nil {
		t.Fatal(err)
	}
	site, metricsPort := freeport.Must(t), freeport.Must(t)
	caddyfile := string(src)
	for _, r := range [][2]string{
		{"\tadmin localhost:2019\n", "\tadmin off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n"},
		{"\n:8080 {\n", fmt.Sprintf("\n:%d {\n\tbind 127.0.0.1\n", site)},
		{"\n:2020 {\n", fmt.Sprintf("\n:%d {\n\tbind 127.0.0.1\n", metricsPort)},
	} {
		if !strings.Contains(caddyfile, r[0]) {
			t.Fatalf("%s has no %q", composeCaddyfile, r[0])
		}
		caddyfile = strings.Replace(caddyfile, r[0], r[1], 1)
	}
	t.Setenv("REDIS_ADDR", srv.Addr)
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := caddytest.LoadCaddyfile(t, caddyfile); err != nil {
		t.Fatal(err)
	}

	get := func(url string) (int, string) {
		t.Helper()
		resp, err := caddytest.Client(5 * time.Second).Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, string(b)
	}
	if code, body := get(fmt.Sprintf("http://127.0.0.1:%d/", site)); code != 200 || body != "hello 2=127.0.0.1: 4 of 5 left in zone api\n" {
		t.Fatalf("GET / = %d %q", code, body)
	}
	code, body := get(fmt.Sprintf("http://127.0.0.1:%d/metrics", metricsPort))
	if code != 200 {
		t.Fatalf("GET /metrics = %d", code)
	}
	// The collectors without labels are always exported (the labelled ones once they have a
	// series); their values are the process's, shared with other tests, so only names are checked.
	for _, prefix := range []string{
		`caddy_rate_limit_redis_redis_duration_seconds_bucket{le="0.0001"} `,
		"caddy_rate_limit_redis_redis_duration_seconds_sum ",
		"caddy_rate_limit_redis_redis_duration_seconds_count ",
		"caddy_rate_limit_redis_deny_cache_hits_total ",
	} {
		if !strings.Contains(body, "\n"+prefix) {
			t.Errorf("/metrics has no line starting %q:\n%s", prefix, body)
		}
	}
}
