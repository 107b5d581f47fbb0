package ratelimitredis

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
)

// Placeholders set on every request a zone applies to, for logs, handle_errors and later
// handlers.
const (
	phAllowed    = "http.rate_limit_redis.allowed"     // true or false (false in dry_run too, when it would be denied)
	phZone       = "http.rate_limit_redis.zone"        // the deciding zone's name
	phKey        = "http.rate_limit_redis.key"         // the deciding zone's client key, as resolved
	phLimit      = "http.rate_limit_redis.limit"       // the deciding zone's capacity or limit
	phRemaining  = "http.rate_limit_redis.remaining"   // tokens or slots left
	phReset      = "http.rate_limit_redis.reset"       // seconds until the zone is full again, rounded up
	phRetryAfter = "http.rate_limit_redis.retry_after" // seconds until a denied request would pass, rounded up; 0 when allowed
	phDegraded   = "http.rate_limit_redis.degraded"    // true when Redis failed and fail_mode decided
)

// errCost is returned (as a 400) when a zone's cost placeholder resolves to something other than
// a positive integer.
var errCost = errors.New("the request's cost is not a positive integer")

// ServeHTTP decides the request against every zone that applies to it with one Redis call, sets
// the headers and placeholders, and either passes the request on or returns a 429 HandlerError
// (writing no body, so that handle_errors can shape the response).
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if repl == nil {
		repl = caddy.NewReplacer()
	}
	reqs := make([]limiter.Request, 0, len(h.Zones))
	for _, z := range h.Zones {
		if len(z.matcherSets) > 0 {
			match, err := z.matcherSets.AnyMatchWithError(r)
			if err != nil {
				return caddyhttp.Error(http.StatusInternalServerError, fmt.Errorf("zone %s: matching: %w", z.Name, err))
			}
			if !match {
				continue
			}
		}
		cost, err := z.cost(repl)
		if err != nil {
			if !h.DryRun {
				return caddyhttp.Error(http.StatusBadRequest, fmt.Errorf("zone %s: %w", z.Name, err))
			}
			cost = 1 // dry_run never rejects: count the request as one
		}
		reqs = append(reqs, limiter.Request{Zone: &z.lz, Key: z.clientKey(repl), Cost: cost})
	}
	if len(reqs) == 0 {
		return next.ServeHTTP(w, r)
	}

	d, err := h.decide(r.Context(), reqs)
	degraded := false
	if err != nil {
		if r.Context().Err() != nil {
			// The client went away, not Redis: no fail_mode, no failure counted. 499 is what
			// Caddy's reverse proxy reports for a client that closed the request.
			return caddyhttp.Error(499, fmt.Errorf("client closed the request during the rate limit decision: %w", err))
		}
		reason := failureReason(err)
		metrics.backendFailures.WithLabelValues(reason).Inc()
		if c := h.logger.Check(zapcore.DebugLevel, "rate limit decision failed"); c != nil {
			c.Write(zap.String("reason", reason), zap.String("fail_mode", h.FailMode), zap.Error(err))
		}
		repl.Set(phDegraded, true)
		switch {
		case h.FailMode == FailLocal:
			d, degraded = h.local.Allow(reqs, time.Now()), true
		case h.FailMode == FailClosed && !h.DryRun:
			repl.Set(phAllowed, false)
			w.Header().Set("Retry-After", "1")
			return caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("rate limiter unavailable (fail_mode closed): %w", err))
		default: // open, or closed in dry_run, which never rejects
			repl.Set(phAllowed, true)
			if h.Headers != HeadersOff {
				w.Header().Set("X-RateLimit-Degraded", "true")
			}
			return next.ServeHTTP(w, r)
		}
	}

	retryAfter := seconds(d.RetryAfter)
	zone := reqs[d.Zone].Zone
	repl.Set(phAllowed, d.Allowed)
	repl.Set(phZone, zone.Name)
	repl.Set(phKey, reqs[d.Zone].Key)
	repl.Set(phLimit, d.Limit)
	repl.Set(phRemaining, d.Remaining)
	repl.Set(phReset, seconds(d.Reset))
	repl.Set(phRetryAfter, retryAfter)
	repl.Set(phDegraded, degraded)
	h.setRateLimitHeaders(w.Header(), zone, d)
	if degraded && h.Headers != HeadersOff {
		w.Header().Set("X-RateLimit-Degraded", "true")
	}

	if d.Allowed {
		return next.ServeHTTP(w, r)
	}
	if d.Cached {
		metrics.denyCacheHits.Inc()
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limited"); c != nil {
		c.Write(zap.String("zone", zone.Name), zap.Bool("dry_run", h.DryRun), zap.Bool("local", degraded), zap.Bool("cached", d.Cached),
			zap.Int64("limit", d.Limit), zap.Int64("retry_after", retryAfter), zap.Bool("unsatisfiable", d.Unsatisfiable))
	}
	if h.DryRun {
		return next.ServeHTTP(w, r)
	}
	if d.Unsatisfiable {
		// The cost exceeds the zone's quota: waiting never cures it, so no Retry-After.
		return caddyhttp.Error(http.StatusTooManyRequests, fmt.Errorf("zone %s: cost exceeds the zone's quota of %d", zone.Name, d.Limit))
	}
	w.Header().Set("Retry-After", strconv.FormatInt(max(retryAfter, 1), 10))
	return caddyhttp.Error(http.StatusTooManyRequests, fmt.Errorf("zone %s: rate limit exceeded", zone.Name))
}

