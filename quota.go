package ratelimitredis

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// QuotaEndpoint is the path at which a client reads its own quota in the handler's zones,
// without spending it (quota_endpoint).
//
// A GET or HEAD request whose path is Path is answered by the handler and never passed on. Zone,
// a zone of the handler that applies to these requests only, limits them: it is decided and
// charged as for any request, and its denial is the usual 429. Every other zone that applies to
// the request, with the client key, numbers and cost this request resolves to, is read from
// Redis without a write. The reply is 200, Content-Type application/json, Cache-Control
// no-store, with the rate limit headers a request would get (quotaReply). A shadow zone (its
// dry_run) is not the client's limit: it is neither read nor listed.
type QuotaEndpoint struct {
	// The request path the endpoint answers, matched exactly (the query is ignored): it begins
	// with `/` and holds no placeholder, `*`, `?` or `#`. Required.
	Path string `json:"path,omitempty"`

	// The name of the zone that limits the endpoint: a zone of this handler, which then applies to
	// the endpoint's requests only, and to every one of them. It has no match, dry_run, max_wait,
	// count_status, charge or cap_output, is not of algorithm concurrency, and its empty_key is
	// not skip. A small token bucket suits it. Required.
	Zone string `json:"zone,omitempty"`
}

// quotaReply is the body of a quota endpoint's 200.
type quotaReply struct {
	// Zones are the zones that apply to the request, in the handler's order, the endpoint's own
	// and the shadow zones left out.
	Zones []zoneQuota `json:"zones"`
}

// zoneQuota is the client's quota in one zone, as its next request would find it.
type zoneQuota struct {
	// The zone's name and algorithm.
	Zone      string `json:"zone"`
	Algorithm string `json:"algorithm"`
	// The quota in force (the client's override's when it has one): a token bucket's capacity,
	// in tokens; the requests (window slots) per window of the window algorithms; the requests in
	// flight at once of concurrency.
	Limit int64 `json:"limit"`
	// token_bucket: tokens added per second, in force.
	RefillRate float64 `json:"refill_rate,omitempty"`
	// The window algorithms: the window length in force, in milliseconds; a fixed_window of a
	// calendar period has its period instead.
	WindowMs int64  `json:"window_ms,omitempty"`
	Period   string `json:"period,omitempty"`
	// Whole tokens or window slots left now: what X-RateLimit-Remaining says, before any
	// request's cost is taken. 0 while the client is blocked.
	Remaining int64 `json:"remaining"`
	// Seconds, rounded up, until the zone is back to its full quota; 0 when it is full.
	Reset int64 `json:"reset"`
	// Seconds, rounded up, until a request of cost 1 would be admitted; absent when it would be
	// now.
	RetryAfter int64 `json:"retry_after,omitempty"`
	// A zone with block: seconds, rounded up, until the client's block ends; absent when it is
	// not blocked.
	BlockedFor int64 `json:"blocked_for,omitempty"`
	// A zone with overrides: the client's override in force, its numbers only; absent when it
	// has none.
	Override *adminapi.OverrideNumbers `json:"override,omitempty"`
}

// errQuotaMethod is the 405 of a quota endpoint request of another method than GET or HEAD.
var errQuotaMethod = errors.New("the quota endpoint answers GET and HEAD only")

// checkQuotaEndpoint checks the handler's quota_endpoint against its zones and options.
func (h *Handler) checkQuotaEndpoint() *limiter.FieldError {
	q := h.QuotaEndpoint
	if q == nil {
		return nil
	}
	bad := func(format string, args ...any) *limiter.FieldError {
		return &limiter.FieldError{Field: "quota_endpoint", Msg: "quota_endpoint: " + fmt.Sprintf(format, args...)}
	}
	switch {
	case !strings.HasPrefix(q.Path, "/") || strings.ContainsAny(q.Path, "{}*?#"):
		return bad("path %q must begin with / and hold no placeholder, *, ? or #: it is matched exactly", q.Path)
	case h.DryRun:
		return bad("not with dry_run: the endpoint's zone must be able to refuse")
	case len(h.Zones) < 2:
		return bad("needs a zone to report besides its own zone %q", q.Zone)
	}
	i := quotaZoneIndex(h.Zones, q.Zone)
	if i < 0 {
		return bad("no zone of this handler is named %q", q.Zone)
	}
	z := h.Zones[i]
	lz, _, _ := z.limiterZone(nil)
	switch {
	case z.MatcherSetsRaw != nil:
		return bad("zone %s applies to the endpoint's requests only: leave its match out", z.Name)
	case z.DryRun || z.MaxWait != nil || len(z.CountStatus) > 0 || z.Charge != nil || z.CapOutput != nil:
		return bad("zone %s decides the endpoint's requests at once: leave out dry_run, max_wait, count_status, charge and cap_output", z.Name)
	case lz.Algorithm.HoldsSlots():
		return bad("zone %s must not be of algorithm %s: the endpoint's requests end at once", z.Name, concurrencyName)
	case z.EmptyKey == EmptyKeySkip:
		return bad("zone %s must limit every request to the endpoint: its empty_key must not be skip", z.Name)
	}
	return nil
}

