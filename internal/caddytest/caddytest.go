// Package caddytest runs Caddy in the test's process, as `caddy run` and `caddy reload` would,
// for the tests of the module's packages: it loads a config (JSON, a Caddyfile, or site blocks
// on loopback ports) and returns once that config alone serves, and gives a client that talks to
// it, and the sites it serves (Site) with their requests. Caddy holds one config per process, so
// the tests that use it do not run in parallel.
package caddytest

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile" // the caddyfile adapter
)

// Caddyfile returns a Caddyfile of the global options the tests run with (the admin endpoint at
// admin, or "off"; no automatic HTTPS, no persisted config, logs at ERROR), the `servers` options
// serverOptions (none when empty), and, for each site body, a site at 127.0.0.1 on ports[i].
func Caddyfile(admin, serverOptions string, ports []int, sites []string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "{\n\tadmin %s\n\tauto_https off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n", admin)
	if serverOptions != "" {
		fmt.Fprintf(&b, "\tservers {\n%s\n\t}\n", serverOptions)
	}
	b.WriteString("}\n")
	for i, site := range sites {
		fmt.Fprintf(&b, ":%d {\n\tbind 127.0.0.1\n%s\n}\n", ports[i], site)
	}
	return b.String()
}

// LoadCaddyfile adapts a whole Caddyfile, logs the adapter's warnings, and loads the result
// with LoadServing.
func LoadCaddyfile(t testing.TB, caddyfile string) error {
	t.Helper()
	cfg, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	if err != nil {
		return fmt.Errorf("adapting: %w", err)
	}
	for _, w := range warnings {
		t.Logf("adapter warning: %s", w.String())
	}
	return LoadServing(t, cfg)
}

// Config generations. caddy.Load returns once the previous config's servers have *started* to
// shut down (caddyhttp's App.Stop). Until an old server has closed its listening socket, the
// kernel hands it some of the new connections (Caddy listens with SO_REUSEPORT, one socket per
// config), and it keeps serving the keep-alive connections it accepted: a request sent right
// after a reload can be answered by the previous config, or reset. So every config the tests
// run is loaded by LoadServing, which waits until the new config alone serves, and every config
// has an HTTP transport of its own (its generation's), whose connections no earlier config
// accepted. Requests to Caddy go through Client.
const (
	// generationPath is the path of the route LoadServing puts first in every HTTP server it
	// loads: a 204 whose generationHeader is the config's generation. It is answered before
	// any handler of the config runs, so no zone counts it, and no access log has it.
	generationPath   = "/__generation"
	generationHeader = "X-Test-Generation"
	// servingTimeout bounds LoadServing's wait for a config to serve alone.
	servingTimeout = 20 * time.Second
)

// generation is a config loaded by LoadServing.
type generation struct {
	n         uint64
	transport *http.Transport
}

var (
	generations atomic.Uint64              // the last generation number given
	serving     atomic.Pointer[generation] // the config Caddy serves alone now
)

// Client returns a client for the config Caddy serves now, on that config's transport. timeout
// is the client's (0: none). Call it for each request, or after each load: a reload closes the
// previous transport's idle connections.
func Client(timeout time.Duration) *http.Client {
	g := serving.Load()
	if g == nil {
		panic("caddytest.Client: no config was loaded with LoadServing")
	}
	return &http.Client{Transport: g.transport, Timeout: timeout}
}

