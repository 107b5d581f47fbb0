// Package e2e_test runs Caddy with the module in this process, configured only as a user would
// (a Caddyfile or JSON), against real redis-server processes (internal/redistest): limits,
// costs and keys through real HTTP, Redis failures and reloads under load, a Redis Cluster, the
// shipped examples, and the scripts of `make run` and `make smoke`. The tests run from the
// repository's root (TestMain).
package e2e_test

import (
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/rate-limit-redis/caddy-rate-limit-redis"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestMain runs the tests from the repository's root, where the files some of them read are.
func TestMain(m *testing.M) {
	if err := os.Chdir(".."); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// caddyServer runs Caddy in this process with the given site block (a Caddyfile body served on
// a free loopback port), and stops it when the test ends. Caddy holds one config per process,
// so these tests do not run in parallel.
type caddyServer struct {
	t    *testing.T
	base string // http://127.0.0.1:port
}

// freeLoopbackPort returns a loopback TCP port that was free a moment ago, never one it (or
// redistest) returned before in this process: the sites of one test get distinct ports.
func freeLoopbackPort(t *testing.T) int {
	t.Helper()
	return freeport.Must(t)
}

// startCaddy runs Caddy in this process with one site (startSites).
func startCaddy(t *testing.T, site string) *caddyServer {
	t.Helper()
	return startSites(t, "", site)[0]
}

// load adapts the Caddyfile and loads it with loadServing, as `caddy run` or `caddy reload`
// would; the error is the adapter's, the loader's or the wait's.
func (cs *caddyServer) load(site string, port int) error {
	return loadCaddyfile(cs.t, caddytest.Caddyfile("off", "", []int{port}, []string{site}))
}

// loadCaddyfile adapts a whole Caddyfile and loads it (caddytest.LoadCaddyfile).
func loadCaddyfile(t testing.TB, caddyfile string) error {
	t.Helper()
	return caddytest.LoadCaddyfile(t, caddyfile)
}

// servingClient returns a client for the config Caddy serves now (caddytest.Client).
func servingClient(timeout time.Duration) *http.Client { return caddytest.Client(timeout) }

// startSites runs Caddy in this process with the given `servers` global options and one site
// per body, each on its own free loopback port, and stops it when the test ends
// (caddytest.StartSites).
func startSites(t *testing.T, serverOptions string, sites ...string) []*caddyServer {
	t.Helper()
	var servers []*caddyServer
	for _, base := range caddytest.StartSites(t, serverOptions, sites...) {
		servers = append(servers, &caddyServer{t: t, base: base})
	}
	return servers
}

type response struct {
	status int
	header http.Header
	body   string
}

func (cs *caddyServer) get(path string, header ...string) response {
	cs.t.Helper()
	return cs.do(http.MethodGet, path, header...)
}

// expect checks status, body and the named headers exactly (an empty value means absent).
func (r response) expect(t *testing.T, step string, status int, body string, headers ...string) {
	t.Helper()
	caddytest.Expect(t, step, r.status, r.header, r.body, status, body, headers...)
}

// do sends a request with the given method and header name/value pairs.
func (cs *caddyServer) do(method, path string, header ...string) response {
	cs.t.Helper()
	status, h, body, err := caddytest.Do(method, cs.base+path, header...)
	if err != nil {
		cs.t.Fatalf("%s %s: %v", method, path, err)
	}
	return response{status: status, header: h, body: body}
}

// reload loads site into the running Caddy of cs, on the same port, and returns once it serves
// alone (cs.load).
func (cs *caddyServer) reload(site string) {
	cs.t.Helper()
	port, err := strconv.Atoi(strings.TrimPrefix(cs.base, "http://127.0.0.1:"))
	if err != nil {
		cs.t.Fatal(err)
	}
	if err := cs.load(site, port); err != nil {
		cs.t.Fatalf("reload: %v", err)
	}
}

// statuses sends n requests and returns their status codes, space separated.
func (cs *caddyServer) statuses(n int, path string, header ...string) string {
	codes := make([]string, n)
	for i := range codes {
		codes[i] = strconv.Itoa(cs.get(path, header...).status)
	}
	return strings.Join(codes, " ")
}

// loadClient sends requests to a caddyServer from any goroutine: unlike caddyServer.get it
// returns transport errors instead of failing the test. Each request goes on the transport of
// the config serving when it starts (servingClient); its 5s timeout turns a hung request into
// an error.
type loadClient struct {
	base string
}

func newLoadClient(t *testing.T, cs *caddyServer) *loadClient {
	return &loadClient{base: cs.base}
}

func (lc *loadClient) get(path string, header ...string) (response, error) {
	status, h, body, err := caddytest.Do(http.MethodGet, lc.base+path, header...)
	return response{status: status, header: h, body: body}, err
}

// waitFor is redistest.WaitFor.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	redistest.WaitFor(t, d, what, cond)
}

// redisKeys returns every key of srv.
func redisKeys(t *testing.T, srv *redistest.Server) []string {
	t.Helper()
	keys, err := srv.Client().Keys(t.Context(), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	return keys
}
