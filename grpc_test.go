package ratelimitredis

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"
	grpcstatus "google.golang.org/grpc/status"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// grpcUpstream is a gRPC server on a free loopback port serving the standard health service,
// which records when each call reached it.
type grpcUpstream struct {
	addr     string
	mu       sync.Mutex
	arrivals []time.Time
}

func startGRPCUpstream(t *testing.T) *grpcUpstream {
	t.Helper()
	up := new(grpcUpstream)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	up.addr = ln.Addr().String()
	srv := grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		up.mu.Lock()
		up.arrivals = append(up.arrivals, time.Now())
		up.mu.Unlock()
		return handler(ctx, req)
	}))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	return up
}

// calls returns the arrival times of the calls the upstream has had.
func (up *grpcUpstream) calls() []time.Time {
	up.mu.Lock()
	defer up.mu.Unlock()
	return append([]time.Time(nil), up.arrivals...)
}

// startGRPCSite runs Caddy in this process serving cleartext HTTP/1.1 and HTTP/2 (h2c, which
// gRPC clients speak without TLS) on a free loopback port: the rate_limit_redis block limit,
// then extra, then reverse_proxy over h2c to upstream. It returns the site's host:port.
func startGRPCSite(t *testing.T, limit, extra string, upstream *grpcUpstream) string {
	t.Helper()
	port := freeport.Must(t)
	t.Cleanup(func() { _ = caddy.Stop() })
	caddyfile := fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
	servers {
		protocols h1 h2c
	}
	log {
		level ERROR
	}
}
:%d {
	bind 127.0.0.1
	%s
	reverse_proxy h2c://%s
}
`, port, strings.TrimSpace(limit+"\n\t"+extra), upstream.addr)
	if err := caddytest.LoadCaddyfile(t, caddyfile); err != nil {
		t.Fatal(err)
	}
	return "127.0.0.1:" + strconv.Itoa(port)
}

// grpcAttempts is a client stats handler: it records each attempt of a call as the client saw
// it (an attempt's headers sent, a Trailers-Only response's metadata received).
type grpcAttempts struct {
	mu       sync.Mutex
	sent     int
	trailers []seenTrailer
}

type seenTrailer struct {
	at time.Time
	md metadata.MD
}

func (a *grpcAttempts) HandleRPC(_ context.Context, s stats.RPCStats) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch s := s.(type) {
	case *stats.OutHeader:
		a.sent++
	case *stats.InTrailer:
		a.trailers = append(a.trailers, seenTrailer{time.Now(), s.Trailer})
	}
}

func (a *grpcAttempts) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

func (a *grpcAttempts) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}

func (a *grpcAttempts) HandleConn(context.Context, stats.ConnStats) {}

// retryOnResourceExhausted is a service config whose retry policy retries the health service's
// calls on RESOURCE_EXHAUSTED, up to 3 attempts, after 10ms unless the server pushes back.
const retryOnResourceExhausted = `{"methodConfig": [{
	"name": [{"service": "grpc.health.v1.Health"}],
	"retryPolicy": {
		"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.01s", "backoffMultiplier": 1,
		"retryableStatusCodes": ["RESOURCE_EXHAUSTED"]
	}
}]}`

// healthClient dials addr over h2c (grpc-go's cleartext HTTP/2) with the stats handler a, and
// with the retry policy serviceConfig when it is not "" (grpc-go retries nothing without one).
func healthClient(t *testing.T, addr string, a *grpcAttempts, serviceConfig string) healthpb.HealthClient {
	t.Helper()
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithStatsHandler(a)}
	if serviceConfig != "" {
		opts = append(opts, grpc.WithDefaultServiceConfig(serviceConfig))
	}
	conn, err := grpc.NewClient("passthrough:///"+addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return healthpb.NewHealthClient(conn)
}

// healthCheck makes one health Check call as client key (with the other metadata md), and
// returns its status and the metadata of the response's trailers (a Trailers-Only response's
// headers).
func healthCheck(t *testing.T, c healthpb.HealthClient, key string, md ...string) (*grpcstatus.Status, metadata.MD) {
	t.Helper()
	ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(t.Context(), append([]string{"x-client", key}, md...)...), 20*time.Second)
	defer cancel()
	var trailer metadata.MD
	resp, err := c.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Trailer(&trailer))
	if err == nil && resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health status %v", resp.GetStatus())
	}
	return grpcstatus.Convert(err), trailer
}

// plainGet sends an HTTP/1.1 GET to addr as client key, with the other headers given.
func plainGet(t *testing.T, addr, key string, header ...string) caddytest.Response {
	t.Helper()
	cs := &caddytest.Site{T: t, Base: "http://" + addr}
	return cs.Get("/", append([]string{"X-Client", key}, header...)...)
}

// TestGRPCDenialIsResourceExhausted: a grpc-go client whose call is denied, through Caddy's
// reverse_proxy over h2c, sees codes.ResourceExhausted with a grpc-message naming the zone and
// the wait as grpc-retry-pushback-ms, rather than the UNAVAILABLE of a 429; handle_errors does
// not touch it, a header directive's placeholders do reach it, and the denial counts as one in
// decisions_total. A plain HTTP request of the same client to the same site still gets the 429
// of handle_errors, as does a request that claims gRPC's content-type over HTTP/1.1.
func TestGRPCDenialIsResourceExhausted(t *testing.T) {
	srv := redistest.Start(t)
	up := startGRPCUpstream(t)
	addr := startGRPCSite(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		zone grpc_api {
			key {http.request.header.X-Client}
			capacity 1
			refill_rate 1/1h
		}
	}`, srv.Addr), `header >X-Limited-Zone {http.rate_limit_redis.zone}
	handle_errors {
		respond "limited zone={http.rate_limit_redis.zone}" {err.status_code}
	}`, up)
	reg := activeRegistry(t)
	denied := func() float64 { return metricValue(t, reg, metricDecisions, "zone", "grpc_api", "result", "denied") }
	before := denied()
	c := healthClient(t, addr, new(grpcAttempts), "")

	if st, _ := healthCheck(t, c, "a"); st.Code() != codes.OK {
		t.Fatalf("first call: %v", st)
	}
	st, md := healthCheck(t, c, "a")
	if st.Code() != codes.ResourceExhausted || st.Message() != "zone grpc_api: rate limit exceeded" {
		t.Fatalf("denied call: %v, want ResourceExhausted naming the zone", st)
	}
	// Denied moments after the one token went: the exact wait of about an hour, in milliseconds.
	if p, err := strconv.ParseInt(first(md, "grpc-retry-pushback-ms"), 10, 64); err != nil || p <= 3500_000 || p > 3600_000 {
		t.Fatalf("grpc-retry-pushback-ms %q, want the wait of about an hour in ms", md["grpc-retry-pushback-ms"])
	}
	for k, want := range map[string]string{"retry-after": "3600", "x-ratelimit-remaining": "0", "x-limited-zone": "grpc_api"} {
		if got := first(md, k); got != want {
			t.Errorf("metadata %s = %q, want %q (all: %v)", k, got, want, md)
		}
	}
	if n := len(up.calls()); n != 1 {
		t.Fatalf("the upstream had %d calls, want 1: the denied call must not reach it", n)
	}
	if got := denied() - before; got != 1 {
		t.Fatalf("decisions_total{result=denied} rose by %v, want 1", got)
	}

	plainGet(t, addr, "a").Expect(t, "plain HTTP, same client", 429, "limited zone=grpc_api",
		"Retry-After", "3600", "Grpc-Status", "", "Content-Type", "text/plain; charset=utf-8")
	plainGet(t, addr, "a", "Content-Type", "application/grpc").Expect(t, "gRPC's content-type over HTTP/1.1", 429,
		"limited zone=grpc_api", "Grpc-Status", "")
	if got := denied() - before; got != 3 {
		t.Fatalf("decisions_total{result=denied} rose by %v, want 3", got)
	}
}

