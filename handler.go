package ratelimitredis

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
)

// errCost is returned (as a 400) when a zone's cost placeholder resolves to something other than
// a positive integer.
var errCost = errors.New("the request's cost is not a positive integer")

// errLeftWhileHeld ends (as a 499) a request whose client went away while it was held for its
// turn (max_wait).
var errLeftWhileHeld = errors.New("client closed the request while it was held for its turn (max_wait); its tokens stay spent")

// Response header names, canonical already so that setting them costs no canonicalisation.
var (
	hdrLimit      = http.CanonicalHeaderKey("X-RateLimit-Limit")
	hdrRemaining  = http.CanonicalHeaderKey("X-RateLimit-Remaining")
	hdrReset      = http.CanonicalHeaderKey("X-RateLimit-Reset")
	hdrDegraded   = http.CanonicalHeaderKey("X-RateLimit-Degraded")
	hdrPolicy     = http.CanonicalHeaderKey("RateLimit-Policy")
	hdrRateLimit  = http.CanonicalHeaderKey("RateLimit")
	hdrRetryAfter = http.CanonicalHeaderKey("Retry-After")
)

// ServeHTTP decides the request against every zone that applies to it with one Redis call (none
// when the deny cache covers it), sets the headers and placeholders, and either passes the
// request on or denies it with 429: a HandlerError and no body, so that handle_errors can shape
// the response, or, when the server has no handle_errors routes, the bare 429 written here.
// Every decision is counted in decisions_total by result (see metrics.go). With dry_run the
// request is decided, charged, headed (Retry-After aside), reported and counted as enforced,
// and always passed on.
//
// A request admitted with a delay (a zone's max_wait) is held here for it, then passed on; a
// client that goes away meanwhile ends it at once with 499. At most MaxWaiting requests are
// held at once (see takeWaitingPlace); dry_run never holds.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if repl == nil {
		repl = caddy.NewReplacer()
	}
	// On the stack for up to 4 zones: the requests do not outlive the call.
	var reqsBuf [4]limiter.Request
	reqs := reqsBuf[:0]
	// The client keys as the placeholder shows them, per request of reqs: with key_secret,
	// reqs hold their keyed digests instead. Memoised: zones usually share their key.
	var shownBuf [8]string
	shown := shownBuf[:0]
	var lastShown, lastKey string // the previous zone's, when keyed is true
	keyed := false
	var masked maskMemo // the previous IP candidate masked: zones usually share their key
	shaping := false    // a zone of reqs may hold the request (max_wait)
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
		key := z.clientKey(repl, &masked)
		if key == "" {
			z.emptyKeys.Inc()
			switch z.EmptyKey {
			case EmptyKeySkip:
				continue
			case EmptyKeyDeny:
				return h.denyEmptyKey(w, r, next, z, repl)
			}
		}
		lz, err := z.numbers(repl)
		if err != nil {
			// A number from a placeholder that is empty without a fallback, does not parse or
			// is out of range: the server's configuration (or what feeds the placeholder) is
			// wrong, not the client. 500 before any decision, nothing charged. Logged here at
			// error level: Caddy logs a handler's error at debug level only when the server
			// has handle_errors routes.
			if c := h.logger.Check(zapcore.ErrorLevel, "a zone number from a placeholder is unusable"); c != nil {
				c.Write(zap.String("zone", z.Name), zap.Bool("dry_run", h.DryRun), zap.Error(err))
			}
			if h.DryRun {
				return next.ServeHTTP(w, r)
			}
			return caddyhttp.Error(http.StatusInternalServerError, err)
		}
		cost, err := z.cost(repl)
		if err != nil {
			err = fmt.Errorf("zone %s: %w", z.Name, err)
			if h.DryRun {
				// Enforced, this is a 400 before any decision: no zone decides or is charged,
				// and nothing is counted. dry_run only lets the request through.
				if c := h.logger.Check(zapcore.DebugLevel, "bad request cost; dry_run lets it through"); c != nil {
					c.Write(zap.Error(err))
				}
				return next.ServeHTTP(w, r)
			}
			return caddyhttp.Error(http.StatusBadRequest, err)
		}
		shown = append(shown, key)
		if h.keySecret != nil {
			if !keyed || key != lastShown {
				lastShown, lastKey, keyed = key, h.keySecret.Key(key), true
			}
			key = lastKey
		}
		rq := limiter.Request{Zone: lz, Key: key, Cost: cost}
		if z.after != nil {
			rq.Hold = z.after.hold // settled after the response: charge.go
		}
		reqs = append(reqs, rq)
		shaping = shaping || lz.MaxWait > 0
	}
	if len(reqs) == 0 {
		return next.ServeHTTP(w, r)
	}

	out := new(outcome)
	out.publish(repl)
	// A request that may be held takes its place among the held before it is decided, so that
	// no more than MaxWaiting are ever held; with none left for it (or its client's share of
	// them taken: waiting.go) it is decided without waiting.
	placed, noWait := placeNone, false
	if shaping && !h.DryRun {
		placed = h.takeWaitingPlace(r.Context(), reqs)
		noWait = placed == placeNone
		for i := range reqs {
			reqs[i].NoWait = noWait
		}
	}
	defer h.leaveWaiting(&placed, reqs)
	d, err := h.decide(r.Context(), reqs)
	decided := reqs // the zones d is about
	if err != nil {
		if r.Context().Err() != nil {
			// The client went away, not Redis: no fail_mode, no failure counted. 499 is what
			// Caddy's reverse proxy reports for a client that closed the request.
			return caddyhttp.Error(499, fmt.Errorf("client closed the request during the rate limit decision: %w", err))
		}
		reason := failureReason(err)
		metrics.backendFailures.WithLabelValues(reason).Inc()
		mode := h.failMode(reqs)
		h.events.failed(reason, mode, err)
		if c := h.logger.Check(zapcore.DebugLevel, "rate limit decision failed"); c != nil {
			c.Write(zap.String("reason", reason), zap.String("fail_mode", mode), zap.Error(err))
		}
		out.degraded = true
		if mode != FailLocal {
			// Undecided, but the zone, its client and its configured limit are known: those
			// of the first zone whose fail_mode answers (the first closed zone of a 503).
			i := slices.IndexFunc(reqs, func(rq limiter.Request) bool { return h.zoneOf(rq.Zone).failMode == mode })
			out.zone, out.key, out.limit, out.identified = reqs[i].Zone.Name, shown[i], reqs[i].Zone.Quota(), true
		}
		switch mode {
		case FailLocal:
			decided = h.localZones(reqs)
			d = h.local.Allow(decided, time.Now())
		case FailClosed:
			// The closed zones refuse the request; the others are not consulted (nor charged
			// in process), as the zones that did not deny a denied request.
			h.countMode(reqs, FailClosed, resultFailClosed)
			if h.DryRun {
				// Reported as the 503 it would have been ({http.rate_limit_redis.allowed} is
				// false), with no header: the 503 would carry only Retry-After.
				return next.ServeHTTP(w, r)
			}
			w.Header()[hdrRetryAfter] = []string{"1"}
			return caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("rate limiter unavailable (fail_mode closed): %w", err))
		default: // open
			h.count(reqs, resultFailOpen)
			out.allowed = true
			if h.degradedHeader {
				w.Header()[hdrDegraded] = []string{"true"}
			}
			h.leaveWaiting(&placed, reqs)
			return next.ServeHTTP(w, r)
		}
	}
	hold := d.Allowed && d.Delay > 0 && !h.DryRun
	if hold {
		h.holdWaiting(&placed, reqs)
		// The headers describe the zone when the response leaves, after the hold.
		d.Reset, d.Next = max(0, d.Reset-d.Delay), max(0, d.Next-d.Delay)
	}

	if !out.degraded && !d.Cached {
		h.events.succeeded() // Redis answered
	}
	if d.Err != nil {
		// A Redis Cluster slot failed while another denied the request: the denial stands.
		metrics.backendFailures.WithLabelValues(failureReason(d.Err)).Inc()
		if c := h.logger.Check(zapcore.DebugLevel, "rate limit decision failed in one hash slot; another slot's denial stands"); c != nil {
			c.Write(zap.String("reason", failureReason(d.Err)), zap.Error(d.Err))
		}
	}
	zone := decided[d.Zone].Zone
	z := h.Zones[zoneIndex(h.Zones, zone)]
	*out = outcome{
		allowed: d.Allowed, degraded: out.degraded, decided: true,
		zone: zone.Name, key: shown[slices.IndexFunc(reqs, func(r limiter.Request) bool { return r.Zone == zone })],
		limit: d.Limit, remaining: d.Remaining,
		reset: seconds(d.Reset), retryAfter: seconds(d.RetryAfter), waited: ceilMs(d.Delay),
	}
	h.setRateLimitHeaders(w.Header(), reqs, z, zone, d, out)
	if !d.Allowed && !d.Unsatisfiable {
		// The Retry-After of the 429 (and the placeholder, which handle_errors may show the
		// client): the exact wait, at least 1, plus the deciding zone's jitter. The deny cache
		// and the RateLimit fields keep the exact wait.
		out.retryAfter = max(out.retryAfter, 1)
		if z.jitter > 0 {
			out.retryAfter += rand.Int64N(z.jitter + 1)
		}
	}

	if d.Allowed {
		res := resultAllowed
		if d.Delay > 0 {
			res = resultDelayed
			if z.delays != nil {
				z.delays.Observe(d.Delay.Seconds())
			}
		}
		if out.degraded {
			// Each zone counts what its own fail_mode did: local zones admitted in process,
			// open zones let the request through.
			h.countMode(reqs, FailLocal, resultLocal)
			h.countMode(reqs, FailOpen, resultFailOpen)
		} else {
			h.count(reqs, res)
		}
		if hold {
			if err := h.hold(r.Context(), d.Delay, out); err != nil {
				if d.Held != nil {
					// Settled as the 499 it is (count_status gives it back unless it lists 499;
					// charge keeps the reservation), not left held until hold_max.
					var charged *int64
					h.settleResponse(r, &chargeWriter{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}}, reqs, d.Held, err, &charged)
				}
				return err
			}
		}
		h.leaveWaiting(&placed, reqs)
		if d.Held != nil {
			return h.serveAndSettle(w, r, next, reqs, d, repl)
		}
		return next.ServeHTTP(w, r)
	}
	h.leaveWaiting(&placed, reqs)
	// Denied: only the deciding zone counts; the others were not charged.
	switch {
	case h.DryRun:
		z.decisions[resultDryRunDenied].Inc()
	case out.degraded:
		z.decisions[resultLocalDenied].Inc()
	default:
		z.decisions[resultDenied].Inc()
	}
	if d.Cached {
		metrics.denyCacheHits.Inc()
	}
	if c := h.logger.Check(zapcore.DebugLevel, "rate limited"); c != nil {
		h.logDenial(c, out, d, noWait)
	}
	h.events.exceeded(h, out, d)
	if h.DryRun {
		// Decided, charged, counted, headed and reported exactly as enforced, but let through.
		// Retry-After is left out: it belongs to a rejection, and a client that honours it on
		// any response would slow down, which dry_run must not cause.
		return next.ServeHTTP(w, r)
	}
	err = z.errLimited
	if d.Unsatisfiable {
		// The cost exceeds the zone's quota: waiting never cures it, so no Retry-After.
		err = z.errUnsatisfiableOf(zone)
	} else {
		w.Header()[hdrRetryAfter] = []string{strconv.FormatInt(out.retryAfter, 10)}
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
		out.waited = ceilMs(time.Since(start))
		if c := h.logger.Check(zapcore.DebugLevel, "client left while held for its turn"); c != nil {
			c.Write(zap.String("zone", out.zone), zap.Int64("delay_ms", ceilMs(delay)), zap.Int64("waited_ms", out.waited))
		}
		// As a denial: built directly, no stack trace; 499 is what Caddy's reverse proxy reports
		// for a client that closed the request.
		return caddyhttp.HandlerError{StatusCode: 499, Err: errLeftWhileHeld}
	}
}

