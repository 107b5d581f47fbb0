package ratelimitredis

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// Handler benchmarks against a real Redis: go test -run XXX -bench ServeHTTP -benchmem .
// ns/op includes the Redis round trip; allocs/op is the handler's and go-redis's.

func benchHandler(b *testing.B, h *Handler) {
	srv := redistest.Start(b)
	h.Redis = &RedisConfig{Addresses: []string{srv.Addr}}
	provisioned(b, h)
	// Caddy logs at INFO unless configured otherwise; the test context's logger is at DEBUG.
	h.logger = h.logger.WithOptions(zap.IncreaseLevel(zapcore.InfoLevel))
	reqs := make([]*http.Request, 1024)
	for i := range reqs {
		reqs[i] = httptest.NewRequest(http.MethodGet, "/", nil)
		reqs[i].Header.Set("X-Client", strconv.Itoa(i))
	}
	i := 0
	for b.Loop() {
		_, err, _ := serve(h, reqs[i%len(reqs)])
		if err != nil && h.Zones[0].Capacity > 1 {
			b.Fatal(err)
		}
		i++
	}
}

func BenchmarkServeHTTPAllowed1Zone(b *testing.B) {
	benchHandler(b, &Handler{Zones: []*Zone{
		{Name: "a", Key: []string{"{http.request.header.X-Client}"}, Capacity: 1 << 40, RefillRate: 1 << 40},
	}})
}

func BenchmarkServeHTTPAllowed3Zones(b *testing.B) {
	benchHandler(b, &Handler{Zones: []*Zone{
		{Name: "a", Key: []string{"{http.request.header.X-Client}"}, Capacity: 1 << 40, RefillRate: 1 << 40},
		{Name: "b", Key: []string{"{http.request.header.X-Client}"}, Capacity: 1 << 40, RefillRate: 1 << 40},
		{Name: "c", Key: []string{"{http.request.header.X-Client}"}, Algorithm: "sliding_window", Limit: 1_000_000, Window: caddy.Duration(time.Second)},
	}})
}

func BenchmarkServeHTTPDenyCached(b *testing.B) {
	benchHandler(b, &Handler{Zones: []*Zone{
		{Name: "a", Key: []string{"flood"}, Capacity: 1, RefillRate: 0.001},
	}})
}

func BenchmarkServeHTTPAllowedKeySecret(b *testing.B) {
	benchHandler(b, &Handler{KeySecret: "a benchmark secret of 32 bytes..", Zones: []*Zone{
		{Name: "a", Key: []string{"{http.request.header.X-Client}"}, Capacity: 1 << 40, RefillRate: 1 << 40},
	}})
}