// first returns md's first value of key, or "".
func first(md metadata.MD, key string) string {
	if v := md.Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

// TestGRPCRetryHonoursPushback: a grpc-go client with a retry policy on RESOURCE_EXHAUSTED
// (10ms backoff) retries a denied call once, after the grpc-retry-pushback-ms the denial sent,
// not after its backoff: the retry reaches the upstream no sooner than the pushback after the
// client received it, and is admitted (the pushback is the zone's exact wait).
func TestGRPCRetryHonoursPushback(t *testing.T) {
	srv := redistest.Start(t)
	up := startGRPCUpstream(t)
	addr := startGRPCSite(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-Client}
		capacity 1
		refill_rate 1/2s
	}`, srv.Addr), "", up)
	attempts := new(grpcAttempts)
	c := healthClient(t, addr, attempts, retryOnResourceExhausted)

	if st, _ := healthCheck(t, c, "a"); st.Code() != codes.OK {
		t.Fatalf("first call: %v", st)
	}
	if st, _ := healthCheck(t, c, "a"); st.Code() != codes.OK {
		t.Fatalf("second call, retried after the pushback: %v", st)
	}
	attempts.mu.Lock()
	sent, trailers := attempts.sent, attempts.trailers
	attempts.mu.Unlock()
	var denied []seenTrailer
	for _, tr := range trailers {
		if len(tr.md.Get("grpc-retry-pushback-ms")) > 0 {
			denied = append(denied, tr)
		}
	}
	if sent != 3 || len(denied) != 1 {
		t.Fatalf("%d attempts, %d denied; want 3 attempts (the first call, the denied one, its retry), 1 denied", sent, len(denied))
	}
	pushback, err := strconv.ParseInt(first(denied[0].md, "grpc-retry-pushback-ms"), 10, 64)
	if err != nil || pushback < 1 || pushback > 2000 {
		t.Fatalf("grpc-retry-pushback-ms %v, want the wait for the next token, at most 2000", denied[0].md)
	}
	calls := up.calls()
	if len(calls) != 2 {
		t.Fatalf("the upstream had %d calls, want 2", len(calls))
	}
	const tolerance = 10 * time.Millisecond
	waited := calls[1].Sub(denied[0].at)
	if waited < time.Duration(pushback)*time.Millisecond-tolerance {
		t.Fatalf("the retry came %v after the denial, before its pushback of %dms", waited, pushback)
	}
	t.Logf("pushback %dms; the retry reached the upstream %v after the client received it", pushback, waited)
}

// TestGRPCUnsatisfiableAsksNoRetry: a call whose cost exceeds the zone's quota, which waiting
// can never cure, gets RESOURCE_EXHAUSTED with grpc-retry-pushback-ms -1, which grpc-go's retry
// policy reads as "do not retry": one attempt, none reaching the upstream.
func TestGRPCUnsatisfiableAsksNoRetry(t *testing.T) {
	srv := redistest.Start(t)
	up := startGRPCUpstream(t)
	addr := startGRPCSite(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-Client}
		capacity 2
		refill_rate 1
		cost {http.request.header.X-Cost}
	}`, srv.Addr), "", up)
	attempts := new(grpcAttempts)
	c := healthClient(t, addr, attempts, retryOnResourceExhausted)
	st, md := healthCheck(t, c, "a", "x-cost", "3")
	if st.Code() != codes.ResourceExhausted || st.Message() != "zone default: cost exceeds the zone's quota of 2" {
		t.Fatalf("call of cost 3: %v", st)
	}
	if got := md.Get("grpc-retry-pushback-ms"); len(got) != 1 || got[0] != "-1" {
		t.Fatalf("grpc-retry-pushback-ms %q, want -1", got)
	}
	attempts.mu.Lock()
	sent := attempts.sent
	attempts.mu.Unlock()
	if sent != 1 || len(up.calls()) != 0 {
		t.Fatalf("%d attempts, %d upstream calls; want 1 and 0", sent, len(up.calls()))
	}
}

