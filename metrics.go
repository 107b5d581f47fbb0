package ratelimitredis

import (
	"errors"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// The metrics live for the process and are registered into each config's registry on every
// load (as Caddy's reverse proxy does), so they keep counting across reloads.
var metrics struct {
	once sync.Once
	// backendFailures counts failed decisions by reason: timeout, bad_response, redis_error,
	// circuit_open.
	backendFailures *prometheus.CounterVec
	// denyCacheHits counts requests denied from the deny cache, with no Redis call.
	denyCacheHits prometheus.Counter
	// decisions counts decisions by zone and result: allowed, denied, dry_run_denied, fail_open,
	// fail_closed, local, local_denied.
	decisions *prometheus.CounterVec
	// redisDuration observes the seconds each decision's Redis call took, answered or not.
	redisDuration prometheus.Histogram
}

func initMetrics() {
	metrics.once.Do(func() {
		metrics.backendFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy",
			Subsystem: "rate_limit_redis",
			Name:      "backend_failures_total",
			Help:      "Rate limit decisions that Redis did not answer, by reason: timeout, bad_response, redis_error, circuit_open.",
		}, []string{"reason"})
		metrics.denyCacheHits = prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "caddy",
			Subsystem: "rate_limit_redis",
			Name:      "deny_cache_hits_total",
			Help:      "Requests denied from the in-process deny cache, without a Redis call.",
		})
		metrics.decisions = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy",
			Subsystem: "rate_limit_redis",
			Name:      "decisions_total",
			Help:      "Rate limit decisions by zone and result: allowed, denied, dry_run_denied, fail_open, fail_closed, local, local_denied.",
		}, []string{"zone", "result"})
		metrics.redisDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "caddy",
			Subsystem: "rate_limit_redis",
			Name:      "redis_duration_seconds",
			Help:      "Seconds each decision's Redis call took, whether Redis answered or not.",
			Buckets:   []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		})
	})
}

// registerMetrics registers the metrics into a config's registry; registering them again
// (another handler of the same config) is not an error.
func registerMetrics(reg prometheus.Registerer) error {
	initMetrics()
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{metrics.backendFailures, metrics.denyCacheHits, metrics.decisions, metrics.redisDuration} {
		if err := reg.Register(c); err != nil && !errors.As(err, new(prometheus.AlreadyRegisteredError)) {
			return err
		}
	}
	return nil
}
