package ratelimitredis

import (
	"fmt"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("rate_limit_redis", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("rate_limit_redis", httpcaddyfile.Before, "basic_auth")
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	handler := new(Handler)
	if err := handler.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return handler, nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	rate_limit_redis [<matcher>] {
//		redis {
//			address      <host:port>...      # one or more, repeatable; default 127.0.0.1:6379
//			username     <user>
//			password     <password>          # placeholders such as {env.REDIS_PASSWORD} work
//			db           <n>
//			sentinel     <master_name>       # the addresses are Sentinels
//			cluster                          # Redis Cluster (also implied by more than one address without sentinel)
//			tls {                            # presence enables TLS
//				ca                   <pem file>
//				cert                 <pem file>
//				key                  <pem file>
//				server_name          <name>
//				insecure_skip_verify
//			}
//			pool_size    <n>
//			dial_timeout <duration>
//		}
//		key_prefix <string>                  # default "rl:"
//		key_secret <secret>                  # keyed digests of client keys; use {env.RATE_LIMIT_KEY_SECRET}
//		timeout    <duration>                # deadline of one decision's Redis call; default 100ms
//		fail_mode  open|closed|local         # what happens when Redis fails; default open
//		headers    legacy|ietf|both|off      # which rate limit headers to send; default legacy
//		degraded_header on|off               # X-RateLimit-Degraded while Redis fails; default on
//		grpc_status on|off                   # refused gRPC calls get a gRPC status (8 for a 429, 14 for a 503, 7, 3, 13 for a 403, 400, 500); default on
//		clock      redis|local               # whose clock the scripts use; default redis
//		dry_run                              # decide and report, never reject
//		deny_cache off | {                   # the local cache of denials is on by default
//			max_age <duration>               # how long a cached denial is trusted; default 1s
//		}
//		log_key                              # log client keys (personal data); off by default
//		ipv4_prefix <bits>                   # key an IPv4 candidate by its /bits network, 1 to 32; default 32
//		ipv6_prefix <bits>                   # key an IPv6 candidate by its /bits network, 1 to 128; default 64
//		jitter      <duration>               # add 0 to this (whole seconds) to a 429's Retry-After at random; default 0
//		no_retry_over <duration>|off         # a 429 whose Retry-After is longer also says X-Should-Retry: false; off or 0: never; default 1m
//		max_waiting <n>                      # requests held at once for a max_wait, a tenth per client key; default 1000
//		quota_endpoint <path> <zone>         # GET <path>: the client's own quota in the other zones, as JSON; <zone> limits it
//
//		zone <name> {
//			key         <value>...           # placeholders; the first that is not empty wins (the n-th's key is n=value); default {client_ip}
//			empty_key   shared|skip|deny     # when every key placeholder is empty; default shared
//			fail_mode   open|closed|local    # this zone's, when Redis fails; default the handler's
//			algorithm   token_bucket|sliding_window|fixed_window|sliding_window_counter|concurrency   # default token_bucket
//			capacity    <n>                  # token_bucket: burst size, > 0
//			refill_rate <n>[/<duration>]     # token_bucket: tokens per second, or per the duration (100/1m); > 0
//			limit       <n>                  # the window algorithms: requests per window, > 0; concurrency: requests in flight at once
//			window      <duration>           # sliding_window, sliding_window_counter, fixed_window: > 0
//			                                 # each of these four and max_cost: or <placeholder> [<fallback>]
//			period      hour|day|week|month  # fixed_window, instead of window: a calendar period
//			time_zone   <IANA name>          # fixed_window with a period; default UTC
//			cost        <n>|<placeholder>    # tokens a request takes; default 1
//			max_cost    <n>                  # larger costs are never admitted, nor charged after the response; default the quota (sliding_window with a placeholder cost: at most 1000)
//			max_wait    <duration>           # token_bucket: hold a request up to this long for its turn instead of a 429; up to 1m
//			count_status <code|Nxx>...       # charge only responses of these statuses (any algorithm)
//			charge header <field> [scale <n>] | openai_usage|anthropic_usage|gemini_usage [total|prompt|completion|weights <kind> <n>...] [missing <n>]   # charge what the response reports (at most max_cost); cost is the reservation; scale: a decimal × n, rounded up; weights: prompt, completion, cached, cache_write; missing: what a 2xx without usage is charged, default max_cost (not sliding_window)
//			hold_max    <duration>           # with count_status or charge: a reservation unsettled after it counts as charged; default 10m
//			                                 # concurrency: how long a slot is held, refreshed while its request runs; a dead instance's slots free after it
//			lease {                          # token_bucket, fixed_window: hot clients' units granted from Redis ahead, spent in process (not with max_wait, count_status, charge)
//				max <n>                      # the most units one grant takes
//				ttl <duration>               # a grant's lifetime, 10ms to 1m (a fixed window's: at most to its end); its unspent units go back when it ends
//			}
//			match {                          # optional: this zone applies only to matching requests
//				<matchers>
//			}
//			ipv4_prefix <bits>               # this zone's, instead of the handler's
//			ipv6_prefix <bits>
//			jitter      <duration>           # this zone's; 0 for none
//			no_retry_over <duration>|off     # this zone's
//		}
//	}
//
// Several zone blocks may be given; zones are checked in the order written. A zone's match may
// also be written on one line, as in `match path /login`. Zone subdirectives written directly in
// the top block, without a zone block, define one zone named "default"; they cannot be mixed with
// zone blocks. A zone's fail_mode is written in a zone block only: in the top block, fail_mode is
// the handler's, the default of every zone. ipv4_prefix, ipv6_prefix, jitter and no_retry_over at
// the top level apply to every zone (the shorthand's too); in a zone block, to that zone.
//
// Every subdirective may appear once per block (address excepted).
//
// capacity, refill_rate, limit, window and max_cost take a literal, or a placeholder resolved per
// request (plans and tiers: `capacity {plan_capacity}` with a `map` from an API key) and
// optionally a literal fallback for when it is empty (`capacity {plan_capacity} 100`). A value
// that is empty without a fallback, does not parse or is out of range rejects the request with
// 500 (see Zone.numbers).
//
// Defaults are not filled in here but when the handler is provisioned, so that the adapted JSON
// holds only what the Caddyfile says.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name
	directive := d.Token()
	if d.NextArg() {
		return d.Errf("%s: unexpected argument %q; it takes only a matcher and a block", directive.Text, d.Val())
	}

	seen := make(seenSubdirectives)
	zones := zoneList{names: make(map[string]bool)}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		var err error
		switch name := d.Val(); {
		case isZoneSubdirective(name):
			err = zones.shorthandSubdirective(d)
		case name == "zone":
			err = zones.block(d)
		default:
			if err = seen.add(d); err == nil {
				err = h.subdirective(d)
			}
		}
		if err != nil {
			return err
		}
	}

	// The options as a whole, with Validate's rules; an error points at the option at fault.
	if err := h.validateOptions(); err != nil {
		tok, ok := seen[err.Field]
		if !ok {
			tok = directive
		}
		return errAt(tok, "%v", err)
	}
	all, err := zones.finish(directive)
	if err != nil {
		return err
	}
	h.Zones = all
	if err := h.checkQuotaEndpoint(); err != nil {
		return errAt(seen["quota_endpoint"], "%v", err)
	}
	return nil
}

// subdirective parses the handler's subdirective at the cursor: one of the top block's other than
// zone and the zone subdirectives.
func (h *Handler) subdirective(d *caddyfile.Dispenser) error {
	if parse, ok := handlerSubdirectives[d.Val()]; ok {
		return parse(h, d)
	}
	return errUnrecognized(d)
}

// handlerSubdirectives parses each of the handler's subdirectives into the handler. They check
// the syntax only; validateOptions checks the values once the block ends.
var handlerSubdirectives = map[string]func(*Handler, *caddyfile.Dispenser) error{
	"redis":           func(h *Handler, d *caddyfile.Dispenser) error { return parseRedis(d, &h.Redis) },
	"key_prefix":      func(h *Handler, d *caddyfile.Dispenser) error { return stringArg(d, &h.KeyPrefix, checkKeyPrefix) },
	"key_secret":      func(h *Handler, d *caddyfile.Dispenser) error { return stringArg(d, &h.KeySecret, checkKeySecret) },
	"timeout":         func(h *Handler, d *caddyfile.Dispenser) error { return durationArg(d, &h.Timeout) },
	"fail_mode":       func(h *Handler, d *caddyfile.Dispenser) error { return stringArg(d, &h.FailMode) },
	"ipv4_prefix":     func(h *Handler, d *caddyfile.Dispenser) error { return intArg(d, &h.IPv4Prefix) },
	"ipv6_prefix":     func(h *Handler, d *caddyfile.Dispenser) error { return intArg(d, &h.IPv6Prefix) },
	"jitter":          (*Handler).parseJitter,
	"no_retry_over":   func(h *Handler, d *caddyfile.Dispenser) error { return parseNoRetryOver(d, &h.NoRetryOver) },
	"headers":         func(h *Handler, d *caddyfile.Dispenser) error { return stringArg(d, &h.Headers) },
	"degraded_header": func(h *Handler, d *caddyfile.Dispenser) error { return onOffArg(d, &h.DegradedHeader) },
	"grpc_status":     func(h *Handler, d *caddyfile.Dispenser) error { return onOffArg(d, &h.GRPCStatus) },
	"clock":           func(h *Handler, d *caddyfile.Dispenser) error { return stringArg(d, &h.Clock) },
	"dry_run":         func(h *Handler, d *caddyfile.Dispenser) error { return flagArg(d, &h.DryRun) },
	"log_key":         func(h *Handler, d *caddyfile.Dispenser) error { return flagArg(d, &h.LogKey) },
	"deny_cache":      (*Handler).parseDenyCache,
	"max_waiting":     func(h *Handler, d *caddyfile.Dispenser) error { return intArg(d, &h.MaxWaiting) },
	"quota_endpoint":  (*Handler).parseQuotaEndpoint,
}

// parseJitter parses the handler's jitter subdirective at the cursor: a duration, not
// caddy-ratelimit's fraction (checkMholtJitter).
func (h *Handler) parseJitter(d *caddyfile.Dispenser) error {
	if err := checkMholtJitter(d); err != nil {
		return err
	}
	return anyDurationArg(d, &h.Jitter)
}

// parseQuotaEndpoint parses `quota_endpoint <path> <zone>`. The values are checked once the
// block ends (checkQuotaEndpoint), against the zones.
func (h *Handler) parseQuotaEndpoint(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) != 2 {
		return d.Errf("quota_endpoint takes a path and a zone name: quota_endpoint <path> <zone>")
	}
	h.QuotaEndpoint = &QuotaEndpoint{Path: args[0], Zone: args[1]}
	return noBlock(d, "quota_endpoint")
}

