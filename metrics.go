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
// label: the zone label's values are the configured zone names. initMetrics makes them all, once.
var metrics metricSet

// metricSet is the type of metrics.
type metricSet struct {
	once sync.Once
	// all are every collector below, in the order made: what registerMetrics registers.
	all []prometheus.Collector
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
	// nearLimit counts, by zone, the requests that took their client past the zone's near_limit
	// (near.go).
	nearLimit *prometheus.CounterVec
	// waiting is the requests held for a max_wait now, in every handler of the process.
	waiting prometheus.Gauge
	// inFlight is, by concurrency zone, the requests of this instance holding a slot now
	// (concurrency.go).
	inFlight *prometheus.GaugeVec
	// concurrencyLimit, adaptiveMinLatency and adaptiveLatency are, by adaptive_concurrency
	// zone, the limit in force and the latencies it was learnt from, as the last decision read
	// them (adaptive.go).
	concurrencyLimit, adaptiveMinLatency, adaptiveLatency *prometheus.GaugeVec
	// queueWaiters and queueWait are, by queue zone and class, the requests waiting now and
	// their waits (queue.go).
	queueWaiters *prometheus.GaugeVec
	queueWait    *prometheus.HistogramVec

	// Charging after the response (charge.go).
	// charged counts, by zone, what settlements charged (tokens or window slots).
	charged *prometheus.CounterVec
	// refunded counts, by zone, what settlements gave back of the reservations.
	refunded *prometheus.CounterVec
	// settleFailures counts settlements that failed, by reason: the decision failure reasons,
	// and no_hold (the hold was gone: settled already, older than hold_max, or reset).
	settleFailures *prometheus.CounterVec
	// chargeMissing counts, by zone, the successful responses that reported no usage and were
	// charged the zone's `missing` amount (charge openai_usage).
	chargeMissing *prometheus.CounterVec
	// chargeCapped counts, by zone, the amounts reported above the zone's max_cost, charged
	// max_cost.
	chargeCapped *prometheus.CounterVec
	// chargeUndecoded counts, by zone and reason (usage.StopReasons), the compressed responses of a
	// zone with charge openai_usage whose decoding stopped before their end.
	chargeUndecoded *prometheus.CounterVec

	// Leases (docs/operations.md), by zone; promLease reports a Limiter's lease events into them.
	leaseGrants, leaseLocal, leaseReturned *prometheus.CounterVec
	leaseStranded                          *prometheus.GaugeVec
}

// result is the result label of decisions_total.
type result int

// The results of a decision. In dry_run every result is counted as enforcement would count it,
// except that a denial (resultDenied, resultBlocked, resultLocalDenied) is resultDryRunDenied.
const (
	resultAllowed      result = iota // Redis admitted the request
	resultDenied                     // Redis or the deny cache denied it (429), or its cost exceeds the quota
	resultDryRunDenied               // it would have been denied, but dry_run let it through
	resultFailOpen                   // Redis failed and fail_mode open let it through
	resultFailClosed                 // Redis failed and fail_mode closed answered 503 (in dry_run: would have)
	resultLocal                      // Redis failed and fail_mode local's in-process limiter admitted it
	resultLocalDenied                // Redis failed and fail_mode local's in-process limiter denied it
	resultDelayed                    // Redis admitted it to be held for a max_wait (in dry_run: not held)
	resultBlocked                    // the zone's block refused it (429): the client was in its penalty box already
	resultWaitTimeout                // it waited in the zone's queue for max_wait, and got no slot (429)
	resultEvicted                    // it waited in the zone's queue, and a higher class took its waiting place (429)
	numResults
)