// decide runs the decision on Redis through the client's circuit breaker, under the handler's
// timeout. While the breaker is open it fails at once without calling Redis.
func (h *Handler) decide(ctx context.Context, reqs []limiter.Request) (limiter.Decision, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Duration(h.Timeout))
	defer cancel()
	return h.client.breaker.Execute(func() (limiter.Decision, error) {
		d, err := h.limiter.Allow(ctx, reqs)
		if err != nil {
			h.client.lastReason.Store(failureReason(err))
		}
		return d, err
	})
}

// failureReason classifies a decision error: circuit_open, timeout, bad_response or redis_error.
func failureReason(err error) string {
	switch {
	case isBreakerOpen(err):
		return "circuit_open"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, limiter.ErrBadResponse):
		return "bad_response"
	}
	var ne interface{ Timeout() bool }
	if errors.As(err, &ne) && ne.Timeout() {
		return "timeout"
	}
	return "redis_error"
}

// setRateLimitHeaders sets the response headers chosen by Headers from the deciding zone:
// legacy X-RateLimit-Limit, -Remaining and -Reset (seconds), and the IETF httpapi
// ratelimit-headers draft's RateLimit-Policy (`"<zone>";q=<quota>;w=<window s>`) and RateLimit
// (`"<zone>";r=<remaining>;t=<reset s>`).
func (h *Handler) setRateLimitHeaders(hdr http.Header, z *limiter.Zone, d limiter.Decision) {
	reset := strconv.FormatInt(seconds(d.Reset), 10)
	remaining := strconv.FormatInt(d.Remaining, 10)
	limit := strconv.FormatInt(d.Limit, 10)
	if h.Headers == HeadersLegacy || h.Headers == HeadersBoth {
		hdr.Set("X-RateLimit-Limit", limit)
		hdr.Set("X-RateLimit-Remaining", remaining)
		hdr.Set("X-RateLimit-Reset", reset)
	}
	if h.Headers == HeadersIETF || h.Headers == HeadersBoth {
		name := `"` + z.Name + `"` // zone names are [A-Za-z0-9_.-]: no quoting needed inside
		hdr.Set("RateLimit-Policy", name+";q="+limit+";w="+strconv.FormatInt(seconds(z.PolicyWindow()), 10))
		hdr.Set("RateLimit", name+";r="+remaining+";t="+reset)
	}
}

// seconds rounds d up to whole seconds.
func seconds(d time.Duration) int64 {
	s := int64(d / time.Second)
	if d%time.Second > 0 {
		s++
	}
	return s
}

// clientKey resolves the zone's key placeholders: the first that is not empty wins. All empty
// gives "", which the limiter counts under the zone's one shared key.
func (z *Zone) clientKey(repl *caddy.Replacer) string {
	for _, k := range z.Key {
		if v := repl.ReplaceAll(k, ""); v != "" {
			return v
		}
	}
	return ""
}

// cost resolves the request's cost: the literal, or the placeholder's value; empty counts as 1.
// Anything but a positive integer is errCost.
func (z *Zone) cost(repl *caddy.Replacer) (int64, error) {
	if z.fixedCost > 0 {
		return z.fixedCost, nil
	}
	v := repl.ReplaceAll(z.Cost, "")
	if v == "" {
		return 1, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 1 {
		return 0, errCost
	}
	return n, nil
}
