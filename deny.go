package ratelimitredis

import (
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// deny answers a denied request: only the deciding zone counts it (the others were not
// charged; counted as blocked when its penalty box refused it), a block it started is reported
// as an event, it is logged at debug level and reported as an event, and it is refused with 429
// and Retry-After (none when waiting can never cure it: the cost exceeds the zone's quota),
// and X-Should-Retry: false when the wait is longer than the zone's no_retry_over or cannot
// end; or, a gRPC call, with grpc-status RESOURCE_EXHAUSTED and the wait as
// grpc-retry-pushback-ms. In
// dry_run it is passed on instead, decided, charged, counted, headed and reported exactly as
// enforced, without Retry-After: it belongs to a rejection, and a client that honours it on any
// response would slow down, which dry_run must not cause.
func (h *Handler) deny(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, f *flight) error {
	d := &f.d
	z := h.decidingZone(f)
	h.countShadow(f.reqs) // the shadow zones that would have denied it too
	switch {
	case h.DryRun:
		z.decisions[resultDryRunDenied].Inc()
	case f.degraded:
		z.decisions[resultLocalDenied].Inc()
	case d.Blocked:
		z.decisions[resultBlocked].Inc()
	case f.waitTimeout:
		z.decisions[resultWaitTimeout].Inc()
	case f.evicted:
		z.decisions[resultEvicted].Inc()
	default:
		z.decisions[resultDenied].Inc()
	}
	if d.Cached {
		metrics.denyCacheHits.Inc()
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limited"); c != nil {
		h.logDenial(c, &f.outcome, f.d, f.noWait)
	}
	h.events.exceeded(h, r, &f.outcome, f.d)
	h.events.blocked(h, r, f)
	if h.DryRun {
		return next.ServeHTTP(w, r)
	}
	err := z.errLimited
	if d.Unsatisfiable {
		err = z.errUnsatisfiableOf(f.reqs[d.Zone].Zone)
	} else {
		w.Header()[hdrRetryAfter] = []string{strconv.FormatInt(f.retryAfter, 10)}
	}
	noStore(w)
	if h.grpcCall(r) {
		// RESOURCE_EXHAUSTED, written here: handle_errors cannot shape a gRPC response (grpc.go).
		writeGRPCRefusal(w, grpcResourceExhausted, err.Error(), grpcPushback(limiter.CeilMs(d.RetryAfter), f.retryAfter, d.Unsatisfiable))
		return nil
	}
	if z.noRetryOver > 0 && (d.Unsatisfiable || time.Duration(f.retryAfter)*time.Second > z.noRetryOver) {
		// The OpenAI and Anthropic SDKs would sleep the whole wait, then retry: they fail at once.
		w.Header()[hdrShouldRetry] = []string{"false"}
	}
	if h.bareDenials {
		// No handle_errors to shape it: the response Caddy's error path would write, cheaper.
		w.WriteHeader(http.StatusTooManyRequests)
		return nil
	}
	// Built directly rather than with caddyhttp.Error, which records a stack trace per call: a
	// denial is routine, and its origin is always here.
	return caddyhttp.HandlerError{StatusCode: http.StatusTooManyRequests, Err: err}
}

// logDenial writes the debug line of a denial: the deciding zone, its quota, the wait, how it
// was decided (waiting_full: without max_wait, no place to wait left for it), and the client
// key only when log_key is on.
func (h *Handler) logDenial(c *zapcore.CheckedEntry, out *outcome, d limiter.Decision, noWait bool) {
	fields := []zap.Field{
		zap.String("zone", out.zone), zap.Int64("limit", out.limit), zap.Int64("remaining", out.remaining),
		zap.Int64("retry_after", out.retryAfter), zap.Bool("unsatisfiable", d.Unsatisfiable),
		zap.Bool("cached", d.Cached), zap.Bool("local", out.degraded), zap.Bool("dry_run", h.DryRun),
	}
	if noWait {
		// Decided without max_wait: no place left for it (max_waiting, or its share).
		fields = append(fields, zap.Bool("waiting_full", true))
	}
	if h.LogKey {
		fields = append(fields, zap.String("key", out.key))
	}
	c.Write(fields...)
}
