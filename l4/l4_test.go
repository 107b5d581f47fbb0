package l4_test

// The caddy-l4 handler run in this process, configured by a Caddyfile as a user would, against a
// real redis-server: connections through caddy-l4 to its echo handler, which answers every
// admitted connection's line; a refused connection is closed without a byte.

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
	_ "github.com/mholt/caddy-l4/modules/l4echo"
	_ "github.com/mholt/caddy-l4/modules/l4proxy"
	_ "github.com/mholt/caddy-l4/modules/l4proxyprotocol"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	_ "github.com/rate-limit-redis/caddy-rate-limit-redis/l4"
)

// load runs Caddy with a layer4 server per route body (on its own free loopback port; the ports
// are returned) and the HTTP site bodies sites (on their own ports, returned after them), and
// stops it when the test ends.
func load(t testing.TB, routes []string, sites ...string) []int {
	t.Helper()
	var b strings.Builder
	var ports []int
	b.WriteString("{\n\tadmin off\n\tauto_https off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n\tlayer4 {\n")
	for _, r := range routes {
		p := freeport.Must(t)
		ports = append(ports, p)
		fmt.Fprintf(&b, "\t\t127.0.0.1:%d {\n\t\t\troute {\n%s\n\t\t\t}\n\t\t}\n", p, r)
	}
	b.WriteString("\t}\n}\n")
	for _, s := range sites {
		p := freeport.Must(t)
		ports = append(ports, p)
		fmt.Fprintf(&b, ":%d {\n\tbind 127.0.0.1\n%s\n}\n", p, s)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := caddytest.LoadCaddyfile(t, b.String()); err != nil {
		t.Fatalf("loading:\n%s\n%v", b.String(), err)
	}
	return ports
}

// dial is caddytest.DialEcho.
var dial = caddytest.DialEcho

// route is a layer4 route body: rate_limit_redis against addr with the zone block zone, then
// echo.
func route(addr, options, zone string) string {
	return fmt.Sprintf("\t\t\t\trate_limit_redis {\n\t\t\t\t\tredis {\n\t\t\t\t\t\taddress %s\n\t\t\t\t\t}\n%s\n\t\t\t\t\t%s\n\t\t\t\t}\n\t\t\t\techo", addr, options, zone)
}

// TestConcurrentConnections: two layer4 servers (two handlers, as two instances would be) with
// one concurrency zone of limit 5 per client IP: of 8 connections open at once, exactly 5 reach
// echo and 3 are closed unanswered; when 2 of the 5 close, 2 new ones are admitted and a third is
// not.
func TestConcurrentConnections(t *testing.T) {
	srv := redistest.Start(t)
	zone := "zone ssh {\n\t\t\t\t\t\talgorithm concurrency\n\t\t\t\t\t\tlimit 5\n\t\t\t\t\t}"
	ports := load(t, []string{route(srv.Addr, "", zone), route(srv.Addr, "", zone)})

	var open []net.Conn
	refused := 0
	for i := range 8 {
		if c, ok := dial(t, ports[i%2], ""); ok {
			open = append(open, c)
		} else {
			refused++
		}
	}
	if len(open) != 5 || refused != 3 {
		t.Fatalf("8 connections against a concurrency limit of 5: %d admitted, %d refused; want 5 and 3", len(open), refused)
	}
	_ = open[0].Close()
	_ = open[1].Close()
	// Their slots come back when echo sees the close: dial until one is admitted, twice.
	for n := range 2 {
		redistest.WaitFor(t, 5*time.Second, fmt.Sprintf("connection %d after 2 closed: not admitted", n+1), func() bool {
			_, ok := dial(t, ports[n%2], "")
			return ok
		})
	}
	if _, ok := dial(t, ports[0], ""); ok {
		t.Fatal("a sixth connection open at once was admitted")
	}
}

// TestNewConnectionsExact: a token bucket of 20 new connections per client IP (refilled once an
// hour), 50 dialled in parallel over two servers: exactly 20 reach echo.
func TestNewConnectionsExact(t *testing.T) {
	srv := redistest.Start(t)
	zone := "zone new {\n\t\t\t\t\t\tcapacity 20\n\t\t\t\t\t\trefill_rate 1/1h\n\t\t\t\t\t}"
	ports := load(t, []string{route(srv.Addr, "\t\t\t\t\ttimeout 2s", zone), route(srv.Addr, "\t\t\t\t\ttimeout 2s", zone)})
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Go(func() {
			if _, ok := dial(t, ports[i%2], ""); ok {
				admitted.Add(1)
			}
		})
	}
	wg.Wait()
	if admitted.Load() != 20 {
		t.Fatalf("50 parallel connections against a bucket of 20: %d admitted", admitted.Load())
	}
}

// TestSharedConnectionAndRequestZone: a zone of the same name, numbers and key in a layer4 route
// and in an HTTP route is one limit: 6 connections and 6 requests from one address against a
// window of 10 admit 10 in all.
func TestSharedConnectionAndRequestZone(t *testing.T) {
	srv := redistest.Start(t)
	zone := "zone attempts {\n\t\t\t\t\t\talgorithm sliding_window\n\t\t\t\t\t\tlimit 10\n\t\t\t\t\t\twindow 1m\n\t\t\t\t\t}"
	site := fmt.Sprintf("\trate_limit_redis {\n\t\tredis {\n\t\t\taddress %s\n\t\t}\n\t\t%s\n\t}\n\trespond \"ok\"", srv.Addr, zone)
	ports := load(t, []string{route(srv.Addr, "", zone)}, site)
	web := &caddytest.Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(ports[1])}
	admitted := 0
	for range 6 {
		if _, ok := dial(t, ports[0], ""); ok {
			admitted++
		}
		if web.Get("/").Status == 200 {
			admitted++
		}
	}
	if admitted != 10 {
		t.Fatalf("6 connections and 6 requests against one limit of 10: %d admitted", admitted)
	}
}