// denyEmptyKey rejects a request whose key placeholders are all empty in zone z, whose
// empty_key is deny: 403 with no body (or, in dry_run, passed on), before any decision, so no
// zone is charged or counted in decisions_total ({http.rate_limit_redis.allowed} is false).
func (h *Handler) denyEmptyKey(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, z *Zone, repl *caddy.Replacer) error {
	new(outcome).publish(repl)
	if c := h.logger.Check(zapcore.DebugLevel, "empty client key denied"); c != nil {
		c.Write(zap.String("zone", z.Name), zap.Bool("dry_run", h.DryRun))
	}
	if h.DryRun {
		return next.ServeHTTP(w, r)
	}
	if h.bareDenials {
		w.WriteHeader(http.StatusForbidden)
		return nil
	}
	return caddyhttp.HandlerError{StatusCode: http.StatusForbidden, Err: z.errEmptyKey}
}

// decide returns the deny cache's decision when it covers the request, else runs the decision
// on Redis through the circuit breakers of the Redis servers it needs (see
// sharedClient.acquire), under the handler's timeout. While a breaker is open it fails at once
// without calling Redis.
func (h *Handler) decide(ctx context.Context, reqs []limiter.Request) (d limiter.Decision, err error) {
	// A remembered denial holds whatever Redis's state: no call, and no breaker to consult.
	if d, ok := h.limiter.Denied(reqs); ok {
		return d, nil
	}
	start := time.Now()
	// A deadline with no timer of its own: the round trip's socket deadlines bound the decision
	// (see limiter.WithDeadline), and a timer per request cost 3 allocations and a wake-up.
	ctx = limiter.WithDeadline(ctx, start.Add(time.Duration(h.Timeout)))
	release, err := h.client.acquire(ctx, h.KeyPrefix, reqs)
	if err != nil {
		return limiter.Decision{}, err
	}
	defer func() {
		if p := recover(); p != nil {
			release(fmt.Errorf("rate limit decision panicked: %v", p))
			panic(p)
		}
	}()
	d, err = h.limiter.Allow(ctx, reqs)
	metrics.redisDuration.Observe(time.Since(start).Seconds())
	release(err)
	return d, err
}

