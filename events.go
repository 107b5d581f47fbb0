package ratelimitredis

import (
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// The Caddy events the handler emits through the events app, for its subscribers (a script, a
// notifier): Caddy's `events` global option or the JSON `apps.events.subscriptions` choose which
// handlers receive them. An event nobody subscribes to costs a map lookup: nothing is built.
const (
	// EventExceeded is emitted once per request denied with 429 (from Redis, the deny cache or
	// fail_mode local; in dry_run, per request that would have been). Data: zone, limit,
	// remaining, retry_after (seconds, rounded up; 0 when the cost can never pass), wait (the
	// same wait as a time.Duration, Retry-After's value, as in caddy-ratelimit's
	// rate_limit_exceeded), remote_ip (the client's address: Caddy's client IP, which honours
	// trusted_proxies), cached, local, dry_run, and key only with log_key (client keys can be
	// personal data; remote_ip and wait are sent whatever log_key says).
	EventExceeded = "rate_limit_redis_exceeded"
	// EventBlocked is emitted when a zone's penalty box (block) starts: the zone denied a
	// client, which it now refuses for block_seconds on every instance (the instance whose
	// decision started the block emits it, once). Data: zone, block_seconds (the block's length,
	// rounded up: block, or more for a repeat offender with block_max), wait (the same length as
	// a time.Duration: the client may retry when the block ends), remote_ip (as in
	// EventExceeded), dry_run, and key only with log_key. An admin API block emits none.
	EventBlocked = "rate_limit_redis_blocked"
	// EventNearLimit is emitted once per crossing of a zone's near_limit: by the instance whose
	// admitted request took the client from below that fraction of its quota to at or past it
	// (near.go). Data: zone, limit (the quota in force), remaining (after the request),
	// near_limit (the fraction), dry_run (the handler's dry_run, or a shadow zone), and key
	// only with log_key.
	EventNearLimit = "rate_limit_redis_near_limit"
	// EventRedisFailing is emitted when a handler's decisions start failing (Redis down, timing
	// out, answering garbage or over maxmemory): the handler applies fail_mode from then on.
	// Data: reason (as in the backend_failures_total metric), fail_mode, error, redis (the
	// addresses). Once per transition, not per failed request.
	EventRedisFailing = "rate_limit_redis_failing"
	// EventRedisRecovered is emitted when a handler's decisions succeed again after
	// EventRedisFailing. Data: redis (the addresses).
	EventRedisRecovered = "rate_limit_redis_recovered"
)

// events is the handler's link to Caddy's events app: nil when the config has none, then no
// event is emitted (nothing could subscribe).
type events struct {
	app     *caddyevents.App
	ctx     caddy.Context
	failing atomic.Bool // the last decision failed
	redis   []string
}

// newEvents returns the handler's events, or nil when the config has no events app.
func newEvents(ctx caddy.Context, redis []string) *events {
	app, err := ctx.AppIfConfigured("events")
	if err != nil {
		return nil
	}
	ea, ok := app.(*caddyevents.App)
	if !ok {
		return nil
	}
	return &events{app: ea, ctx: ctx, redis: redis}
}

// remoteIP returns r's client address for an event: Caddy's client IP (the address the default
// key {client_ip} uses, behind trusted_proxies the forwarded one), else the connection's host.
func remoteIP(r *http.Request) string {
	if ip, _ := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ip != "" {
		return ip
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr // no port
	}
	return host
}

// exceeded emits EventExceeded for the denied request r.
func (e *events) exceeded(h *Handler, r *http.Request, out *outcome, d limiter.Decision) {
	if e == nil || !e.app.ShouldEmit(EventExceeded) {
		return
	}
	data := map[string]any{
		"zone": out.zone, "limit": out.limit, "remaining": out.remaining, "retry_after": out.retryAfter,
		"wait": time.Duration(out.retryAfter) * time.Second, "remote_ip": remoteIP(r),
		"cached": d.Cached, "local": out.degraded, "dry_run": h.DryRun,
	}
	if h.LogKey {
		data["key"] = out.key
	}
	e.app.Emit(e.ctx, EventExceeded, data)
}

// blocked emits EventBlocked for each zone whose block the denial of r (f) started.
func (e *events) blocked(h *Handler, r *http.Request, f *flight) {
	if e == nil || !e.app.ShouldEmit(EventBlocked) {
		return
	}
	for i, rq := range f.reqs {
		if !rq.Result.BlockStarted {
			continue
		}
		// A started block's Next is its length.
		secs := seconds(rq.Result.Next)
		data := map[string]any{"zone": rq.Zone.Name, "block_seconds": secs, "wait": time.Duration(secs) * time.Second,
			"remote_ip": remoteIP(r), "dry_run": h.DryRun}
		if h.LogKey {
			data["key"] = f.shown[i]
		}
		e.app.Emit(e.ctx, EventBlocked, data)
	}
}

// failed records a failed decision: EventRedisFailing when the previous one succeeded.
func (e *events) failed(reason, mode string, err error) {
	if e == nil || !e.failing.CompareAndSwap(false, true) || !e.app.ShouldEmit(EventRedisFailing) {
		return
	}
	e.app.Emit(e.ctx, EventRedisFailing, map[string]any{"reason": reason, "fail_mode": mode, "error": err.Error(), "redis": e.redis})
}

// succeeded records a decision Redis answered: EventRedisRecovered when the previous one failed.
func (e *events) succeeded() {
	if e == nil || !e.failing.Load() || !e.failing.CompareAndSwap(true, false) || !e.app.ShouldEmit(EventRedisRecovered) {
		return
	}
	e.app.Emit(e.ctx, EventRedisRecovered, map[string]any{"redis": e.redis})
}