var resultNames = [numResults]string{"allowed", "denied", "dry_run_denied", "fail_open", "fail_closed", "local", "local_denied", "delayed", "blocked", "wait_timeout", "evicted"}

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
		m := &metrics
		m.backendFailures = newCounterVec("backend_failures_total",
			"Rate limit decisions that Redis did not answer, by reason: timeout, bad_response, oom, redis_error, circuit_open.", "reason")
		m.denyCacheHits = collect(prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: subsystem, Name: "deny_cache_hits_total",
			Help: "Requests denied from the in-process deny cache, without a Redis call.",
		}))
		m.decisions = newCounterVec("decisions_total",
			"Rate limit decisions by zone and result: allowed, delayed, denied, blocked, wait_timeout, evicted, dry_run_denied, fail_open, fail_closed, local, local_denied (wait_timeout: waited in the zone's queue for max_wait without a slot; evicted: waited in the zone's queue as its lowest priority class, and a request of a higher class took its waiting place when every place was taken; blocked: refused by the zone's penalty box, started by an earlier denial; dry_run_denied: a lower bound while an enforced zone denies, since a request refused from the deny cache decides no shadow zone). An admitted request counts in every zone that applied, a denied one in the denying zone only.", "zone", "result")
		m.redisDuration = collect(prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: namespace, Subsystem: subsystem, Name: "redis_duration_seconds",
			Help:    "Seconds each decision's Redis call took, whether Redis answered or not.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}))
		m.emptyKeys = newCounterVec("empty_key_total",
			"Requests a zone applied to whose key placeholders were all empty, by zone; the zone's empty_key decided what they did: shared, skip or deny.", "zone")
		m.nearLimit = newCounterVec("near_limit_total", "Requests that took their client from below the zone's near_limit (a fraction of its quota used) to at or past it, by zone: one per crossing, whichever instance decided it.", "zone")
		m.delays = collect(prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Subsystem: subsystem, Name: "delay_seconds",
			Help:    "Seconds each request admitted to wait for its turn (max_wait) was to be held, by the zone that held it longest.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"zone"}))
		m.waiting = collect(prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Subsystem: subsystem, Name: "waiting",
			Help: "Requests held now for their turn (max_wait), in every handler of this instance.",
		}))
		m.queueWaiters = collect(prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Subsystem: subsystem, Name: "queue_waiters",
			Help: "Requests of this instance waiting now in a concurrency zone's queue (max_wait), by zone and priority class.",
		}, []string{"zone", "class"}))
		m.queueWait = collect(prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Subsystem: subsystem, Name: "queue_wait_seconds",
			Help:    "Seconds each request waited in a concurrency zone's queue (max_wait), granted a slot or not, by zone and priority class.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"zone", "class"}))
		m.inFlight = newGaugeVec("in_flight",
			"Requests of this instance holding a slot of a concurrency zone now (in Redis, or in process under fail_mode local), by zone.")
		initAdaptiveMetrics(m)

		m.charged = newCounterVec("charged_total",
			"Tokens (or window slots) charged by settlements after the response, by zone: the amounts reported, or the reservations when nothing was reported.", "zone")
		m.refunded = newCounterVec("refunded_total",
			"Tokens (or window slots) of reservations given back by settlements after the response, by zone (count_status not listed, or less reported than reserved).", "zone")
		m.settleFailures = newCounterVec("settle_failures_total",
			"Settlements after the response that failed, by reason: timeout, bad_response, oom, redis_error, circuit_open, no_hold. An unsettled hold counts as charged after hold_max.", "reason")
		m.chargeMissing = newCounterVec("charge_missing_total",
			"Successful responses of a zone with charge openai_usage that reported no usage it could charge, charged the zone's missing amount, by zone.", "zone")
		m.chargeCapped = newCounterVec("charge_capped_total",
			"Amounts reported by responses above the zone's max_cost, charged max_cost instead, by zone.", "zone")
		m.chargeUndecoded = newCounterVec("charge_undecoded_total",
			"Compressed responses of a zone with charge openai_usage whose decoding stopped before their end (the rest went to the client undecoded), charged the zone's missing amount if successful, by zone and reason: size (256 MiB decoded), ratio (over 100 times the bytes received, past 8 MiB), memory (no room for a zstd window).", "zone", "reason")

		initLeaseMetrics(m)
	})
}

