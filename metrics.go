package ratelimitredis

import (
	"errors"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// The metrics live for the process and are registered into each config's registry on every
// load, as Caddy's reverse proxy does: Caddy gives every config (every load or reload) a new,
// empty registry (caddy.Context.GetMetricsRegistry), and its admin /metrics endpoint and
// `metrics` handler serve the registry of the config they belong to. Collectors made per config
// would start again from zero on each reload; these keep counting. No metric has a per-client
// label: the zone label's values are the configured zone names.
var metrics struct {
	once sync.Once
	// backendFailures counts failed decisions by reason: timeout, bad_response, oom, redis_error,
	// circuit_open.
	backendFailures *prometheus.CounterVec
	// denyCacheHits counts requests denied from the deny cache, with no Redis call.
	denyCacheHits prometheus.Counter
	// decisions counts decisions by zone and result (the result* values): an admitted request
	// once in every zone that applied to it, a denied one once in the deciding zone only.
	decisions *prometheus.CounterVec
	// redisDuration observes the seconds each decision's Redis call took, answered or not. A
	// denial from the deny cache and a failure of the open circuit breaker make no call.
	redisDuration prometheus.Histogram
	// emptyKeys counts, by zone, the requests that applied to the zone with every key
	// placeholder empty, whatever the zone's empty_key then did with them (shared, skip, deny).
	emptyKeys *prometheus.CounterVec
	// delays observes, by deciding zone (the one with the longest delay), the delay of every
	// request admitted to be held for a max_wait: in dry_run and under fail_mode local too,
	// whether it was then held to the end or its client left.
	delays *prometheus.HistogramVec
	// waiting is the requests held for a max_wait now, in every handler of the process.
	waiting prometheus.Gauge
	// inFlight is, by concurrency zone, the requests of this instance holding a slot now
	// (concurrency.go).
	inFlight *prometheus.GaugeVec
}

// result is the result label of decisions_total.
type result int

// The results of a decision. In dry_run every result is counted as enforcement would count it,
// except that a denial (resultDenied, resultLocalDenied) is resultDryRunDenied.
const (
	resultAllowed      result = iota // Redis admitted the request
	resultDenied                     // Redis or the deny cache denied it (429), or its cost exceeds the quota
	resultDryRunDenied               // it would have been denied, but dry_run let it through
	resultFailOpen                   // Redis failed and fail_mode open let it through
	resultFailClosed                 // Redis failed and fail_mode closed answered 503 (in dry_run: would have)
	resultLocal                      // Redis failed and fail_mode local's in-process limiter admitted it
	resultLocalDenied                // Redis failed and fail_mode local's in-process limiter denied it
	resultDelayed                    // Redis admitted it to be held for a max_wait (in dry_run: not held)
	numResults
)

var resultNames = [numResults]string{"allowed", "denied", "dry_run_denied", "fail_open", "fail_closed", "local", "local_denied", "delayed"}

func (r result) String() string { return resultNames[r] }

// decisionCounters are one zone's series of decisions_total, one per result, looked up once
// when the zone is provisioned rather than per request. Creating them up front also exports
// every series at 0, so that rates over them are defined from the first scrape.
type decisionCounters [numResults]prometheus.Counter

// newDecisionCounters returns the decisions_total series of the zone named zone.
func newDecisionCounters(zone string) *decisionCounters {
	initMetrics()
	var c decisionCounters
	for r := range numResults {
		c[r] = metrics.decisions.WithLabelValues(zone, r.String())
	}
	return &c
}

func initMetrics() {
	metrics.once.Do(func() {
		metrics.backendFailures = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy",
			Subsystem: "rate_limit_redis",
			Name:      "backend_failures_total",
			Help:      "Rate limit decisions that Redis did not answer, by reason: timeout, bad_response, oom, redis_error, circuit_open.",
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
			Help:      "Rate limit decisions by zone and result: allowed, delayed, denied, dry_run_denied, fail_open, fail_closed, local, local_denied. An admitted request counts in every zone that applied, a denied one in the denying zone only.",
		}, []string{"zone", "result"})
		metrics.redisDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "caddy",
			Subsystem: "rate_limit_redis",
			Name:      "redis_duration_seconds",
			Help:      "Seconds each decision's Redis call took, whether Redis answered or not.",
			Buckets:   []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		})
		metrics.emptyKeys = prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy",
			Subsystem: "rate_limit_redis",
			Name:      "empty_key_total",
			Help:      "Requests a zone applied to whose key placeholders were all empty, by zone; the zone's empty_key decided what they did: shared, skip or deny.",
		}, []string{"zone"})
		metrics.delays = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "caddy",
			Subsystem: "rate_limit_redis",
			Name:      "delay_seconds",
			Help:      "Seconds each request admitted to wait for its turn (max_wait) was to be held, by the zone that held it longest.",
			Buckets:   []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"zone"})
		metrics.waiting = prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "caddy",
			Subsystem: "rate_limit_redis",
			Name:      "waiting",
			Help:      "Requests held now for their turn (max_wait), in every handler of this instance.",
		})
		metrics.inFlight = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "caddy",
			Subsystem: "rate_limit_redis",
			Name:      "in_flight",
			Help:      "Requests of this instance holding a slot of a concurrency zone now (in Redis, or in process under fail_mode local), by zone.",
		}, []string{"zone"})
	})
}

// registerMetrics registers the metrics into a config's registry; registering them again
// (another handler of the same config) is not an error.
func registerMetrics(reg prometheus.Registerer) error {
	initMetrics()
	if reg == nil {
		return nil
	}
	for _, c := range append([]prometheus.Collector{metrics.backendFailures, metrics.denyCacheHits, metrics.decisions, metrics.redisDuration, metrics.emptyKeys, metrics.delays, metrics.waiting, metrics.inFlight}, append(chargeCollectors(), leaseCollectors()...)...) {
		if err := reg.Register(c); err != nil && !errors.As(err, new(prometheus.AlreadyRegisteredError)) {
			return err
		}
	}
	return nil
}
