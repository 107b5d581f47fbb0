package caddytest

import (
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
)

// Site is a site that Caddy serves in this process on a loopback port, and the test that
// started it (T, which its requests fail). Caddy holds one config per process, so the tests
// that use sites do not run in parallel.
type Site struct {
	T    *testing.T
	Base string // http://127.0.0.1:port
}

// Start runs Caddy in this process with one site (StartSites).
func Start(t *testing.T, site string) *Site {
	t.Helper()
	return StartSites(t, "", site)[0]
}

// StartSites runs Caddy with the `servers` global options serverOptions (none when empty) and
// one site per body, each at 127.0.0.1 on a free port of its own, stops it when the test ends,
// and returns the sites. It fails t when the config does not load and serve.
func StartSites(t *testing.T, serverOptions string, sites ...string) []*Site {
	t.Helper()
	ports := make([]int, len(sites))
	out := make([]*Site, len(sites))
	for i := range sites {
		ports[i] = freeport.Must(t)
		out[i] = &Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(ports[i])}
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := LoadCaddyfile(t, Caddyfile("off", serverOptions, ports, sites)); err != nil {
		t.Fatalf("loading: %v", err)
	}
	return out
}

// Load adapts a Caddyfile of the one site body site on port and loads it with LoadServing, as
// `caddy run` or `caddy reload` would; the error is the adapter's, the loader's or the wait's.
func (s *Site) Load(site string, port int) error {
	return LoadCaddyfile(s.T, Caddyfile("off", "", []int{port}, []string{site}))
}

// Reload loads site into the running Caddy, on s's port, and returns once it serves alone
// (Load); it fails s.T when the config does not load.
func (s *Site) Reload(site string) {
	s.T.Helper()
	port, err := strconv.Atoi(strings.TrimPrefix(s.Base, "http://127.0.0.1:"))
	if err != nil {
		s.T.Fatal(err)
	}
	if err := s.Load(site, port); err != nil {
		s.T.Fatalf("reload: %v", err)
	}
}

// Response is a response of a site: its status, header and body.
type Response struct {
	Status int
	Header http.Header
	Body   string
}

// Get sends a GET of path with the header name/value pairs given (Do).
func (s *Site) Get(path string, header ...string) Response {
	s.T.Helper()
	return s.Do(http.MethodGet, path, header...)
}

// Do sends a request of method to path with the header name/value pairs given, through Client
// with a 30s timeout (requestTimeout); it fails s.T when the request or the body's read fails.
func (s *Site) Do(method, path string, header ...string) Response {
	s.T.Helper()
	r, err := fetch(method, s.Base+path, header...)
	if err != nil {
		s.T.Fatalf("%s %s: %v", method, path, err)
	}
	return r
}

// Statuses sends n GETs of path (Get) and returns their status codes, space separated.
func (s *Site) Statuses(n int, path string, header ...string) string {
	codes := make([]string, n)
	for i := range codes {
		codes[i] = strconv.Itoa(s.Get(path, header...).Status)
	}
	return strings.Join(codes, " ")
}

// Expect fails t unless r has status, body and the header fields named in headers (name/value
// pairs) exactly; an empty value means absent. step names the request in the failure.
func (r Response) Expect(t testing.TB, step string, status int, body string, headers ...string) {
	t.Helper()
	if r.Status != status || r.Body != body {
		t.Fatalf("%s: got %d %q, want %d %q", step, r.Status, r.Body, status, body)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		if got := r.Header.Get(headers[i]); got != headers[i+1] {
			t.Fatalf("%s: header %s = %q, want %q (all: %v)", step, headers[i], got, headers[i+1], r.Header)
		}
	}
}

// LoadClient sends requests to a Site from any goroutine: unlike Site.Get it returns transport
// errors instead of failing the test. Each request goes on the transport of the config serving
// when it starts (Client); its 30s timeout (requestTimeout) turns a hung request into an error.
type LoadClient struct {
	Base string
}

// NewLoadClient returns a LoadClient of s.
func NewLoadClient(s *Site) *LoadClient {
	return &LoadClient{Base: s.Base}
}

// Get sends a GET of path with the header name/value pairs given.
func (lc *LoadClient) Get(path string, header ...string) (Response, error) {
	return fetch(http.MethodGet, lc.Base+path, header...)
}

// requestTimeout bounds a request of a Site or LoadClient: long enough for a loaded machine,
// short enough that a hung request fails its test rather than the package's timeout.
const requestTimeout = 30 * time.Second

// fetch sends a request of method to url with the header name/value pairs given, through
// Client with requestTimeout. The error is the request's, or the body's read ("reading the
// body: ...").
func fetch(method, url string, header ...string) (Response, error) {
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		return Response{}, err
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := Client(requestTimeout).Do(req)
	if err != nil {
		return Response{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return Response{}, fmt.Errorf("reading the body: %w", err)
	}
	return Response{Status: resp.StatusCode, Header: resp.Header, Body: string(b)}, nil
}

// Instances is a site of three routes /i1/, /i2/, /i3/, each with its own rate_limit_redis
// handler (its own Limiter and deny cache, as three Caddy instances have) with the same zone
// lines, on the Redis at redisAddr, in front of upstream. Its decisions wait for Redis up to 5 s
// (timeout): the tests count what each admitted, which a decision failed open would falsify.
func Instances(redisAddr, zone, upstream string) string {
	var b strings.Builder
	for i := 1; i <= 3; i++ {
		fmt.Fprintf(&b, `
	route /i%d/* {
		rate_limit_redis {
			redis {
				address %s
			}
			timeout 5s
			%s
		}
		reverse_proxy %s
	}`, i, redisAddr, zone, upstream)
	}
	return b.String()
}
