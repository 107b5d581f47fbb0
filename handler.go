package ratelimitredis

import (
	"errors"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// errCost is returned (as a 400) when a zone's cost placeholder resolves to something other than
// a positive integer.
var errCost = errors.New("the request's cost is not a positive integer")

// statusClientClosed is the status of a request whose client went away before its response:
// 499, what Caddy's reverse proxy reports (and nginx logs) for a client that closed the request.
const statusClientClosed = 499

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
	// hdrShouldRetry is the field the OpenAI and Anthropic SDKs read before retrying: `false`
	// makes them fail the call at once (their shouldRetry).
	hdrShouldRetry = http.CanonicalHeaderKey("X-Should-Retry")
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
// held at once (see placeForWait); dry_run never holds.
//
// A request to the quota endpoint (quota_endpoint) is handed to it (quotaEndpoint, quota.go)
// before these stages, which never see it; they decide every other request against the zones
// that limit it (requestZones: all but the endpoint's own).
//
// The stages, in the order a request meets them, each in a file of its name:
//   - resolve (resolve.go): the zones that apply, their client keys, numbers and costs;
//   - decide (decide.go): the deny cache or Redis, and the fail modes when Redis fails;
//   - describe (headers.go): the placeholders and the rate limit headers of the decision;
//   - admit (admit.go): hold, count, serve and settle; or deny (deny.go): count, log, event, 429.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if repl == nil {
		repl = caddy.NewReplacer()
	}
	if h.quota.answers(r) {
		return h.quota.serve(w, r, next, repl)
	}
	// On the stack: a request no zone applies to allocates nothing.
	var reqsBuf [4]limiter.Request
	var shownBuf [4]string
	reqs, shown, shaping, err := h.resolve(r, repl, h.requestZones, reqsBuf[:0], shownBuf[:0])
	if err != nil {
		return h.unresolved(w, r, next, repl, err)
	}
	if len(reqs) == 0 {
		return next.ServeHTTP(w, r)
	}
	f := newFlight(repl, reqs, shown)
	if shaping && !h.DryRun {
		h.placeForWait(r, f)
	}
	defer h.leaveWaiting(f)
	if done, err := h.decideFlight(w, r, next, f); done {
		return err
	}
	if at := h.queueing(f); at >= 0 {
		if done, err := h.waitInQueue(w, r, next, f, at); done {
			return err
		}
	}
	if f.d.Held != nil {
		// Whatever happens to the request, its concurrency slots are not refreshed past it
		// (settled, they are untracked already).
		defer h.limiter.Drop(f.d.Held)
	}
	h.describe(w, f)
	h.setWaited(w, f)
	if f.d.Allowed {
		return h.admit(w, r, next, f)
	}
	h.leaveWaiting(f)
	return h.deny(w, r, next, f)
}

// flight is one request's way through ServeHTTP's stages after resolve: what it asked of which
// zones, and what was decided. Its outcome is the request's placeholders (published when it is
// made), so it is the one allocation of a request that one zone applies to. Its buffers hold one
// zone's request only, so that it stays small (every denial of a flood allocates one): a request
// of several zones allocates its reqs and shown too.
type flight struct {
	outcome
	repl *caddy.Replacer
	// reqs are the limiter requests, one per zone that applies, in the order of h.Zones, each
	// tagged with its zone's index there.
	reqs    []limiter.Request
	reqsBuf [1]limiter.Request
	// shown are the client keys as placeholders show them, per request of reqs: with
	// key_secret, reqs hold their keyed digests instead.
	shown    []string
	shownBuf [1]string
	// d is the decision, about the requests of decided: reqs, or those of fail_mode local's zones;
	// its Zone is an index of reqs either way.
	d       limiter.Decision
	decided []limiter.Request
	// placed is the request's waiting place (waiting.go), of its client identities waitKeys,
	// and seat its place among a queue's waiters while it waits in one; noWait is set when it
	// is decided without max_wait, no place being left for it.
	placed      waitingPlace
	waitKeys    []waitingKey
	waitKeysBuf [1]waitingKey
	seat        *seat
	noWait      bool
	// queued is how long the request waited in a queue (queue.go); waitTimeout is set when it
	// waited its max_wait out, evicted when a higher class took its waiting place.
	queued      time.Duration
	waitTimeout bool
	evicted     bool
}

// newFlight returns the flight of a request whose zones resolved to reqs and shown, its
// outcome published as repl's placeholders.
func newFlight(repl *caddy.Replacer, reqs []limiter.Request, shown []string) *flight {
	f := &flight{repl: repl}
	f.reqs = append(f.reqsBuf[:0], reqs...)
	f.shown = append(f.shownBuf[:0], shown...)
	f.decided = f.reqs
	f.outcome.publish(repl)
	return f
}

// count adds one decision with result res to every zone of reqs.
func (h *Handler) count(reqs []limiter.Request, res result) {
	for _, rq := range reqs {
		h.Zones[rq.Tag].decisions[res].Inc()
	}
}

// countMode adds one decision with result res to every zone of reqs whose fail_mode is mode.
func (h *Handler) countMode(reqs []limiter.Request, mode string, res result) {
	for _, rq := range reqs {
		if z := h.Zones[rq.Tag]; z.failMode == mode {
			z.decisions[res].Inc()
		}
	}
}