// TestGRPCFailClosedIsUnavailable: with Redis down and fail_mode closed, a gRPC call gets
// UNAVAILABLE from the limiter (grpc-message naming the zone, a pushback of Retry-After's
// second), not the HTTP mapping of a 503; a plain request still gets the 503. Both carry
// Cache-Control: no-store.
func TestGRPCFailClosedIsUnavailable(t *testing.T) {
	srv := redistest.Start(t)
	srv.Stop() // Caddy must start while Redis is down
	up := startGRPCUpstream(t)
	addr := startGRPCSite(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		fail_mode closed
		zone grpc_closed {
			capacity 10
			refill_rate 1
		}
	}`, srv.Addr), "", up)
	c := healthClient(t, addr, new(grpcAttempts), "")
	st, md := healthCheck(t, c, "a")
	if st.Code() != codes.Unavailable || st.Message() != "zone grpc_closed: rate limiter unavailable (fail_mode closed)" {
		t.Fatalf("call while Redis is down: %v", st)
	}
	if got := first(md, "grpc-retry-pushback-ms"); got != "1000" || first(md, "cache-control") != "no-store" {
		t.Fatalf("grpc-retry-pushback-ms %q, metadata %v; want 1000 and cache-control no-store", got, md)
	}
	plainGet(t, addr, "a").Expect(t, "plain HTTP", 503, "", "Retry-After", "1", "Grpc-Status", "", "Cache-Control", "no-store")
	if n := len(up.calls()); n != 0 {
		t.Fatalf("the upstream had %d calls, want 0", n)
	}
}

// TestGRPCStatusOff: with grpc_status off a denied gRPC call gets the 429 like any request,
// which grpc-go reports as UNAVAILABLE (the HTTP mapping). The site has no handle_errors, so the
// 429 is the handler's bare one, Cache-Control: no-store as every refusal.
func TestGRPCStatusOff(t *testing.T) {
	srv := redistest.Start(t)
	up := startGRPCUpstream(t)
	addr := startGRPCSite(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		grpc_status off
		key {http.request.header.X-Client}
		capacity 1
		refill_rate 1/1h
	}`, srv.Addr), "", up)
	c := healthClient(t, addr, new(grpcAttempts), "")
	if st, _ := healthCheck(t, c, "a"); st.Code() != codes.OK {
		t.Fatalf("first call: %v", st)
	}
	if st, _ := healthCheck(t, c, "a"); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), "429") {
		t.Fatalf("denied call with grpc_status off: %v, want UNAVAILABLE from the 429", st)
	}
	plainGet(t, addr, "a").Expect(t, "plain HTTP", 429, "", "Retry-After", "3600", "Cache-Control", "no-store")
}

