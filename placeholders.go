package ratelimitredis

import (
	"strings"

	"github.com/caddyserver/caddy/v2"
)

// placeholderPrefix begins every placeholder the handler provides, for logs, handle_errors and
// later handlers:
//
//	{http.rate_limit_redis.allowed}      true or false; in dry_run, false when enforcement would reject (429, or 503 of fail_mode closed)
//	{http.rate_limit_redis.zone}         the deciding zone's name
//	{http.rate_limit_redis.key}          the deciding zone's client key, as resolved (an IP address masked to its prefix)
//	{http.rate_limit_redis.limit}        the deciding zone's capacity or limit
//	{http.rate_limit_redis.remaining}    whole tokens or slots left
//	{http.rate_limit_redis.reset}        seconds until the zone is full again, rounded up
//	{http.rate_limit_redis.retry_after}  the 429's Retry-After: seconds until a denied request would pass, rounded up, plus jitter; 0 when allowed
//	{http.rate_limit_redis.waited}       milliseconds the request was held for its turn (max_wait), rounded up; 0 when not held
//	{http.rate_limit_redis.degraded}     true when Redis failed and fail_mode decided
//	{http.rate_limit_redis.shadow_denied} the shadow zones (a zone's dry_run) that would have denied the request, comma-separated; empty when none
//	{http.rate_limit_redis.near_limit}   the zones this request took past their near_limit, comma-separated; empty when none (near.go)
//	{http.rate_limit_redis.charged}      after the response: what the first zone with count_status or charge was charged (charge.go)
//
// When Redis failed under fail_mode open or closed, nothing was decided: allowed, degraded, and
// the zone, key and limit of the first zone whose fail_mode answered (the first closed zone of a
// 503, else the first zone) are set; remaining, reset, retry_after and waited are not. A 403 of
// empty_key deny sets allowed and degraded only.
const placeholderPrefix = "http.rate_limit_redis."

// outcome is what a request's decision makes known to placeholders. It is registered with the
// request's replacer as one provider, so its values are formatted only when a placeholder is
// actually used.
type outcome struct {
	allowed, degraded, decided bool
	// identified: zone, key and limit are set though nothing was decided (fail_mode open or
	// closed).
	identified        bool
	zone, key         string
	limit, remaining  int64
	reset, retryAfter int64 // seconds; retryAfter with jitter
	// waited is the milliseconds the request was held for a max_wait: its delay when the hold
	// ran to its end (in dry_run, would have), the time until its client left when it did not.
	waited int64
	// shadowDenied names the shadow zones (a zone's dry_run) that would have denied the request,
	// comma-separated in zone order; "" when none did.
	shadowDenied string
	// nearLimit names the zones whose near_limit this request crossed, comma-separated in zone
	// order; "" when none did (set when it is admitted: near.go).
	nearLimit string
}

// provide answers the placeholders of placeholderPrefix.
func (o *outcome) provide(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, placeholderPrefix)
	if !ok {
		return nil, false
	}
	switch name {
	case "allowed":
		return o.allowed, true
	case "degraded":
		return o.degraded, true
	}
	if !o.decided && !o.identified {
		return nil, false
	}
	switch name {
	case "zone":
		return o.zone, true
	case "key":
		return o.key, true
	case "limit":
		return o.limit, true
	}
	if !o.decided {
		return nil, false
	}
	switch name {
	case "remaining":
		return o.remaining, true
	case "reset":
		return o.reset, true
	case "retry_after":
		return o.retryAfter, true
	case "waited":
		return o.waited, true
	case "shadow_denied":
		return o.shadowDenied, true
	case "near_limit":
		return o.nearLimit, true
	}
	return nil, false
}

// publish makes o's values the request's placeholders.
func (o *outcome) publish(repl *caddy.Replacer) { repl.Map(o.provide) }
