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

// admit lets an allowed request through: it counts the decision (each zone what its own
// fail_mode did, when Redis failed), holds the request for its delay (max_wait; a client that
// leaves meanwhile ends it with 499, settled as such), gives back its waiting place, and passes
// it on, settling its zones' charges after the response when they are held (charge.go).
func (h *Handler) admit(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, f *flight) error {
	d := &f.d
	z := h.decidingZone(f)
	h.nearLimit(f)
	res := resultAllowed
	if d.Delay > 0 {
		res = resultDelayed
		if z.delays != nil {
			z.delays.Observe(d.Delay.Seconds())
		}
	}
	if f.degraded {
		// Local zones admitted in process, open zones let the request through.
		h.countMode(f.reqs, FailLocal, resultLocal)
		h.countMode(f.reqs, FailOpen, resultFailOpen)
	} else {
		h.countAdmitted(f.reqs, res)
	}
	if d.Held != nil {
		slotsTaken(h, f.reqs) // given back by the settlement, on every way out
	}
	if d.Delay > 0 && !h.DryRun {
		h.holdWaiting(f)
		if err := h.hold(r.Context(), d.Delay, &f.outcome); err != nil {
			if d.Held != nil {
				// Settled as the 499 it is (count_status gives it back unless it lists 499;
				// charge keeps the reservation), not left held until hold_max.
				var charged *int64
				h.settleResponse(r, &chargeWriter{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}}, f.reqs, d.Held, err, &charged)
			}
			return err
		}
	}
	h.leaveWaiting(f)
	if d.Held != nil {
		if !h.DryRun && !f.degraded {
			h.capOutput(r, f.repl, f.reqs)
		}
		return h.serveAndSettle(w, r, next, f.reqs, f.d, f.repl)
	}
	if f.degraded && anyAlgorithm(f.decided, limiter.Algorithm.HoldsSlots) {
		return h.serveLocalSlots(w, r, next, f.decided)
	}
	return next.ServeHTTP(w, r)
}

// hold holds the request for delay, its turn, on a timer; or until its client goes away, which
// ends it at once with 499: its tokens stay spent (Redis charged them when it admitted the
// request, as for any request whose client leaves), and out.waited is then the time it was held.
func (h *Handler) hold(ctx context.Context, delay time.Duration, out *outcome) error {
	metrics.waiting.Inc()
	defer metrics.waiting.Dec()
	start := time.Now()
	t := time.NewTimer(delay)
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		t.Stop()
		out.waited = limiter.CeilMs(time.Since(start))
		if c := h.logger.Check(zapcore.DebugLevel, "client left while held for its turn"); c != nil {
			c.Write(zap.String("zone", out.zone), zap.Int64("delay_ms", limiter.CeilMs(delay)), zap.Int64("waited_ms", out.waited))
		}
		// As a denial: built directly, no stack trace; 499 is what Caddy's reverse proxy reports
		// for a client that closed the request.
		return caddyhttp.HandlerError{StatusCode: statusClientClosed, Err: errLeftWhileHeld}
	}
}