// quotaZoneIndex returns the index in zones of the zone named name, -1 when none is.
func quotaZoneIndex(zones []*Zone, name string) int {
	for i, z := range zones {
		if z.Name == name {
			return i
		}
	}
	return -1
}

// quotaEndpoint answers the requests of a handler's quota_endpoint in front of its rate limit:
// ServeHTTP hands it every request whose path is the endpoint's before anything is resolved, and
// it answers them itself (serve), never passing them on. The rate limit's stages know nothing of
// it: they decide every other request against requestZones, which leave its zone out
// (newQuotaEndpoint).
type quotaEndpoint struct {
	h    *Handler
	path string
	// zone is the index in h.Zones of the endpoint's zone.
	zone int
}

// newQuotaEndpoint returns the endpoint of h's quota_endpoint, nil without one, and the zones of
// h that limit every other request: all of h.Zones but the endpoint's zone.
func newQuotaEndpoint(h *Handler) (*quotaEndpoint, []*Zone) {
	if h.QuotaEndpoint == nil {
		return nil, h.Zones
	}
	q := &quotaEndpoint{h: h, path: h.QuotaEndpoint.Path, zone: quotaZoneIndex(h.Zones, h.QuotaEndpoint.Zone)}
	if q.zone < 0 { // no such zone: Validate refuses the config
		return q, h.Zones
	}
	return q, slices.Delete(slices.Clone(h.Zones), q.zone, q.zone+1)
}

// answers reports whether r is for the quota endpoint q; a nil q answers none.
func (q *quotaEndpoint) answers(r *http.Request) bool {
	return q != nil && r.URL.Path == q.path
}

// serve answers a request to the quota endpoint: a method other than GET or HEAD is a 405
// before anything is resolved; the request is resolved against every zone as any request (its
// errors answered alike), its endpoint's zone decided (a denial is the usual 429; Redis failing,
// a 503), and the other zones read (quotaReply). It never calls next.
func (q *quotaEndpoint) serve(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, repl *caddy.Replacer) error {
	h := q.h
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		return h.refuse(w, r, http.StatusMethodNotAllowed, errQuotaMethod, grpcInvalidArgument, errQuotaMethod.Error())
	}
	reqs, shown, _, err := h.resolve(r, repl, h.Zones, nil, nil)
	if err != nil {
		return h.unresolved(w, r, next, repl, err)
	}
	own := quotaRequestIndex(reqs, q.zone)
	if own < 0 { // only an empty key of empty_key deny leaves it out, answered above
		return h.refuse(w, r, http.StatusInternalServerError, errors.New("quota endpoint zone not resolved"), grpcInternal, "rate limit configuration error")
	}
	f := newFlight(repl, reqs[own:own+1], shown[own:own+1])
	if f.d, err = h.limiter.Decide(r.Context(), f.reqs); err != nil {
		return q.unavailable(w, r, err)
	}
	h.describe(w, f)
	if !f.d.Allowed {
		return h.deny(w, r, next, f)
	}
	h.countAdmitted(f.reqs, resultAllowed)
	clearRateLimitHeaders(w.Header())
	reply, err := q.read(r.Context(), w.Header(), append(reqs[:own:own], reqs[own+1:]...))
	if err != nil {
		return q.unavailable(w, r, err)
	}
	w.Header().Set("Content-Type", "application/json")
	noStore(w)
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return nil
	}
	return json.NewEncoder(w).Encode(reply)
}

// quotaRequestIndex returns the index in reqs of the request of zone index tag, -1 when none is.
func quotaRequestIndex(reqs []limiter.Request, tag int) int {
	for i, rq := range reqs {
		if rq.Tag == tag {
			return i
		}
	}
	return -1
}

// unavailable answers a quota endpoint request whose Redis call failed with err: 499 when its
// client went away, else 503 with Retry-After: 1, whatever the fail_mode (there is no state to
// report without Redis). The failure is counted in backend_failures_total.
func (q *quotaEndpoint) unavailable(w http.ResponseWriter, r *http.Request, err error) error {
	if r.Context().Err() != nil {
		return caddyhttp.Error(statusClientClosed, fmt.Errorf("client closed the request during the quota read: %w", err))
	}
	metrics.backendFailures.WithLabelValues(string(failureReason(err))).Inc()
	w.Header()[hdrRetryAfter] = []string{"1"}
	return q.h.refuse(w, r, http.StatusServiceUnavailable, fmt.Errorf("rate limit quota unavailable: %w", err), grpcUnavailable, "rate limit quota unavailable")
}

