package ratelimitredis

import (
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
)

// Lease is a token_bucket or fixed_window zone's leasing: the tokens (window slots) of a client
// that sends at least two requests' worth per ttl to this instance are taken from Redis in
// grants before they are spent, and spent in process, with no Redis call, until the grant is
// spent or its ttl ends (a fixed window's grant at the latest when its window does); its unspent
// tokens then go back to Redis. Redis has charged every token an instance admits
// before it admits it, so a zone never admits more than without lease; near the limit grants
// shrink to one request's cost, so a denial is Redis's count's. What it costs: up to max tokens
// per other instance stranded for up to ttl (a client denied on one instance while another
// holds a grant of it), and headers that are an estimate. Not with max_wait, count_status or
// charge, nor on the sliding window algorithms. See docs/decisions.md ("Leases").
type Lease struct {
	// The most tokens one grant takes: 1 to 2^53. A client is granted about 1.25 × its rate on
	// this instance × ttl, at most this and at most half of what Redis has left.
	Max int64 `json:"max,omitempty"`

	// A grant's lifetime, as a duration (JSON: nanoseconds or a duration string): 10ms to 1m.
	// Its unspent tokens go back to Redis when it ends; those of an instance that crashed count
	// as spent 1s after it.
	TTL caddy.Duration `json:"ttl,omitempty"`
}

// limiterLease is the limiter's parameters of l; nil when l is.
func (l *Lease) limiterLease() *limiter.Lease {
	if l == nil {
		return nil
	}
	return &limiter.Lease{Max: l.Max, TTL: time.Duration(l.TTL)}
}

// validateLease checks what the limiter's Zone.Validate cannot: a zone that charges after the
// response cannot lease.
func (z *Zone) validateLease() error {
	if z.Lease != nil && z.after != nil {
		return fmt.Errorf("zone %s: lease excludes count_status and charge: a grant is spent as requests arrive, before any response says what to charge", z.Name)
	}
	return nil
}

// parseLease parses a zone's lease block at the cursor:
//
//	lease {
//		max <n>
//		ttl <duration>
//	}
func (p *zoneParser) parseLease(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.Errf("lease: unexpected argument %q (lease takes a block: max and ttl)", d.Val())
	}
	le := new(Lease)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "max":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 1 || n > limiter.MaxCapacity {
				return d.Errf("lease max: %q must be an integer between 1 and %d", v, int64(limiter.MaxCapacity))
			}
			le.Max = n
		case "ttl":
			v, dur, err := durationValue(d)
			if err != nil {
				return err
			}
			if dur < limiter.MinLeaseTTL || dur > limiter.MaxLeaseTTL {
				return d.Errf("lease ttl: %q must be between %v and %v", v, limiter.MinLeaseTTL, limiter.MaxLeaseTTL)
			}
			le.TTL = caddy.Duration(dur)
		default:
			return d.Errf("lease: unrecognized subdirective %q (max, ttl)", d.Val())
		}
	}
	if le.Max == 0 || le.TTL == 0 {
		return d.Errf("lease: both max and ttl are required")
	}
	p.zone.Lease = le
	return nil
}

// leaseMetrics are the lease metrics (docs/operations.md), by zone; promLease reports a
// Limiter's lease events into them.
var leaseMetrics struct {
	once                    sync.Once
	grants, local, returned *prometheus.CounterVec
	stranded                *prometheus.GaugeVec
}

func initLeaseMetrics() {
	leaseMetrics.once.Do(func() {
		counter := func(name, help string) *prometheus.CounterVec {
			return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "caddy", Subsystem: "rate_limit_redis", Name: name, Help: help}, []string{"zone"})
		}
		leaseMetrics.grants = counter("lease_grants_total", "Grants of tokens this instance took from Redis for a lease zone's hot clients, by zone.")
		leaseMetrics.local = counter("lease_local_decisions_total", "Requests a lease zone admitted in process from a grant, with no Redis call for that zone, by zone.")
		leaseMetrics.returned = counter("lease_returned_units_total", "Tokens granted and not spent that this instance gave back to Redis when their grant ended, by zone.")
		leaseMetrics.stranded = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: "caddy", Subsystem: "rate_limit_redis", Name: "lease_stranded_units",
			Help: "Tokens granted to this instance and not yet spent, by zone: charged in Redis, unavailable to the other instances.",
		}, []string{"zone"})
	})
}

// leaseCollectors are the lease metrics, for registerMetrics.
func leaseCollectors() []prometheus.Collector {
	initLeaseMetrics()
	return []prometheus.Collector{leaseMetrics.grants, leaseMetrics.local, leaseMetrics.returned, leaseMetrics.stranded}
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
	initLeaseMetrics()
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
		grants:   leaseMetrics.grants.WithLabelValues(zone),
		local:    leaseMetrics.local.WithLabelValues(zone),
		returned: leaseMetrics.returned.WithLabelValues(zone),
		stranded: leaseMetrics.stranded.WithLabelValues(zone),
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