// failMode returns the fail_mode that applies to reqs when Redis fails: closed when any of
// their zones is closed, else local when any is local, else open.
func (h *Handler) failMode(reqs []limiter.Request) string {
	mode := FailOpen
	for _, rq := range reqs {
		switch h.zoneOf(rq.Zone).failMode {
		case FailClosed:
			return FailClosed
		case FailLocal:
			mode = FailLocal
		}
	}
	return mode
}

// localZones returns the requests of reqs whose zone's fail_mode is local: those the
// in-process limiter decides when Redis fails.
func (h *Handler) localZones(reqs []limiter.Request) []limiter.Request {
	n := 0
	for _, rq := range reqs {
		if h.zoneOf(rq.Zone).failMode == FailLocal {
			n++
		}
	}
	if n == len(reqs) {
		return reqs
	}
	local := make([]limiter.Request, 0, n)
	for _, rq := range reqs {
		if h.zoneOf(rq.Zone).failMode == FailLocal {
			local = append(local, rq)
		}
	}
	return local
}

// countMode adds one decision with result res to every zone of reqs whose fail_mode is mode.
func (h *Handler) countMode(reqs []limiter.Request, mode string, res result) {
	for _, rq := range reqs {
		if z := h.zoneOf(rq.Zone); z.failMode == mode {
			z.decisions[res].Inc()
		}
	}
}

