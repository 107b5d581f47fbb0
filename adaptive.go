package ratelimitredis

import (
	"errors"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// Adaptive concurrency zones (algorithm adaptive_concurrency): a concurrency zone whose limit,
// at most `limit`, is learnt in Redis from the latency of the requests it admits (the
// controller: internal/limiter/adaptive.go). Here a request's latency is measured, from the
// moment it is passed on to the first response header (for a stream, its first byte), and
// reported with the settlement that gives its slot back; a 5xx or an upstream error counts as a
// failure. A client that left before any header reports nothing. The limit in force and the
// latencies it was learnt from are exported as gauges after each decision. See docs/adaptive.md.

// limiterAdaptive returns the zone's controller for lz: its own numbers, each default in place of
// one left out, for an adaptive_concurrency zone; for another algorithm, the numbers given (nil
// when none is), which the limiter's validation refuses.
func (z *Zone) limiterAdaptive(lz limiter.Zone) *limiter.Adaptive {
	a := limiter.Adaptive{MinLimit: int64(z.MinLimit), Buffer: z.Buffer, UpdateInterval: time.Duration(z.UpdateInterval),
		ProbeInterval: time.Duration(z.ProbeInterval), ProbeSamples: int64(z.ProbeSamples)}
	switch {
	case lz.Algorithm.Adapts():
		a = a.WithDefaults(lz.Limit)
	case a == limiter.Adaptive{}:
		return nil
	}
	return &a
}

// validateAdaptive refuses a limit from a placeholder on an adaptive_concurrency zone: its
// learnt limit is one for every request of a client, within one ceiling.
func (z *Zone) validateAdaptive(lz limiter.Zone) error {
	if !lz.Algorithm.Adapts() {
		return nil
	}
	if ph, _ := z.Limit.placeholder(); ph {
		return z.fieldError("limit", "limit of algorithm adaptive_concurrency must be a literal: its learnt limit is one per client, within one ceiling")
	}
	return nil
}

// learntGauges are an adaptive_concurrency zone's gauges: the limit in force and the latencies
// it was learnt from, as the last decision read them.
type learntGauges struct {
	limit, minLatency, latency prometheus.Gauge
}

// provisionLearnt provisions the gauges of an adaptive_concurrency zone.
func (z *Zone) provisionLearnt() {
	if !z.lz.Algorithm.Adapts() || !limiter.ValidZoneName(z.Name) {
		return
	}
	initMetrics()
	z.learnt = &learntGauges{
		limit:      metrics.concurrencyLimit.WithLabelValues(z.Name),
		minLatency: metrics.adaptiveMinLatency.WithLabelValues(z.Name),
		latency:    metrics.adaptiveLatency.WithLabelValues(z.Name),
	}
}

// observeLearnt sets the gauges of the adaptive_concurrency zones of reqs, just decided, to what
// the decision read.
func (h *Handler) observeLearnt(reqs []limiter.Request) {
	for _, rq := range reqs {
		g := h.Zones[rq.Tag].learnt
		if g == nil || rq.Result.Learnt.Limit == 0 {
			continue
		}
		g.limit.Set(float64(rq.Result.Learnt.Limit))
		if l := rq.Result.Learnt.MinLatency; l > 0 {
			g.minLatency.Set(l.Seconds())
		}
		if l := rq.Result.Learnt.Latency; l > 0 {
			g.latency.Set(l.Seconds())
		}
	}
}

// sampleLatency reports to held the latency of the response cw saw (served from cw.start; err is
// the handlers' error), unless its client left before any header: the time to the first header,
// or to the handlers' return when none was written (an error the error routes answer), failed
// for a 5xx or an error a handler returned.
func sampleLatency(held *limiter.Held, cw *chargeWriter, err error) {
	if cw.start.IsZero() || cw.clientLeft {
		return
	}
	at := cw.headerAt
	if at.IsZero() {
		at = time.Now()
	}
	var he caddyhttp.HandlerError
	failed := cw.status >= http.StatusInternalServerError || err != nil && !(errors.As(err, &he) && he.StatusCode < 500 && he.StatusCode != 0)
	held.Sample(at.Sub(cw.start), failed)
}
