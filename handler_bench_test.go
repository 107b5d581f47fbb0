package ratelimitredis

import (
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/clientip"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// Handler benchmarks against a real Redis, as Caddy runs the handler: each request carries
// Caddy's HTTP replacer (so {http.request.header.X-Client} resolves) and one of 10,000 client
// keys, so every decision touches a client's own state:
//
//	go test -run XXX -bench ServeHTTP -benchmem .
//
// ns/op includes the Redis round trip; allocs/op are the handler's and go-redis's. The Parallel
// variants run 64 goroutines per CPU, whose decisions share round trips (batches) as under load;
// the others decide one request at a time (a round trip each). The requests, their replacers and
// the response writer are made with the timer stopped: what is counted is the module's work. A
// serial benchmark serves each request once (benchSource); a parallel one cycles through its
// 64 × 64 × GOMAXPROCS requests, each replacer gaining one set of placeholders per pass.

// benchClients is how many client keys the benchmarks spread their requests over.
const benchClients = 10_000

// benchHandler provisions h against a fresh Redis, at Caddy's default log level.
func benchHandler(b *testing.B, h *Handler) *Handler {
	srv := redistest.Start(b)
	h.Redis = &RedisConfig{Addresses: []string{srv.Addr}}
	// A timeout no busy machine reaches: a decision that failed open would be counted as one
	// that went to Redis.
	h.Timeout = caddy.Duration(5 * time.Second)
	provisioned(b, h)
	// Caddy logs at INFO unless configured otherwise; the test context's logger is at DEBUG.
	h.logger = h.logger.WithOptions(zap.IncreaseLevel(zapcore.InfoLevel))
	return h
}

// benchRequests returns n requests of distinct clients (X-Client 0..n-1, from client 0 at
// offset), each with Caddy's HTTP replacer in its context.
func benchRequests(n, offset int) []*http.Request { return clientRequests(n, offset, benchClients) }

// clientRequests returns n requests whose X-Client is (offset+i) mod clients, each with Caddy's
// HTTP replacer in its context.
func clientRequests(n, offset, clients int) []*http.Request {
	reqs := make([]*http.Request, n)
	for i := range reqs {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Client", strconv.Itoa((offset+i)%clients))
		r.Header.Set("Accept-Encoding", "gzip")
		caddyhttp.NewTestReplacer(r)
		reqs[i] = r
	}
	return reqs
}

// benchSource hands a serial benchmark its requests, each served once: serving a request adds the
// handler's placeholders to its replacer, as Caddy does once per request, so a request served
// again and again would grow its replacer without bound and time that growth (and the garbage it
// keeps alive) instead of the module. Every batch of requests is made with the timer stopped.
type benchSource struct {
	b       *testing.B
	clients int
	reqs    []*http.Request
	i       int
}

func (s *benchSource) next() *http.Request {
	if s.i == len(s.reqs) {
		s.b.StopTimer()
		s.reqs, s.i = clientRequests(benchClients, 0, s.clients), 0
		s.b.StartTimer()
	}
	s.i++
	return s.reqs[s.i-1]
}

// benchWriter is a ResponseWriter whose header map is reused: Caddy's own response writer
// allocates its map once per connection, not per rate limit decision.
type benchWriter struct{ h http.Header }

func (w *benchWriter) Header() http.Header         { return w.h }
func (w *benchWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *benchWriter) WriteHeader(int)             {}

var benchNext = caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })

// serveBench serves r through h, failing the benchmark when an allowed-path request is refused.
func serveBench(b *testing.B, h *Handler, w *benchWriter, r *http.Request, wantAllowed bool) {
	clear(w.h)
	err := h.ServeHTTP(w, r, benchNext)
	if wantAllowed && err != nil {
		b.Error(err)
	}
}

// runServeHTTP runs the benchmark serially, or with 64 goroutines per CPU when parallel.
func runServeHTTP(b *testing.B, h *Handler, parallel, wantAllowed bool) {
	if !parallel {
		serveSerial(b, h, benchClients, wantAllowed)
		return
	}
	// Each goroutine's requests are made before the timer starts, as in the serial case.
	const perGoroutine = 64
	goroutines := 64 * runtime.GOMAXPROCS(0)
	sets := make([][]*http.Request, goroutines)
	for g := range sets {
		sets[g] = benchRequests(perGoroutine, g*perGoroutine)
	}
	var next atomic.Int64
	b.SetParallelism(64)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		reqs := sets[int(next.Add(1)-1)%len(sets)]
		w := &benchWriter{h: http.Header{}}
		i := 0
		for pb.Next() {
			serveBench(b, h, w, reqs[i%len(reqs)], wantAllowed)
			i++
		}
	})
}

