package ratelimitredis

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// decideFlight decides f's requests and, when Redis fails, applies their zones' fail_mode.
// done is true when the request has been answered, err then being ServeHTTP's; otherwise f.d is
// the decision about f.decided.
func (h *Handler) decideFlight(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, f *flight) (done bool, err error) {
	f.d, err = h.limiter.Decide(r.Context(), f.reqs)
	if err == nil {
		h.observeLearnt(f.reqs)
		return false, nil
	}
	return h.failed(w, r, next, f, err)
}

// failed applies what a decision that failed with err calls for. A client that went away is
// not Redis failing: 499, no fail_mode, no failure counted (499 is what Caddy's reverse proxy
// reports for a client that closed the request). Otherwise the failure is counted, reported
// and logged, and the fail_mode of f's zones (failMode) answers: local decides f's local zones
// in process (done false: f.d and f.decided are set, and the request goes on as decided);
// closed refuses the request with 503 (a gRPC call with grpc-status UNAVAILABLE); open lets it
// through.
func (h *Handler) failed(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, f *flight, err error) (bool, error) {
	if r.Context().Err() != nil {
		return true, caddyhttp.Error(statusClientClosed, fmt.Errorf("client closed the request during the rate limit decision: %w", err))
	}
	reason := string(failureReason(err))
	metrics.backendFailures.WithLabelValues(reason).Inc()
	mode, first := h.failMode(f.reqs)
	h.events.failed(reason, mode, err)
	if c := h.logger.Check(zapcore.DebugLevel, "rate limit decision failed"); c != nil {
		c.Write(zap.String("reason", reason), zap.String("fail_mode", mode), zap.Error(err))
	}
	f.degraded = true
	if mode == FailLocal {
		var at []int
		f.decided, at = h.localZones(f.reqs)
		f.d = h.local.Allow(f.decided, h.clock())
		if at != nil {
			f.d.Zone = at[f.d.Zone] // an index of f.reqs, as a decision of Redis's
		}
		return false, nil
	}
	// Undecided, but the zone, its client and its configured limit are known: those of the
	// first zone whose fail_mode answers (the first closed zone of a 503).
	rq := f.reqs[first]
	f.zone, f.key, f.limit, f.identified = rq.Zone.Name, f.shown[first], rq.Zone.Quota(), true
	if mode == FailClosed {
		// The closed zones refuse the request; the others are not consulted (nor charged in
		// process), as the zones that did not deny a denied request.
		h.countMode(f.reqs, FailClosed, resultFailClosed)
		if h.DryRun {
			// Reported as the 503 it would have been ({http.rate_limit_redis.allowed} is false),
			// with no header: the 503 would carry only Retry-After.
			return true, next.ServeHTTP(w, r)
		}
		w.Header()[hdrRetryAfter] = []string{"1"}
		noStore(w)
		if h.grpcCall(r) {
			// UNAVAILABLE, after the second of Retry-After; Redis's error stays in the log.
			writeGRPCRefusal(w, grpcUnavailable, "zone "+f.zone+": rate limiter unavailable (fail_mode closed)", "1000")
			return true, nil
		}
		return true, caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("rate limiter unavailable (fail_mode closed): %w", err))
	}
	h.count(f.reqs, resultFailOpen)
	f.allowed = true
	if h.degradedHeader {
		w.Header()[hdrDegraded] = []string{"true"}
	}
	h.leaveWaiting(f)
	return true, next.ServeHTTP(w, r)
}

// failMode returns the fail_mode that applies to reqs when Redis fails: closed when any of
// their zones is closed, else local when any is local, else open; and first, the index in reqs
// of the first request whose zone has that fail_mode.
func (h *Handler) failMode(reqs []limiter.Request) (mode string, first int) {
	mode = FailOpen
	for i, rq := range reqs {
		switch h.Zones[rq.Tag].failMode {
		case FailClosed:
			return FailClosed, i
		case FailLocal:
			if mode != FailLocal {
				mode, first = FailLocal, i
			}
		}
	}
	return mode, first
}

// localZones returns the requests of reqs whose zone's fail_mode is local: those the
// in-process limiter decides when Redis fails. When they are not all of reqs, at gives the
// index in reqs of each; else local is reqs and at nil.
func (h *Handler) localZones(reqs []limiter.Request) (local []limiter.Request, at []int) {
	n := 0
	for _, rq := range reqs {
		if h.Zones[rq.Tag].failMode == FailLocal {
			n++
		}
	}
	if n == len(reqs) {
		return reqs, nil
	}
	local, at = make([]limiter.Request, 0, n), make([]int, 0, n)
	for i, rq := range reqs {
		if h.Zones[rq.Tag].failMode == FailLocal {
			local, at = append(local, rq), append(at, i)
		}
	}
	return local, at
}

// failure is why a Redis call failed: the reason label of backend_failures_total (a decision's)
// and settle_failures_total (a settlement's), and the reason of the log lines and events.
type failure string

// The reasons of a failed call.
const (
	failCircuitOpen failure = "circuit_open" // the circuit breaker was open: Redis was not called
	failTimeout     failure = "timeout"
	failBadResponse failure = "bad_response" // a reply of the wrong shape
	failOOM         failure = "oom"          // Redis over `maxmemory` refused the script, which writes
	failRedisError  failure = "redis_error"
	failNoHold      failure = "no_hold" // a settlement's hold was gone: settled already, older than hold_max, or reset
)

// decisionFailures are the reasons failureReason gives.
var decisionFailures = []failure{failTimeout, failBadResponse, failOOM, failRedisError, failCircuitOpen}

// failureReason classifies a decision error (one of decisionFailures).
func failureReason(err error) failure {
	switch {
	case isBreakerOpen(err):
		return failCircuitOpen
	case errors.Is(err, context.DeadlineExceeded):
		return failTimeout
	case errors.Is(err, limiter.ErrBadResponse):
		return failBadResponse
	case redis.HasErrorPrefix(err, "OOM"):
		return failOOM
	}
	var ne interface{ Timeout() bool }
	if errors.As(err, &ne) && ne.Timeout() {
		return failTimeout
	}
	return failRedisError
}