// clearRateLimitHeaders removes the rate limit headers set before, so that those of the zones
// read replace them.
func clearRateLimitHeaders(hdr http.Header) {
	for _, k := range []string{hdrLimit, hdrRemaining, hdrReset, hdrPolicy, hdrRateLimit} {
		delete(hdr, k)
	}
}

// read reads the client's state in each zone of reqs but the shadow zones, each within the
// handler's timeout, and sets in hdr the rate limit headers a request would get from that state
// (headers). It writes nothing to Redis.
func (q *quotaEndpoint) read(ctx context.Context, hdr http.Header, reqs []limiter.Request) (quotaReply, error) {
	reply := quotaReply{Zones: []zoneQuota{}}
	read := reqs[:0:0]
	states := make([]limiter.State, 0, len(reqs))
	for _, rq := range reqs {
		if rq.Zone.Shadow {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, time.Duration(q.h.Timeout))
		s, err := q.h.limiter.State(cctx, rq.Zone, rq.Key)
		cancel()
		if err != nil {
			return quotaReply{}, fmt.Errorf("zone %s: %w", rq.Zone.Name, err)
		}
		if !s.Override.IsZero() {
			oz := s.Override.Apply(rq.Zone)
			rq.Zone = &oz
		}
		rq.Result = limiter.Result{
			Known: true, Allowed: s.Remaining >= rq.Cost && s.Block.Until.IsZero(), Blocked: !s.Block.Until.IsZero(),
			Remaining: s.Remaining, Next: s.Next, Reset: s.Reset,
		}
		read, states = append(read, rq), append(states, s)
		reply.Zones = append(reply.Zones, newZoneQuota(rq.Zone, s))
	}
	q.headers(hdr, read, states)
	return reply, nil
}

// newZoneQuota is the reply's entry of zone lz (the numbers in force) for the state s.
func newZoneQuota(lz *limiter.Zone, s limiter.State) zoneQuota {
	zq := zoneQuota{
		Zone: lz.Name, Algorithm: lz.Algorithm.String(), Limit: lz.Quota(),
		Remaining: s.Remaining, Reset: seconds(s.Reset), RetryAfter: seconds(s.RetryAfter),
	}
	switch {
	case lz.Algorithm.QuotaIsCapacity():
		zq.RefillRate = lz.RefillRate
	case lz.Period != 0:
		zq.Period = lz.Period.String()
	case !lz.Algorithm.HoldsSlots():
		zq.WindowMs = lz.Window.Milliseconds()
	}
	if !s.Block.Until.IsZero() {
		zq.BlockedFor = seconds(s.Block.Until.Sub(s.Now))
	}
	if o := s.Override; !o.IsZero() {
		zq.Override = &adminapi.OverrideNumbers{Capacity: o.Capacity, RefillRate: o.RefillRate, Limit: o.Limit, WindowMs: o.Window.Milliseconds(), MaxCost: o.MaxCost}
	}
	return zq
}

// headers sets in hdr the rate limit headers of reqs, whose zones' states are states (their
// Results set from them), as a request of their costs would get them if it were denied or
// admitted by them now, with nothing charged: the deciding zone is the one that would deny it
// with the longest wait, else the one with the least remaining share of its quota.
func (q *quotaEndpoint) headers(hdr http.Header, reqs []limiter.Request, states []limiter.State) {
	if len(reqs) == 0 {
		return
	}
	dz := 0
	for i := range reqs {
		ri, rd := reqs[i].Result, reqs[dz].Result
		switch {
		case !ri.Allowed && (rd.Allowed || states[i].RetryAfter > states[dz].RetryAfter):
			dz = i
		case ri.Allowed && rd.Allowed && share(ri.Remaining, reqs[i].Zone) < share(rd.Remaining, reqs[dz].Zone):
			dz = i
		}
	}
	rq, s := reqs[dz], states[dz]
	d := limiter.Decision{
		Allowed: rq.Result.Allowed, Blocked: rq.Result.Blocked, Zone: dz, Limit: rq.Zone.Quota(),
		Remaining: s.Remaining, Reset: s.Reset, Next: s.Next,
	}
	if !d.Allowed {
		d.RetryAfter = max(s.RetryAfter, time.Microsecond)
	}
	out := outcome{reset: seconds(s.Reset)}
	q.h.setRateLimitHeaders(hdr, reqs, q.h.Zones[rq.Tag], rq.Zone, d, &out)
}

// share is remaining's share of z's quota.
func share(remaining int64, z *limiter.Zone) float64 {
	return float64(remaining) / float64(z.Quota())
}