// TestConnectionFailMode: with nothing listening at the Redis address, fail_mode closed closes
// the connection within timeout + 1s, unanswered; open passes it to echo.
func TestConnectionFailMode(t *testing.T) {
	dead := fmt.Sprintf("127.0.0.1:%d", freeport.Must(t))
	zone := "zone new {\n\t\t\t\t\t\tcapacity 20\n\t\t\t\t\t\trefill_rate 1\n\t\t\t\t\t}"
	ports := load(t, []string{
		route(dead, "\t\t\t\t\tfail_mode closed\n\t\t\t\t\ttimeout 200ms", zone),
		route(dead, "\t\t\t\t\tfail_mode open\n\t\t\t\t\ttimeout 200ms", zone),
	})
	start := time.Now()
	if _, ok := dial(t, ports[0], ""); ok {
		t.Fatal("fail_mode closed admitted a connection while Redis is down")
	}
	if took := time.Since(start); took > 1200*time.Millisecond {
		t.Fatalf("fail_mode closed took %v to close the connection, want under timeout + 1s", took)
	}
	if _, ok := dial(t, ports[1], ""); !ok {
		t.Fatal("fail_mode open refused a connection while Redis is down")
	}
}

// TestProxyProtocolKey: behind caddy-l4's proxy_protocol handler the key is the PROXY header's
// client: 3 connections claiming 192.0.2.7 against a bucket of 2 admit 2, and one claiming
// 198.51.100.9 is admitted; Redis holds the state under the claimed address.
func TestProxyProtocolKey(t *testing.T) {
	srv := redistest.Start(t)
	zone := "zone new {\n\t\t\t\t\t\tcapacity 2\n\t\t\t\t\t\trefill_rate 1/1h\n\t\t\t\t\t}"
	ports := load(t, []string{"\t\t\t\tproxy_protocol {\n\t\t\t\t\tallow 127.0.0.1/32\n\t\t\t\t}\n" + route(srv.Addr, "", zone)})
	header := func(ip string) string { return "PROXY TCP4 " + ip + " 192.0.2.1 50000 22\r\n" }
	admitted := 0
	for range 3 {
		if _, ok := dial(t, ports[0], header("192.0.2.7")); ok {
			admitted++
		}
	}
	if admitted != 2 {
		t.Fatalf("3 connections from 192.0.2.7 against a bucket of 2: %d admitted", admitted)
	}
	if _, ok := dial(t, ports[0], header("198.51.100.9")); !ok {
		t.Fatal("a connection from another client behind the proxy was refused")
	}
	if n, _ := srv.Do("EXISTS", "rl:{192.0.2.7}:new:tb").(int64); n != 1 {
		keys, _ := srv.Do("KEYS", "*").([]any)
		t.Fatalf("no state under the PROXY header's client; Redis has %v", keys)
	}
}

// TestHTTPOnlyOptionsRefused: an option only HTTP requests have fails the load, naming it.
func TestHTTPOnlyOptionsRefused(t *testing.T) {
	srv := redistest.Start(t)
	for _, c := range []struct{ options, zone, want string }{
		{"\t\t\t\t\theaders ietf", "zone z {\n\t\t\t\t\t\tcapacity 2\n\t\t\t\t\t\trefill_rate 1\n\t\t\t\t\t}", "headers: only HTTP requests have these"},
		{"", "zone z {\n\t\t\t\t\t\tcapacity 2\n\t\t\t\t\t\trefill_rate 1\n\t\t\t\t\t\tcount_status 401\n\t\t\t\t\t}", "zone z: count_status: only HTTP requests have these"},
		{"", "zone z {\n\t\t\t\t\t\tkey {http.request.header.X-Api-Key}\n\t\t\t\t\t\tcapacity 2\n\t\t\t\t\t\trefill_rate 1\n\t\t\t\t\t}", "zone z: key {http.request.header.X-Api-Key}: only HTTP requests have these"},
		{"", "zone z {\n\t\t\t\t\t\talgorithm adaptive_concurrency\n\t\t\t\t\t\tlimit 5\n\t\t\t\t\t}", "zone z: algorithm adaptive_concurrency (it learns from the latency of responses): only HTTP requests have these"},
		{"", "zone z {\n\t\t\t\t\t\talgorithm concurrency\n\t\t\t\t\t\tlimit 2\n\t\t\t\t\t\tmax_wait 1s\n\t\t\t\t\t\tfair_by {http.request.header.X-Tenant}\n\t\t\t\t\t}", "zone z: fair_by {http.request.header.X-Tenant}: only HTTP requests have these"},
	} {
		var b strings.Builder
		fmt.Fprintf(&b, "{\n\tadmin off\n\tpersist_config off\n\tlayer4 {\n\t\t127.0.0.1:%d {\n\t\t\troute {\n%s\n\t\t\t}\n\t\t}\n\t}\n}\n",
			freeport.Must(t), route(srv.Addr, c.options, c.zone))
		t.Cleanup(func() { _ = caddy.Stop() })
		err := caddytest.LoadCaddyfile(t, b.String())
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Fatalf("loading %s: %v, want an error with %q", c.options+c.zone, err, c.want)
		}
	}
}
