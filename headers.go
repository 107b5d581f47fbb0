package ratelimitredis

import (
	"math"
	"math/bits"
	"math/rand/v2"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// The IETF RateLimit fields, as draft-ietf-httpapi-ratelimit-headers-11 (May 2026) defines them
// (-10 alike but for the names of r and t):
//
//	RateLimit-Policy: "<zone>";q=<quota>;w=<window s>, ...
//	RateLimit:        "<zone>";r=<available>;t=<seconds>, ...
//
// Both are RFC 8941 (RFC 9651) Lists with one Item per zone that applied to the request and
// whose outcome is known, the deciding zone first, then the others in the order of the zones.
// The item is the zone name as a String (both drafts: "MUST be a String"); zone names are
// [A-Za-z0-9_.-], so nothing needs escaping. q, w, r and t are Integers (at most 15 digits).
//
// t is the whole seconds, rounded up, until the zone has at least one more unit of quota than r
// (limiter.Result.Next): the next token of a token bucket, the oldest entry of a sliding window
// leaving it; 0 when the zone is full. That is -10's "seconds until additional quota is made
// available" and -11's "effective window", the seconds within which the client can use no more
// than r (rounded up, the next unit may come up to a second before t: a client pacing on t waits
// that much too long, never too little). On a 429 that waiting cures, no item's t is later than
// the (exact) Retry-After: the deciding zone's next unit comes no later than its retry, and a
// zone that admitted shows at most the Retry-After, which -11's window allows (the client can
// use no more than r of it within that shorter time either), and which both drafts' rule that
// Retry-After not come before the end of t requires.

// sfMaxInteger is the largest RFC 8941 Integer (15 decimal digits).
const sfMaxInteger = 999_999_999_999_999

// setIETFFields sets RateLimit-Policy and RateLimit for the decision d of reqs, whose deciding
// zone is z. It allocates the two field values only (none for the policy of a lone zone).
func (h *Handler) setIETFFields(hdr http.Header, reqs []limiter.Request, z *Zone, lz *limiter.Zone, d limiter.Decision) {
	maxT := int64(math.MaxInt64)
	if !d.Allowed && !d.Unsatisfiable {
		maxT = max(seconds(d.RetryAfter), 1)
	}
	var policyBuf, limitBuf [256]byte
	policy := policyBuf[:0] // empty while z's is the only item
	// The deciding zone's item from the Decision, which always has it.
	lead := limiter.Result{Known: true, Allowed: d.Allowed, Remaining: d.Remaining, Next: d.Next, Reset: d.Reset}
	limit := appendServiceLimit(limitBuf[:0], z, lead, maxT)
	for i := range reqs {
		if i == d.Zone || !reqs[i].Result.Known || reqs[i].Zone.Shadow {
			continue // a shadow zone never shows: its limit is not the client's
		}
		other := h.Zones[reqs[i].Tag]
		if len(policy) == 0 {
			policy = append(policy, z.policyOf(lz)...)
		}
		policy = append(append(policy, ", "...), other.policyOf(reqs[i].Zone)...)
		limit = appendServiceLimit(append(limit, ", "...), other, reqs[i].Result, maxT)
	}
	if len(policy) == 0 {
		hdr[hdrPolicy] = []string{z.policyOf(lz)}
	} else {
		hdr[hdrPolicy] = []string{string(policy)}
	}
	hdr[hdrRateLimit] = []string{string(limit)}
}

// appendServiceLimit appends zone z's RateLimit item, `"<zone>";r=<remaining>;t=<seconds>`, for
// its outcome res, with t at most maxT.
func appendServiceLimit(b []byte, z *Zone, res limiter.Result, maxT int64) []byte {
	b = append(b, z.quotedName...)
	b = append(b, ";r="...)
	b = strconv.AppendInt(b, min(res.Remaining, sfMaxInteger), 10)
	b = append(b, ";t="...)
	return strconv.AppendInt(b, min(seconds(res.Next), maxT), 10)
}

// policyWindow returns q and w of the RateLimit-Policy item of a zone admitting quota units per
// window (limiter.Zone.PolicyWindow: a token bucket's time to refill from empty). w is whole
// seconds (the drafts allow no fraction):
//   - a window of a second or more: q is the quota and w the window rounded up, so that the
//     rate q/w is never above the zone's (a window of 1.5s is w=2);
//   - a shorter window: w is 1 and q the units the zone admits per second, rounded down (10 per
//     100ms is q=100;w=1), where rounding the window up to 1s would advertise as little as a
//     thousandth of the real rate.
//
// q is at most an RFC 8941 Integer.
func policyWindow(quota int64, window time.Duration) (q, w int64) {
	window = window.Round(time.Microsecond) // the scripts' resolution: 100/1m is 60s, not 59.999999999s
	if window >= time.Second {
		return min(quota, sfMaxInteger), seconds(window)
	}
	if window <= 0 {
		return sfMaxInteger, 1
	}
	hi, lo := bits.Mul64(uint64(quota), uint64(time.Second))
	if hi >= uint64(window) {
		return sfMaxInteger, 1 // the quotient would not fit 64 bits
	}
	n, _ := bits.Div64(hi, lo, uint64(window))
	return int64(min(n, sfMaxInteger)), 1
}

// describe makes f's decision known: it shortens the times of a request to be held by its delay
// (the headers describe the zone when the response leaves), reports that Redis answered, counts
// and logs a Redis Cluster slot's failure whose denial stood, fills in the outcome (the
// placeholders), sets the rate limit headers of the deciding zone, and for a 429 that waiting
// cures sets the Retry-After to send: the exact wait, at least 1, plus the deciding zone's
// jitter (the deny cache and the RateLimit fields keep the exact wait).
func (h *Handler) describe(w http.ResponseWriter, f *flight) {
	d := &f.d
	if d.Allowed && d.Delay > 0 && !h.DryRun {
		d.Reset, d.Next = max(0, d.Reset-d.Delay), max(0, d.Next-d.Delay)
	}
	if !f.degraded && !d.Cached {
		h.events.succeeded() // Redis answered
	}
	if d.Err != nil {
		// A Redis Cluster slot failed while the decision stands: another slot denied the request,
		// or the slot held only shadow zones, which were left out.
		metrics.backendFailures.WithLabelValues(string(failureReason(d.Err))).Inc()
		if c := h.logger.Check(zapcore.DebugLevel, "rate limit decision failed in one hash slot; the decision stands (another slot denied, or the slot held only shadow zones)"); c != nil {
			c.Write(zap.String("reason", string(failureReason(d.Err))), zap.Error(d.Err))
		}
	}
	rq := f.reqs[d.Zone]
	zone, z := rq.Zone, h.Zones[rq.Tag]
	f.outcome = outcome{
		allowed: d.Allowed, degraded: f.degraded, decided: true,
		zone: zone.Name, key: f.shown[d.Zone],
		limit: d.Limit, remaining: d.Remaining,
		reset: seconds(d.Reset), retryAfter: seconds(d.RetryAfter), waited: limiter.CeilMs(d.Delay),
		shadowDenied: h.shadowDenied(f.reqs),
	}
	h.setRateLimitHeaders(w.Header(), f.reqs, z, zone, f.d, &f.outcome)
	if !d.Allowed && !d.Unsatisfiable {
		f.retryAfter = max(f.retryAfter, 1)
		if z.jitter > 0 {
			f.retryAfter += rand.Int64N(z.jitter + 1)
		}
	}
}

// decidingZone returns the handler's zone that decided f.
func (h *Handler) decidingZone(f *flight) *Zone {
	return h.Zones[f.reqs[f.d.Zone].Tag]
}

// setRateLimitHeaders sets the response headers chosen by Headers: the legacy X-RateLimit-Limit,
// -Remaining and -Reset (seconds until full) of the deciding zone z, decided with the parameters
// lz (z's own, or the request's when its numbers are placeholders), and the IETF httpapi
// ratelimit-headers draft's RateLimit-Policy and RateLimit with one item per zone of reqs whose
// outcome is known, the deciding zone first (see setIETFFields); plus X-RateLimit-Degraded when
// fail_mode local decided.
func (h *Handler) setRateLimitHeaders(hdr http.Header, reqs []limiter.Request, z *Zone, lz *limiter.Zone, d limiter.Decision, out *outcome) {
	if h.Headers == HeadersOff || lz.Shadow {
		return // off, or every zone of the request is a shadow zone (it decides only then)
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

// seconds rounds d up to whole seconds.
func seconds(d time.Duration) int64 {
	s := int64(d / time.Second)
	if d%time.Second > 0 {
		s++
	}
	return s
}