func allowedZone(name string) *Zone {
	return &Zone{Name: name, Key: []string{"{http.request.header.X-Client}"}, Capacity: NumberOf(1 << 40), RefillRate: NumberOf(1 << 40)}
}

func threeZones() []*Zone {
	return []*Zone{allowedZone("a"), allowedZone("b"),
		{Name: "c", Key: []string{"{http.request.header.X-Client}"}, Algorithm: "sliding_window", Limit: NumberOf(1_000_000), Window: NumberOf(caddy.Duration(time.Second))},
	}
}

func BenchmarkServeHTTPAllowed1Zone(b *testing.B) {
	runServeHTTP(b, benchHandler(b, &Handler{Zones: []*Zone{allowedZone("a")}}), false, true)
}

func BenchmarkServeHTTPAllowed1ZoneParallel(b *testing.B) {
	runServeHTTP(b, benchHandler(b, &Handler{Zones: []*Zone{allowedZone("a")}}), true, true)
}

func BenchmarkServeHTTPAllowed3Zones(b *testing.B) {
	runServeHTTP(b, benchHandler(b, &Handler{Zones: threeZones()}), false, true)
}

func BenchmarkServeHTTPAllowed3ZonesParallel(b *testing.B) {
	runServeHTTP(b, benchHandler(b, &Handler{Zones: threeZones()}), true, true)
}

func BenchmarkServeHTTPAllowedKeySecret(b *testing.B) {
	runServeHTTP(b, benchHandler(b, &Handler{KeySecret: "a benchmark secret of 32 bytes..", Zones: []*Zone{allowedZone("a")}}), false, true)
}

// BenchmarkServeHTTPDenyCached: one client far over its limit, every request denied from the
// deny cache after the first.
func BenchmarkServeHTTPDenyCached(b *testing.B) {
	h := benchHandler(b, &Handler{Zones: []*Zone{{Name: "a", Key: []string{"flood"}, Capacity: NumberOf(1), RefillRate: NumberOf(0.001)}}})
	runServeHTTP(b, h, false, false)
}

// BenchmarkServeHTTPLeased: 10 hot clients of a lease zone far under their limit,
// almost every request admitted from a grant with no Redis call.
func BenchmarkServeHTTPLeased(b *testing.B) {
	z := allowedZone("a")
	z.Lease = &Lease{Max: 200, TTL: caddy.Duration(250 * time.Millisecond)}
	serveSerial(b, benchHandler(b, &Handler{Zones: []*Zone{z}}), 10, true)
}

// serveSerial serves requests of the given number of clients through h one at a time, each
// request once (benchSource).
func serveSerial(b *testing.B, h *Handler, clients int, wantAllowed bool) {
	src := &benchSource{b: b, clients: clients}
	src.reqs = clientRequests(benchClients, 0, clients)
	w := &benchWriter{h: http.Header{}}
	b.ReportAllocs()
	for b.Loop() {
		serveBench(b, h, w, src.next(), wantAllowed)
	}
}

// BenchmarkServeHTTPLeaseRare: the allowed path of BenchmarkServeHTTPAllowed1Zone with a lease
// on the zone: 10,000 clients, none hot enough for a grant (it must cost no more than without lease).
func BenchmarkServeHTTPLeaseRare(b *testing.B) {
	z := allowedZone("a")
	z.Lease = &Lease{Max: 200, TTL: caddy.Duration(250 * time.Millisecond)}
	runServeHTTP(b, benchHandler(b, &Handler{Zones: []*Zone{z}}), false, true)
}

// TestBenchRequestsResolveTheirKeys: the benchmarks' requests resolve their zone's key to their
// own client, as in Caddy (the earlier benchmark's replacer had no HTTP placeholders: every
// request shared the empty key's bucket).
func TestBenchRequestsResolveTheirKeys(t *testing.T) {
	t.Parallel()
	z := allowedZone("a")
	z.v4, z.v6 = 32, 64
	for i, r := range benchRequests(3, 7) {
		repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		if got, want := z.clientKey(r, repl, &clientip.Memo{}), strconv.Itoa(7+i); got != want {
			t.Fatalf("request %d: key %q, want %q", i, got, want)
		}
	}
}