// initAdaptiveMetrics makes the gauges of adaptive_concurrency zones (adaptive.go).
func initAdaptiveMetrics(m *metricSet) {
	m.concurrencyLimit = newGaugeVec("concurrency_limit",
		"The limit in force of an adaptive_concurrency zone (requests in flight), learnt in Redis for every instance, as this instance's last decision read it, by zone.")
	m.adaptiveMinLatency = newGaugeVec("adaptive_min_latency_seconds",
		"The upstream's minimum latency (seconds to the response header) that an adaptive_concurrency zone's last probe measured, by zone.")
	m.adaptiveLatency = newGaugeVec("adaptive_latency_seconds",
		"The mean latency (seconds to the response header) of an adaptive_concurrency zone's requests in its last update interval, by zone.")
}

// initLeaseMetrics makes the metrics of lease zones (lease.go).
func initLeaseMetrics(m *metricSet) {
	m.leaseGrants = newCounterVec("lease_grants_total", "Grants of tokens this instance took from Redis for a lease zone's hot clients, by zone.", "zone")
	m.leaseLocal = newCounterVec("lease_local_decisions_total", "Requests a lease zone admitted in process from a grant, with no Redis call for that zone, by zone.", "zone")
	m.leaseReturned = newCounterVec("lease_returned_units_total", "Tokens granted and not spent that this instance gave back to Redis when their grant ended, by zone.", "zone")
	m.leaseStranded = newGaugeVec("lease_stranded_units",
		"Tokens granted to this instance and not yet spent, by zone: charged in Redis, unavailable to the other instances.")
}

// The namespace and subsystem of every metric: caddy_rate_limit_redis_<name>.
const (
	namespace = "caddy"
	subsystem = "rate_limit_redis"
)

// collect adds c to metrics.all and returns it.
func collect[C prometheus.Collector](c C) C {
	metrics.all = append(metrics.all, c)
	return c
}

// newCounterVec makes the counter caddy_rate_limit_redis_<name> with labels.
func newCounterVec(name, help string, labels ...string) *prometheus.CounterVec {
	return collect(prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Subsystem: subsystem, Name: name, Help: help}, labels))
}

// newGaugeVec makes the gauge caddy_rate_limit_redis_<name> by zone.
func newGaugeVec(name, help string) *prometheus.GaugeVec {
	return collect(prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: namespace, Subsystem: subsystem, Name: name, Help: help}, []string{"zone"}))
}

// registerMetrics registers the metrics into a config's registry; registering them again
// (another handler of the same config) is not an error.
func registerMetrics(reg prometheus.Registerer) error {
	initMetrics()
	if reg == nil {
		return nil
	}
	for _, c := range metrics.all {
		if err := reg.Register(c); err != nil && !errors.As(err, new(prometheus.AlreadyRegisteredError)) {
			return err
		}
	}
	return nil
}

// promLease is the limiter.LeaseMetrics of the lease metrics: each lease zone's series,
// looked up once (newPromLease) instead of by label on every request admitted from a grant.
type promLease map[string]*leaseSeries

// leaseSeries are one zone's lease metrics.
type leaseSeries struct {
	grants, local, returned prometheus.Counter
	stranded                prometheus.Gauge
}

// newPromLease returns the lease metrics of zones' lease zones.
func newPromLease(zones []*Zone) promLease {
	initMetrics()
	m := promLease{}
	for _, z := range zones {
		if z.Lease != nil {
			m[z.Name] = seriesOf(z.Name)
		}
	}
	return m
}

// seriesOf returns zone's lease series.
func seriesOf(zone string) *leaseSeries {
	return &leaseSeries{
		grants:   metrics.leaseGrants.WithLabelValues(zone),
		local:    metrics.leaseLocal.WithLabelValues(zone),
		returned: metrics.leaseReturned.WithLabelValues(zone),
		stranded: metrics.leaseStranded.WithLabelValues(zone),
	}
}

// series returns zone's series; a zone unknown to m (never: only lease zones take grants) gets
// them by label.
func (m promLease) series(zone string) *leaseSeries {
	if s := m[zone]; s != nil {
		return s
	}
	return seriesOf(zone)
}

func (m promLease) Granted(zone string, _ int64)      { m.series(zone).grants.Inc() }
func (m promLease) Local(zone string)                 { m.series(zone).local.Inc() }
func (m promLease) Returned(zone string, units int64) { m.series(zone).returned.Add(float64(units)) }
func (m promLease) Stranded(zone string, delta int64) { m.series(zone).stranded.Add(float64(delta)) }