// TestGRPCMessage: grpc-message percent-encodes the bytes outside 0x20-0x7E, and '%', with
// upper-case hex digits (PROTOCOL-HTTP2.md), and leaves the others.
func TestGRPCMessage(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"zone api: rate limit exceeded": "zone api: rate limit exceeded",
		"":                              "",
		"100%":                          "100%25",
		"a\tb\nc\x7f":                   "a%09b%0Ac%7F",
		"zone é":                        "zone %C3%A9",
		"\xff~ ":                        "%FF~ ",
	} {
		if got := grpcMessage(in); got != want {
			t.Errorf("grpcMessage(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestIsGRPC: gRPC is a POST over HTTP/2 (or later) with content-type application/grpc, alone
// or with a subtype or parameter; not gRPC-Web, not another type, not HTTP/1.1, not another
// method.
func TestIsGRPC(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		method string
		proto  int
		ct     string
		want   bool
	}{
		{"POST", 2, "application/grpc", true},
		{"POST", 2, "application/grpc+proto", true},
		{"POST", 2, "Application/GRPC; charset=utf-8", true},
		{"POST", 3, "application/grpc", true},
		{"GET", 2, "application/grpc", false},
		{"PUT", 2, "application/grpc", false},
		{"POST", 1, "application/grpc", false},
		{"POST", 2, "application/grpc-web", false},
		{"POST", 2, "application/grpcx", false},
		{"POST", 2, "application/json", false},
		{"POST", 2, "", false},
	} {
		r := &http.Request{Method: tc.method, ProtoMajor: tc.proto, Header: http.Header{}}
		if tc.ct != "" {
			r.Header.Set("Content-Type", tc.ct)
		}
		if got := isGRPC(r); got != tc.want {
			t.Errorf("%s over HTTP/%d, %q: isGRPC = %v, want %v", tc.method, tc.proto, tc.ct, got, tc.want)
		}
	}
}

// TestGRPCPushback: the exact wait in ms, at least 1, plus Retry-After's jitter in whole
// seconds; -1 when waiting cannot cure the denial.
func TestGRPCPushback(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		waitMs, retryAfter int64
		unsatisfiable      bool
		want               string
	}{
		{100, 1, false, "100"},   // a tenth of a second, not Retry-After's rounded second
		{0, 1, false, "1"},       // at least 1
		{2500, 3, false, "2500"}, // no jitter: Retry-After is the wait rounded up
		{2500, 5, false, "4500"}, // 2s of jitter
		{3600000, 3600, false, "3600000"},
		{0, 0, true, "-1"},
	} {
		if got := grpcPushback(tc.waitMs, tc.retryAfter, tc.unsatisfiable); got != tc.want {
			t.Errorf("grpcPushback(%d, %d, %v) = %s, want %s", tc.waitMs, tc.retryAfter, tc.unsatisfiable, got, tc.want)
		}
	}
}

// h2cDo sends a request of method over cleartext HTTP/2 (prior knowledge, as a client of an
// h2c site, or a browser of an HTTPS one) to addr as client key, with the other headers given.
func h2cDo(t *testing.T, method, addr, key string, header ...string) caddytest.Response {
	t.Helper()
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: &p}
	t.Cleanup(tr.CloseIdleConnections)
	req, err := http.NewRequest(method, "http://"+addr+"/", strings.NewReader(""))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Client", key)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.ProtoMajor != 2 {
		t.Fatalf("%s over HTTP/%d, want HTTP/2", method, resp.ProtoMajor)
	}
	b, _ := io.ReadAll(resp.Body)
	return caddytest.Response{Status: resp.StatusCode, Header: resp.Header, Body: string(b)}
}

