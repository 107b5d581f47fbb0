package ratelimitredis

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// What the Caddyfile parser says about mholt/caddy-ratelimit's subdirectives, which this
// directive does not have: the replacement, so that a migrated config's first error tells how to
// write the line here (docs/migrating.md has the whole mapping).

// mholtHints maps each subdirective of caddy-ratelimit's that this directive lacks to what to
// write instead, given the line's arguments. Its zone subdirectives (events) and its handler's
// (the others) are both here: either may be written at either level by mistake.
var mholtHints = map[string]func(args []string) string{
	"events": func(args []string) string {
		n := "<n>"
		if len(args) == 1 {
			n = args[0]
		}
		return fmt.Sprintf("use `algorithm sliding_window` and `limit %s`; `window` stays as it is", n)
	},
	"distributed": func([]string) string {
		return "distribution is built in: every decision is made in Redis, so all instances enforce one limit; remove the line"
	},
	"sweep_interval": func([]string) string {
		return "not needed: every Redis key expires, so Redis frees an idle client's state; remove the line"
	},
	"storage": func([]string) string {
		return "Caddy's storage is not used: give the Redis in a `redis { address <host:port> }` block"
	},
	"disable_metrics": func([]string) string {
		return "the metrics are always in Caddy's metrics registry; remove the line"
	},
}

// errUnrecognized is the error for the unknown subdirective at the cursor; for one of
// caddy-ratelimit's, it names the replacement (mholtHints). It consumes the line's arguments.
func errUnrecognized(d *caddyfile.Dispenser) error {
	tok := d.Token()
	hint, ok := mholtHints[tok.Text]
	if !ok {
		return errAt(tok, "unrecognized subdirective %q", tok.Text)
	}
	return errAt(tok, "unrecognized subdirective %q (caddy-ratelimit's): %s", tok.Text, hint(d.RemainingArgs()))
}

// checkMholtJitter returns an error if the argument of the jitter subdirective at the cursor is
// a bare number from 0 to 1, caddy-ratelimit's fraction of the wait, with what to write here: a
// duration, the fraction of a one-minute window in whole seconds, rounded up. The cursor stays on
// the subdirective's name.
func checkMholtJitter(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return nil
	}
	v := d.Val()
	d.Prev()
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f <= 0 || f > 1 || strings.Trim(v, "0123456789.") != "" {
		return nil
	}
	secs := int(math.Ceil(f*60 - 1e-9)) // 0.2 × 60 is a hair above 12 in floating point
	return d.Errf("jitter: %q is caddy-ratelimit's fraction of the wait; here jitter is a duration, "+
		"the most added to Retry-After at random, in whole seconds: %s of a 1m window is `jitter %ds`", v, v, secs)
}

// mholtWindow adds to fe, the error of p's zone, how caddy-ratelimit's window is written here
// when fe says the window belongs to another algorithm and no algorithm, limit or capacity is given: the zone is caddy-ratelimit's
// shape (window, and events or nothing) rather than a token bucket's.
func (p *zoneParser) mholtWindow(fe *limiter.FieldError) {
	_, limit := p.seen["limit"]
	_, capacity := p.seen["capacity"]
	if fe.Field == "window" && strings.Contains(fe.Msg, "belongs to algorithm") && p.zone.Algorithm == "" && !limit && !capacity {
		fe.Msg += "; caddy-ratelimit's window and events are `algorithm sliding_window`, `window` and `limit <events>` here"
	}
}