// zoneOf returns the zone of h that lz is the parameters of (its own, or a per-request copy).
func (h *Handler) zoneOf(lz *limiter.Zone) *Zone {
	return h.Zones[zoneIndex(h.Zones, lz)]
}

// count adds one decision with result res to every zone of reqs. reqs are in the order of
// h.Zones (ServeHTTP builds them so), which makes this one pass.
func (h *Handler) count(reqs []limiter.Request, res result) {
	i := 0
	for _, rq := range reqs {
		for h.Zones[i].Name != rq.Zone.Name {
			i++
		}
		h.Zones[i].decisions[res].Inc()
	}
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

// failureReason classifies a decision error: circuit_open, timeout, bad_response, oom (Redis
// over `maxmemory` refused the script, which writes) or redis_error.
func failureReason(err error) string {
	switch {
	case isBreakerOpen(err):
		return "circuit_open"
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, limiter.ErrBadResponse):
		return "bad_response"
	case redis.HasErrorPrefix(err, "OOM"):
		return "oom"
	}
	var ne interface{ Timeout() bool }
	if errors.As(err, &ne) && ne.Timeout() {
		return "timeout"
	}
	return "redis_error"
}

// setRateLimitHeaders sets the response headers chosen by Headers: the legacy X-RateLimit-Limit,
// -Remaining and -Reset (seconds until full) of the deciding zone z, decided with the parameters
// lz (z's own, or the request's when its numbers are placeholders), and the IETF httpapi
// ratelimit-headers draft's RateLimit-Policy and RateLimit with one item per zone of reqs whose
// outcome is known, the deciding zone first (see setIETFFields); plus X-RateLimit-Degraded when
// fail_mode local decided.
func (h *Handler) setRateLimitHeaders(hdr http.Header, reqs []limiter.Request, z *Zone, lz *limiter.Zone, d limiter.Decision, out *outcome) {
	if h.Headers == HeadersOff {
		return
	}
	if h.Headers == HeadersLegacy || h.Headers == HeadersBoth {
		// One backing array for the three values: one allocation, not three.
		vals := []string{z.quotaOf(lz), strconv.FormatInt(d.Remaining, 10), strconv.FormatInt(out.reset, 10)}
		hdr[hdrLimit], hdr[hdrRemaining], hdr[hdrReset] = vals[0:1:1], vals[1:2:2], vals[2:3:3]
	}
	if h.Headers == HeadersIETF || h.Headers == HeadersBoth {
		h.setIETFFields(hdr, reqs, z, lz, d)
	}
	if out.degraded && h.degradedHeader {
		hdr[hdrDegraded] = []string{"true"}
	}
}