// LoadServing loads the JSON config cfg (adapted from a Caddyfile, or written) with a
// generation route (generationPath) first in each of its HTTP servers, and returns once, on
// each server's listen addresses, no listening socket of an earlier config is left and the
// route answers with the new generation on the new generation's transport; and once no earlier
// config's socket is left on the admin endpoint's address, if any. Then it makes that
// generation the one Client uses and closes the previous one's idle connections. The error is
// the loader's (the previous config then goes on serving) or the wait's. It skips the test under
// `go test -short`.
func LoadServing(t testing.TB, cfg []byte) error {
	t.Helper()
	if testing.Short() {
		t.Skip("runs Caddy: skipped with -short")
	}
	g := &generation{n: generations.Add(1), transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	t.Cleanup(g.transport.CloseIdleConnections)
	cfg, servers, admin, err := withGenerationRoute(cfg, g.n)
	if err != nil {
		return err
	}
	if err := caddy.Load(cfg, true); err != nil {
		return err
	}
	defer func() {
		if old := serving.Swap(g); old != nil {
			old.transport.CloseIdleConnections()
		}
	}()
	client := &http.Client{Transport: g.transport, Timeout: 5 * time.Second}
	want := strconv.FormatUint(g.n, 10)
	var waits []func() string // each returns what it saw, or "" once its address is served alone
	for i, a := range append(servers, admin...) {
		na, err := caddy.ParseNetworkAddress(a)
		if err != nil {
			return fmt.Errorf("listen address %q: %w", a, err)
		}
		isServer := i < len(servers)
		for off := range na.PortRangeSize() {
			key := na.JoinHostPort(off)
			host := na.Host
			if host == "" {
				host = "127.0.0.1"
			}
			port := na.StartPort + off
			url := "http://" + net.JoinHostPort(host, strconv.FormatUint(uint64(port), 10)) + generationPath
			waits = append(waits, func() string {
				if n := caddy.ListenerUsage(na.Network, key); n > 1 {
					return fmt.Sprintf("Caddy has %d listeners on %s", n, key)
				}
				if n, ok := listeningSockets(port); ok && n > 1 {
					return fmt.Sprintf("the kernel has %d sockets listening on port %d", n, port)
				}
				if !isServer {
					return ""
				}
				resp, err := client.Get(url)
				if err != nil {
					return err.Error()
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if got := resp.Header.Get(generationHeader); got != want {
					return fmt.Sprintf("GET %s: %d from generation %q", url, resp.StatusCode, got)
				}
				return ""
			})
		}
	}
	deadline := time.Now().Add(servingTimeout)
	for _, wait := range waits {
		for seen := wait(); seen != ""; seen = wait() {
			if time.Now().After(deadline) {
				return fmt.Errorf("config generation %s not serving alone after %v: %s", want, servingTimeout, seen)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return nil
}

// listeningSockets returns how many TCP sockets listen on port as the kernel lists them
// (Linux's /proc/net/tcp and tcp6), and false where there are no such lists. Caddy counts a
// listener gone (caddy.ListenerUsage) just before closing it, and Go's Close closes the socket
// only once the server's Accept has returned: until then the kernel still hands the old socket
// new connections, which are then reset.
func listeningSockets(port uint) (int, bool) {
	n, listed := 0, false
	for _, name := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(name)
		if err != nil {
			continue
		}
		listed = true
		for _, line := range strings.Split(string(b), "\n") {
			// sl local_address rem_address st ...: the address is hex, then :port in hex;
			// state 0A is LISTEN.
			f := strings.Fields(line)
			if len(f) < 4 || f[3] != "0A" {
				continue
			}
			_, hexPort, _ := strings.Cut(f[1], ":")
			if p, err := strconv.ParseUint(hexPort, 16, 16); err == nil && uint(p) == port {
				n++
			}
		}
	}
	return n, listed
}

// withGenerationRoute returns cfg with the generation route of generation n first in each HTTP
// server, the servers' listen addresses, and the admin endpoint's address if one is set.
func withGenerationRoute(cfg []byte, n uint64) (out []byte, listen, admin []string, err error) {
	var c map[string]any
	if err := json.Unmarshal(cfg, &c); err != nil {
		return nil, nil, nil, fmt.Errorf("config: %w", err)
	}
	if a, _ := c["admin"].(map[string]any); a != nil && a["disabled"] != true {
		if l, _ := a["listen"].(string); l != "" {
			admin = append(admin, l)
		}
	}
	apps, _ := c["apps"].(map[string]any)
	httpApp, _ := apps["http"].(map[string]any)
	servers, _ := httpApp["servers"].(map[string]any)
	route := map[string]any{
		"match": []any{map[string]any{"path": []string{generationPath}}},
		"handle": []any{
			map[string]any{"handler": "vars", "log_skip": true},
			map[string]any{"handler": "static_response", "status_code": http.StatusNoContent,
				"headers": map[string][]string{generationHeader: {strconv.FormatUint(n, 10)}}},
		},
		"terminal": true,
	}
	for name, s := range servers {
		srv, _ := s.(map[string]any)
		if srv == nil {
			return nil, nil, nil, fmt.Errorf("server %s: %v is not an object", name, s)
		}
		routes, _ := srv["routes"].([]any)
		srv["routes"] = append([]any{route}, routes...)
		addrs, _ := srv["listen"].([]any)
		for _, a := range addrs {
			l, ok := a.(string)
			if !ok {
				return nil, nil, nil, fmt.Errorf("server %s: listen address %v is not a string", name, a)
			}
			listen = append(listen, l)
		}
	}
	out, err = json.Marshal(c)
	return out, listen, admin, err
}