// TestGRPCFormOnlyForGRPCCalls: the denial of a request over HTTP/2 that is not a gRPC call
// (not a POST, or not of content-type application/grpc) is the site's 429, shaped by
// handle_errors, even with gRPC's content-type: never a 200 that logs, metrics and caches
// would take for a success. A real gRPC call still gets RESOURCE_EXHAUSTED. Every refusal
// carries Cache-Control: no-store (a gRPC call's among its trailers' metadata).
func TestGRPCFormOnlyForGRPCCalls(t *testing.T) {
	srv := redistest.Start(t)
	up := startGRPCUpstream(t)
	addr := startGRPCSite(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-Client}
		capacity 1
		refill_rate 1/1h
	}`, srv.Addr), `handle_errors {
		respond "custom {err.status_code} page" {err.status_code}
	}`, up)
	c := healthClient(t, addr, new(grpcAttempts), "")
	if st, _ := healthCheck(t, c, "a"); st.Code() != codes.OK {
		t.Fatalf("first call: %v", st)
	}
	h2cDo(t, http.MethodGet, addr, "a", "Content-Type", "application/grpc").Expect(t, "GET over HTTP/2 with gRPC's content-type", 429,
		"custom 429 page", "Grpc-Status", "", "Cache-Control", "no-store")
	h2cDo(t, http.MethodPost, addr, "a", "Content-Type", "text/plain").Expect(t, "POST over HTTP/2", 429,
		"custom 429 page", "Grpc-Status", "", "Cache-Control", "no-store")
	plainGet(t, addr, "a").Expect(t, "GET over HTTP/1.1", 429, "custom 429 page", "Cache-Control", "no-store")
	st, md := healthCheck(t, c, "a")
	if st.Code() != codes.ResourceExhausted || first(md, "cache-control") != "no-store" {
		t.Fatalf("gRPC call: %v, metadata %v; want ResourceExhausted and cache-control no-store", st, md)
	}
}

// TestGRPCOtherRefusals: a gRPC call refused before any decision gets the gRPC status of the
// HTTP refusal, with a grpc-message naming the zone (grpc-go otherwise reports the bare HTTP
// status as "malformed header: missing HTTP content-type"): an empty key in an empty_key deny
// zone (403) PERMISSION_DENIED, a cost that is not a positive integer (400) INVALID_ARGUMENT,
// and a zone number from a placeholder that is unusable (500) INTERNAL, whose message leaves
// the configuration's details to the log. None reaches the upstream. A plain request still gets
// the HTTP status; both carry Cache-Control: no-store.
func TestGRPCOtherRefusals(t *testing.T) {
	srv := redistest.Start(t)
	up := startGRPCUpstream(t)
	addr := startGRPCSite(t, fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		zone k {
			match header X-Case key
			key {http.request.header.X-Key}
			empty_key deny
			capacity 5
			refill_rate 1
		}
		zone c {
			match header X-Case cost
			key {http.request.header.X-Client}
			capacity 5
			refill_rate 1
			cost {http.request.header.X-Cost}
		}
		zone p {
			match header X-Case plan
			key {http.request.header.X-Client}
			capacity {http.request.header.X-Plan-Capacity}
			refill_rate 1
		}
	}`, srv.Addr), "", up)
	c := healthClient(t, addr, new(grpcAttempts), "")
	for _, tc := range []struct {
		name   string
		md     []string
		code   codes.Code
		msg    string
		status int
	}{
		{"empty_key deny", []string{"x-case", "key"}, codes.PermissionDenied, "zone k: every key placeholder is empty (empty_key deny)", 403},
		{"a cost that is not a number", []string{"x-case", "cost", "x-cost", "abc"}, codes.InvalidArgument, "zone c: the request's cost is not a positive integer", 400},
		{"an unusable plan number", []string{"x-case", "plan"}, codes.Internal, "zone p: rate limit configuration error", 500},
	} {
		st, md := healthCheck(t, c, "a", tc.md...)
		if st.Code() != tc.code || st.Message() != tc.msg || first(md, "cache-control") != "no-store" {
			t.Errorf("%s: %v, metadata %v; want %v %q and cache-control no-store", tc.name, st, md, tc.code, tc.msg)
		}
		header := []string{}
		for i := 0; i+1 < len(tc.md); i += 2 {
			header = append(header, http.CanonicalHeaderKey(tc.md[i]), tc.md[i+1])
		}
		if r := plainGet(t, addr, "a", header...); r.Status != tc.status || r.Header.Get("Cache-Control") != "no-store" || r.Header.Get("Grpc-Status") != "" {
			t.Errorf("%s, plain HTTP: %d %v; want %d with Cache-Control no-store", tc.name, r.Status, r.Header, tc.status)
		}
	}
	if n := len(up.calls()); n != 0 {
		t.Fatalf("the upstream had %d calls, want 0", n)
	}
}