// zoneIndex returns the index in zones of the zone that lz is the parameters of: its own, or a
// copy made for one request when its numbers come from placeholders. Zone names are unique in a
// handler.
func zoneIndex(zones []*Zone, lz *limiter.Zone) int {
	for i, z := range zones {
		if z.Name == lz.Name {
			return i
		}
	}
	return -1
}

// seconds rounds d up to whole seconds.
func seconds(d time.Duration) int64 {
	s := int64(d / time.Second)
	if d%time.Second > 0 {
		s++
	}
	return s
}

// clientKey resolves the zone's key placeholders: the first that is not empty wins, and the
// client key says which it was (limiter.CandidateKey: the first candidate's value as it is, the
// n-th's as "<n>=value"), so that no value of one candidate can name another's state. A value
// that is an IP address is first masked to the zone's prefix length (maskIP); memo holds the
// last one masked. All empty gives "": the zone's empty_key decides (shared: the limiter counts
// it under the zone's one shared key).
func (z *Zone) clientKey(repl *caddy.Replacer, memo *maskMemo) string {
	for i, k := range z.Key {
		if v := repl.ReplaceAll(k, ""); v != "" {
			return limiter.CandidateKey(i+1, memo.mask(v, z.v4, z.v6))
		}
	}
	return ""
}

// limiterKey returns the key the limiter gets for a client key as the placeholder shows it: the
// same, or with key_secret its keyed digest.
func (h *Handler) limiterKey(shown string) string {
	if h.keySecret == nil {
		return shown
	}
	return h.keySecret.Key(shown)
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
