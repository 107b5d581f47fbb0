package ratelimitredis

// Near-limit signals (a zone's near_limit): decide.lua reports, in the decision's own call, the
// admitted request whose charge took its client from below the zone's near_limit to at or past
// it (limiter.Result.NearLimit). Here each such crossing is counted in near_limit_total, emitted
// as EventNearLimit and named in {http.rate_limit_redis.near_limit}.

import "strings"

// nearLimit signals each crossing of an admitted request f: counted, emitted, and named in f's
// outcome. A request whose zones Redis did not decide (fail_mode) crosses nothing.
func (h *Handler) nearLimit(f *flight) {
	var names strings.Builder
	for i, rq := range f.reqs {
		if !rq.Result.NearLimit {
			continue
		}
		z := h.Zones[rq.Tag]
		if z.nearLimits != nil {
			z.nearLimits.Inc()
		}
		h.events.nearLimit(h, f, i)
		if names.Len() > 0 {
			names.WriteByte(',')
		}
		names.WriteString(rq.Zone.Name)
	}
	f.outcome.nearLimit = names.String()
}

// nearLimit emits EventNearLimit for the request f.reqs[i], which crossed its zone's near_limit.
func (e *events) nearLimit(h *Handler, f *flight, i int) {
	if e == nil || !e.app.ShouldEmit(EventNearLimit) {
		return
	}
	rq := f.reqs[i]
	data := map[string]any{
		"zone": rq.Zone.Name, "limit": rq.Zone.Quota(), "remaining": rq.Result.Remaining,
		"near_limit": rq.Zone.NearLimit, "dry_run": h.DryRun || rq.Zone.Shadow,
	}
	if h.LogKey {
		data["key"] = f.shown[i]
	}
	e.app.Emit(e.ctx, EventNearLimit, data)
}
