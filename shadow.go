package ratelimitredis

// Shadow zones (a zone's dry_run): decided and charged with the others, never refusing. The
// limiter decides the request as if a shadow zone were absent (a shadow zone's denial is not
// the decision's) and reports each zone's own outcome; here a shadow zone's would-be denial is
// counted (dry_run_denied) and named in {http.rate_limit_redis.shadow_denied}, and a shadow zone
// is kept out of the rate limit headers.

import (
	"strings"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// validateDryRun checks what dry_run excludes, of the fields the limiter does not see.
func (z *Zone) validateDryRun() error {
	if z.DryRun && z.EmptyKey == EmptyKeyDeny {
		return z.fieldError("dry_run", "dry_run excludes empty_key deny: a shadow zone never refuses a request")
	}
	return nil
}

// shadowDenied returns the names of the shadow zones of reqs that would have denied the
// request, comma-separated in zone order; "" when none did.
func (h *Handler) shadowDenied(reqs []limiter.Request) string {
	var b strings.Builder
	for _, rq := range reqs {
		if rq.Zone.Shadow && rq.Result.Known && !rq.Result.Allowed {
			if b.Len() > 0 {
				b.WriteByte(',')
			}
			b.WriteString(rq.Zone.Name)
		}
	}
	return b.String()
}

// countShadow counts, as dry_run_denied, each shadow zone of a denied request (reqs) that would
// have denied it too.
func (h *Handler) countShadow(reqs []limiter.Request) {
	for _, rq := range reqs {
		if rq.Zone.Shadow && rq.Result.Known && !rq.Result.Allowed {
			h.Zones[rq.Tag].decisions[resultDryRunDenied].Inc()
		}
	}
}

// shadowUnresolved reports whether the resolve error err of zone z leaves z out of the request
// rather than refusing it: z is a shadow zone, which never refuses. It is logged at error level
// (the configuration or what feeds its placeholders is wrong), at most once a minute per zone:
// every request may have it.
func (h *Handler) shadowUnresolved(z *Zone, err error) bool {
	if !z.DryRun {
		return false
	}
	if !onceAMinute(z.shadowLogged) {
		return true
	}
	if c := h.logger.Check(zapcore.ErrorLevel, "shadow zone left out of the request (logged at most once a minute per zone)"); c != nil {
		c.Write(zap.String("zone", z.Name), zap.Error(err))
	}
	return true
}

// countAdmitted counts an admitted request with result res in each of its zones, but as
// dry_run_denied in a shadow zone that would have denied it.
func (h *Handler) countAdmitted(reqs []limiter.Request, res result) {
	for _, rq := range reqs {
		r := res
		if rq.Zone.Shadow && rq.Result.Known && !rq.Result.Allowed {
			r = resultDryRunDenied
		}
		h.Zones[rq.Tag].decisions[r].Inc()
	}
}
