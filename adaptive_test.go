package ratelimitredis

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestAdaptiveConcurrencyMeasuresLatency: an adaptive_concurrency zone in front of an upstream
// that answers after 30 ms learns a minimum latency of at least 30 ms from what its requests
// took (the time to the response header, through reverse_proxy), shown by the admin API's state
// and the gauges, and with 4 clients its limit grows past 4; the limit in force is the one the
// state shows and the gauge reads. When the upstream answers 503, each window's failures lower
// the limit until it is the min limit.
func TestAdaptiveConcurrencyMeasuresLatency(t *testing.T) {
	srv := redistest.Start(t)
	var failing atomic.Bool
	release := make(chan struct{})
	held := make(chan struct{}, 1)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			held <- struct{}{}
			<-release
		}
		time.Sleep(30 * time.Millisecond)
		if failing.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(upstream.Close)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone up {
			algorithm adaptive_concurrency
			key upstream
			limit 8
			min_limit 2
			update_interval 50ms
			probe_samples 5
			max_wait 5s
		}
	}
	reverse_proxy %s`, srv.Addr, strings.TrimPrefix(upstream.URL, "http://")))

	// load runs 4 clients until the state satisfies done.
	state := func() adminapi.ClientState {
		st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=up&key=upstream", 200)
		if len(st) != 1 || st[0].Learnt == nil || st[0].Learnt.Ceiling != 8 || st[0].Algorithm != "adaptive_concurrency" {
			t.Fatalf("state: %+v", st)
		}
		return st[0]
	}
	load := func(what string, done func(adminapi.ClientState) bool) adminapi.ClientState {
		t.Helper()
		stop := make(chan struct{})
		var wg sync.WaitGroup
		lc := caddytest.NewLoadClient(ac.Site)
		for range 4 {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					_, _ = lc.Get("/")
				}
			})
		}
		var last adminapi.ClientState
		redistest.WaitFor(t, 20*time.Second, what, func() bool { last = state(); return done(last) })
		close(stop)
		wg.Wait()
		return last
	}
	st := load("a probe's minimum latency, and the limit above its floor", func(s adminapi.ClientState) bool {
		return s.Learnt.MinLatencyMs > 0 && s.Limit >= 4
	})
	if st.Learnt.MinLatencyMs < 30 {
		t.Fatalf("minimum latency %dms, below the upstream's 30ms", st.Learnt.MinLatencyMs)
	}
	g := metrics.adaptiveMinLatency.WithLabelValues("up")
	redistest.WaitFor(t, 5*time.Second, "the minimum latency gauge", func() bool { return testutil.ToFloat64(g) >= 0.030 })

	// One request held inside the upstream: nothing settles while the state and gauge are read.
	go func() { _, _ = caddytest.NewLoadClient(ac.Site).Get("/hold") }()
	<-held
	st = state()
	if got := testutil.ToFloat64(metrics.concurrencyLimit.WithLabelValues("up")); got != float64(st.Limit) || st.Limit < 2 || st.Limit > 8 {
		t.Errorf("limit gauge %v, state's limit in force %d (between the min limit 2 and the ceiling 8)", got, st.Limit)
	}
	close(release)

	failing.Store(true)
	load("the limit at its floor under 503s", func(s adminapi.ClientState) bool { return s.Limit == 2 })
}