// checkKeyPrefix checks the argument of key_prefix: not empty, which JSON cannot tell from no
// key_prefix.
func checkKeyPrefix(v string) error {
	if v == "" {
		return fmt.Errorf("must not be empty (leave it out for the default %q)", DefaultKeyPrefix)
	}
	return nil
}

// checkKeySecret checks the argument of key_secret: a literal now, a placeholder when the config
// loads. Neither error shows the secret.
func checkKeySecret(v string) error {
	if !hasPlaceholder(v) && len(caddy.NewReplacer().ReplaceKnown(v, "")) < limiter.MinKeySecretBytes {
		return fmt.Errorf("must be at least %d bytes: use 32 random bytes, such as the output of "+
			"`openssl rand -base64 32`, from the environment: key_secret {env.RATE_LIMIT_KEY_SECRET}", limiter.MinKeySecretBytes)
	}
	return nil
}

// parseNoRetryOver parses `no_retry_over <duration>|off` at the cursor into a new *field: off is
// 0, as in JSON. The duration's range is the validation's.
func parseNoRetryOver(d *caddyfile.Dispenser, field **caddy.Duration) error {
	if d.NextArg() {
		if d.Val() == "off" {
			if d.NextArg() {
				return d.Errf("no_retry_over: unexpected argument %q", d.Val())
			}
			*field = new(caddy.Duration)
			return noBlock(d, "no_retry_over")
		}
		d.Prev()
	}
	return optDurationArg(d, field)
}

