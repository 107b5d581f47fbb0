package ratelimitredis

import (
	"context"
	"net/http"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// Concurrency zones (algorithm concurrency): a request takes one of its client's `limit` slots
// at admission, as a hold of the zone for hold_max, and gives it back through the
// settlement of charge.go once its response is complete: after the last byte, when the client
// goes away, on an upstream error, or when a handler panics (serveAndSettle). While it runs, the
// handler's refresher (refreshSlots) gives its slot a new deadline every third of hold_max, so
// that a long response keeps it, and an instance that dies holds it at most hold_max. Under
// fail_mode local, a semaphore per client in process (limiter.Local) stands in for Redis. See
// docs/decisions.md.

// MinSlotHold bounds a concurrency zone's hold_max from below: its slots are refreshed every
// third of it, on a ticker of a sixth.
const MinSlotHold = time.Second

// provisionSlots provisions a concurrency zone's slot hold time (hold_max, default DefaultHoldMax)
// and its in-flight gauge.
func (z *Zone) provisionSlots() error {
	a := &afterResponse{hold: time.Duration(z.HoldMax)}
	if a.hold == 0 {
		a.hold = DefaultHoldMax
	}
	if limiter.ValidZoneName(z.Name) {
		initMetrics()
		a.inFlight = metrics.inFlight.WithLabelValues(z.Name)
		exportSettleFailures()
	}
	z.after = a
	return nil
}

// anyAlgorithm reports whether the algorithm of a zone of reqs has the property has
// (limiter.Algorithm.HoldsSlots: a concurrency zone; Adapts: an adaptive one).
func anyAlgorithm(reqs []limiter.Request, has func(limiter.Algorithm) bool) bool {
	for _, rq := range reqs {
		if has(rq.Zone.Algorithm) {
			return true
		}
	}
	return false
}

// slotsTaken counts the slots of reqs's concurrency zones as held by this instance (the
// in-flight gauge); slotsDone as given back.
func slotsTaken(h *Handler, reqs []limiter.Request) { addSlots(h, reqs, 1) }
func slotsDone(h *Handler, reqs []limiter.Request)  { addSlots(h, reqs, -1) }

func addSlots(h *Handler, reqs []limiter.Request, n float64) {
	for _, rq := range reqs {
		if !rq.Zone.Algorithm.HoldsSlots() {
			continue
		}
		if a := h.Zones[rq.Tag].after; a != nil && a.inFlight != nil {
			a.inFlight.Add(n)
		}
	}
}

// serveLocalSlots passes on a request that fail_mode local admitted (reqs, decided in process),
// and gives back its concurrency zones' slots in process once the response is complete, or the
// handler panics.
func (h *Handler) serveLocalSlots(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, reqs []limiter.Request) error {
	slotsTaken(h, reqs)
	defer func() {
		h.local.Release(reqs)
		slotsDone(h, reqs)
	}()
	return next.ServeHTTP(w, r)
}

// startRefresher starts the goroutine that keeps the handler's concurrency slots alive
// (refreshSlots), when a zone is a concurrency zone; Cleanup stops it.
func (h *Handler) startRefresher() {
	hold := time.Duration(0)
	for _, z := range h.Zones {
		if z.lz.Algorithm.HoldsSlots() && z.after != nil && (hold == 0 || z.after.hold < hold) {
			hold = z.after.hold
		}
	}
	if hold == 0 {
		return
	}
	h.stopRefresh = make(chan struct{})
	go h.refreshSlots(h.limiter, min(limiter.RefreshEvery(hold)/2, time.Second), h.stopRefresh)
}

// refreshSlots runs l.Refresh every tick (at most half the shortest RefreshEvery), until stop is
// closed and no slot is left in flight or lost and no request waits in a queue: a request still
// running when the config is reloaded keeps its slot, a request waiting keeps the slot it is
// granted, and the slots of its decisions and settlements that failed are given back. A failed
// refresh is retried on the next tick, and logged at most once a minute: a slot survives
// refreshes failing for half its hold time. The waiters' leases are the Limiter's own (Enqueue).
func (h *Handler) refreshSlots(l *limiter.Limiter, tick time.Duration, stop <-chan struct{}) {
	t := time.NewTicker(tick)
	defer t.Stop()
	stopped := false
	var warned time.Time
	for {
		select {
		case <-stop:
			stopped, stop = true, nil
		case <-t.C:
		}
		if stopped && l.LiveSlots() == 0 && l.LostSlots() == 0 && l.Waiting() == 0 {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), max(tick, time.Duration(h.Timeout)))
		_, err := l.Refresh(ctx)
		cancel()
		if err != nil && time.Since(warned) >= time.Minute {
			warned = time.Now()
			if c := h.logger.Check(zapcore.WarnLevel, "refreshing concurrency slots failed; a slot not refreshed frees itself hold_max after its last refresh"); c != nil {
				c.Write(zap.Error(err))
			}
		}
	}
}