// parseDenyCache parses `deny_cache on|off` or a `deny_cache { max_age <duration> }` block.
func (h *Handler) parseDenyCache(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		v := d.Val()
		if d.NextArg() {
			return d.Errf("deny_cache: unexpected argument %q", d.Val())
		}
		if err := oneOf("on", "off")(v); err != nil {
			return d.Errf("deny_cache: %v", err)
		}
		h.DenyCache = new(v == "on")
		return noBlock(d, "deny_cache")
	}
	seen := make(seenSubdirectives)
	block := false
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		block = true
		if d.Val() != "max_age" {
			return d.Errf("deny_cache: unrecognized subdirective %q", d.Val())
		}
		if err := seen.add(d); err != nil {
			return err
		}
		if err := durationArg(d, &h.DenyCacheMaxAge); err != nil {
			return err
		}
	}
	if !block {
		return d.ArgErr()
	}
	return nil
}

// parseRedis parses the redis block whose name is at the cursor into *field.
func parseRedis(d *caddyfile.Dispenser, field **RedisConfig) error {
	block := d.Token()
	if err := noArgsBeforeBlock(d); err != nil {
		return err
	}
	rc := new(RedisConfig)
	seen := make(seenSubdirectives)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := rc.subdirective(d, seen); err != nil {
			return err
		}
	}
	if name, err := rc.check(); err != nil {
		tok, ok := seen[name]
		if !ok {
			tok = block // the error is about what the block lacks
		}
		return errAt(tok, "%v", err)
	}
	*field = rc
	return nil
}

// subdirective parses the redis block's subdirective at the cursor and records it in seen: all
// but address, which may be repeated, and is recorded by its first argument, where an error
// about the addresses points.
func (cfg *RedisConfig) subdirective(d *caddyfile.Dispenser, seen seenSubdirectives) error {
	if d.Val() == "address" {
		for d.NextArg() {
			if _, ok := seen["address"]; !ok {
				seen["address"] = d.Token()
			}
			cfg.Addresses = append(cfg.Addresses, d.Val())
		}
		if len(cfg.Addresses) == 0 {
			return d.ArgErr()
		}
		return noBlock(d, "address")
	}
	if err := seen.add(d); err != nil {
		return err
	}
	strs := map[string]*string{"username": &cfg.Username, "password": &cfg.Password, "sentinel": &cfg.Sentinel}
	if field, ok := strs[d.Val()]; ok {
		return stringArg(d, field)
	}
	switch d.Val() {
	case "db":
		return intAtLeast(d, &cfg.DB, 0)
	case "cluster":
		return flagArg(d, &cfg.Cluster)
	case "tls":
		return parseTLS(d, &cfg.TLS)
	case "pool_size":
		return intAtLeast(d, &cfg.PoolSize, 1)
	case "dial_timeout":
		return durationArg(d, &cfg.DialTimeout)
	}
	return d.Errf("unrecognized subdirective %q", d.Val())
}

// parseTLS parses the tls block whose name is at the cursor into *field.
func parseTLS(d *caddyfile.Dispenser, field **TLSConfig) error {
	if err := noArgsBeforeBlock(d); err != nil {
		return err
	}
	tc := new(TLSConfig)
	strs := map[string]*string{"ca": &tc.CA, "cert": &tc.Cert, "key": &tc.Key, "server_name": &tc.ServerName}
	seen := make(seenSubdirectives)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := seen.add(d); err != nil {
			return err
		}
		var err error
		switch str, ok := strs[d.Val()]; {
		case ok:
			err = stringArg(d, str)
		case d.Val() == "insecure_skip_verify":
			err = flagArg(d, &tc.InsecureSkipVerify)
		default:
			err = d.Errf("unrecognized subdirective %q", d.Val())
		}
		if err != nil {
			return err
		}
	}
	*field = tc
	return nil
}

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*Handler)(nil)
)
