package ratelimitredis

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
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

// The algorithm names, as written in the Caddyfile and the JSON config.
var (
	tokenBucketName          = limiter.TokenBucket.String()
	slidingWindowName        = limiter.SlidingWindow.String()
	fixedWindowName          = limiter.FixedWindow.String()
	slidingWindowCounterName = limiter.SlidingWindowCounter.String()
	concurrencyName          = limiter.Concurrency.String()
)

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
//		max_waiting <n>                      # requests held at once for a max_wait, a tenth per client key; default 1000
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
//			charge header <field> | openai_usage [total|prompt|completion] [missing <n>]   # charge what the response reports (at most max_cost); cost is the reservation; missing: what a 2xx without usage is charged, default max_cost (not sliding_window)
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
//		}
//	}
//
// Several zone blocks may be given; zones are checked in the order written. A zone's match may
// also be written on one line, as in `match path /login`. Zone subdirectives written directly in
// the top block, without a zone block, define one zone named "default"; they cannot be mixed with
// zone blocks. A zone's fail_mode is written in a zone block only: in the top block, fail_mode is
// the handler's, the default of every zone. ipv4_prefix, ipv6_prefix and jitter at the top level
// apply to every zone (the shorthand's too); in a zone block, to that zone.
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

	all, err := zones.finish(directive)
	if err != nil {
		return err
	}
	h.Zones = all
	return nil
}

// subdirective parses the handler's subdirective at the cursor: one of the top block's other than
// zone and the zone subdirectives.
func (h *Handler) subdirective(d *caddyfile.Dispenser) error {
	switch d.Val() {
	case "redis":
		return parseRedis(d, &h.Redis)
	case "key_prefix":
		return stringArg(d, &h.KeyPrefix, checkKeyPrefix)
	case "key_secret":
		return stringArg(d, &h.KeySecret, checkKeySecret)
	case "timeout":
		return durationArg(d, &h.Timeout)
	case "fail_mode", "ipv4_prefix", "ipv6_prefix", "jitter":
		return parseOverride(d, overrides{&h.FailMode, &h.IPv4Prefix, &h.IPv6Prefix, func(j caddy.Duration) { h.Jitter = j }})
	case "headers":
		return stringArg(d, &h.Headers, oneOf(HeadersLegacy, HeadersIETF, HeadersBoth, HeadersOff))
	case "degraded_header":
		return onOffArg(d, &h.DegradedHeader)
	case "grpc_status":
		return onOffArg(d, &h.GRPCStatus)
	case "clock":
		return stringArg(d, &h.Clock, oneOf(ClockRedis, ClockLocal))
	case "dry_run":
		return flagArg(d, &h.DryRun)
	case "log_key":
		return flagArg(d, &h.LogKey)
	case "deny_cache":
		return h.parseDenyCache(d)
	case "max_waiting":
		return intAtLeast(d, &h.MaxWaiting, 1)
	}
	return d.Errf("unrecognized subdirective %q", d.Val())
}

// checkKeyPrefix checks the argument of key_prefix.
func checkKeyPrefix(v string) error {
	if v == "" {
		return fmt.Errorf("must not be empty (leave it out for the default %q)", DefaultKeyPrefix)
	}
	if strings.ContainsAny(v, "{}") {
		return fmt.Errorf("%q must not contain { or } (the client key is the Redis Cluster hash tag)", v)
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

// overrides are the fields that the subdirectives fail_mode, ipv4_prefix, ipv6_prefix and jitter
// set: the handler's, for every zone, at the top level; a zone's, to override the handler's, in a
// zone block.
type overrides struct {
	failMode               *string
	ipv4Prefix, ipv6Prefix *int
	setJitter              func(caddy.Duration)
}

// parseOverride parses the fail_mode, ipv4_prefix, ipv6_prefix or jitter subdirective at the
// cursor into o.
func parseOverride(d *caddyfile.Dispenser, o overrides) error {
	switch d.Val() {
	case "fail_mode":
		return stringArg(d, o.failMode, oneOf(FailOpen, FailClosed, FailLocal))
	case "ipv4_prefix":
		return intInRange(d, o.ipv4Prefix, 32)
	case "ipv6_prefix":
		return intInRange(d, o.ipv6Prefix, 128)
	}
	dur, err := jitterDuration(d)
	if err != nil {
		return err
	}
	o.setJitter(caddy.Duration(dur))
	return nil
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
func (rc *RedisConfig) subdirective(d *caddyfile.Dispenser, seen seenSubdirectives) error {
	if d.Val() == "address" {
		for d.NextArg() {
			if _, ok := seen["address"]; !ok {
				seen["address"] = d.Token()
			}
			rc.Addresses = append(rc.Addresses, d.Val())
		}
		if len(rc.Addresses) == 0 {
			return d.ArgErr()
		}
		return noBlock(d, "address")
	}
	if err := seen.add(d); err != nil {
		return err
	}
	strs := map[string]*string{"username": &rc.Username, "password": &rc.Password, "sentinel": &rc.Sentinel}
	if field, ok := strs[d.Val()]; ok {
		return stringArg(d, field)
	}
	switch d.Val() {
	case "db":
		return intAtLeast(d, &rc.DB, 0)
	case "cluster":
		return flagArg(d, &rc.Cluster)
	case "tls":
		return parseTLS(d, &rc.TLS)
	case "pool_size":
		return intAtLeast(d, &rc.PoolSize, 1)
	case "dial_timeout":
		return durationArg(d, &rc.DialTimeout)
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

// zoneList collects the zones of the top block: those of zone blocks, or the shorthand's one (zone
// subdirectives directly in the top block); the two cannot be mixed.
type zoneList struct {
	zones     []*Zone
	names     map[string]bool // of the zone blocks parsed so far
	shorthand *zoneParser     // the zone named "default" of top-level zone subdirectives
}

// shorthandSubdirective parses the zone subdirective at the cursor, written in the top block.
func (l *zoneList) shorthandSubdirective(d *caddyfile.Dispenser) error {
	if len(l.zones) > 0 {
		return errMixedShorthand(d)
	}
	if l.shorthand == nil {
		l.shorthand = newZoneParser(d.Token(), DefaultZoneName)
	}
	return l.shorthand.subdirective(d)
}

// block parses the zone block whose `zone` token is at the cursor.
func (l *zoneList) block(d *caddyfile.Dispenser) error {
	if l.shorthand != nil {
		return errMixedShorthand(d)
	}
	z, err := parseZone(d, l.names)
	if err != nil {
		return err
	}
	l.zones = append(l.zones, z)
	return nil
}

// finish returns the zones once the top block has ended, or an error if there are none; directive
// is the directive's name, where that error points.
func (l *zoneList) finish(directive caddyfile.Token) ([]*Zone, error) {
	if l.shorthand != nil {
		if err := l.shorthand.finish(); err != nil {
			return nil, err
		}
		return []*Zone{l.shorthand.zone}, nil
	}
	if len(l.zones) == 0 {
		return nil, errAt(directive, "%s: at least one zone is required: a zone block, or zone subdirectives "+
			"(such as capacity and refill_rate) directly in this block", directive.Text)
	}
	return l.zones, nil
}

// errMixedShorthand is the error for a zone block after top-level zone subdirectives, or the
// other way round, at the cursor.
func errMixedShorthand(d *caddyfile.Dispenser) error {
	return d.Errf("zone subdirectives at the top level (the shorthand for one zone named %q) "+
		"cannot be mixed with zone blocks", DefaultZoneName)
}

// parseZone parses the zone block whose `zone` token is at the cursor. names holds the names of
// the zones parsed before; the new zone's name is added to it.
func parseZone(d *caddyfile.Dispenser, names map[string]bool) (*Zone, error) {
	if !d.NextArg() {
		return nil, d.ArgErr()
	}
	name := d.Val()
	if !limiter.ValidZoneName(name) {
		return nil, d.Errf("zone: %q is not a valid zone name (1 to 64 characters of A-Z a-z 0-9 _ . -)", name)
	}
	if names[name] {
		return nil, d.Errf("duplicate zone name %q", name)
	}
	names[name] = true
	p := newZoneParser(d.Token(), name)
	if d.NextArg() {
		return nil, d.Errf("zone: unexpected argument %q", d.Val())
	}

	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := p.subdirective(d); err != nil {
			return nil, err
		}
	}
	if err := p.finish(); err != nil {
		return nil, err
	}
	return p.zone, nil
}

// isZoneSubdirective reports whether name is a subdirective of a zone block, which is also the
// shorthand for a zone named "default" when written at the top level. A zone block also holds
// fail_mode, ipv4_prefix, ipv6_prefix and jitter, which at the top level are the handler's, for
// every zone (overrides).
func isZoneSubdirective(name string) bool {
	switch name {
	case "key", "empty_key", "algorithm", "capacity", "refill_rate", "limit", "window", "period", "time_zone", "cost", "max_cost", "max_wait", "match",
		"count_status", "charge", "hold_max", "lease":
		return true
	}
	return false
}

// zoneParser fills one Zone from its subdirectives, whether they are in a zone block or at the top
// level (the shorthand), and checks them together once the zone ends.
type zoneParser struct {
	zone *Zone
	// start is where errors about the zone as a whole point: the zone's name, or for the
	// shorthand its first subdirective.
	start caddyfile.Token
	seen  seenSubdirectives
	cost  int64 // the cost when it is an integer literal
}

func newZoneParser(start caddyfile.Token, name string) *zoneParser {
	return &zoneParser{zone: &Zone{Name: name}, start: start, seen: make(seenSubdirectives)}
}

// subdirective parses the zone subdirective at the cursor. At the top level, only those of
// isZoneSubdirective come here.
func (p *zoneParser) subdirective(d *caddyfile.Dispenser) error {
	if err := p.seen.add(d); err != nil {
		return err
	}
	z := p.zone
	switch d.Val() {
	case "key":
		var err error
		z.Key, err = someArgs(d)
		return err
	case "empty_key":
		return stringArg(d, &z.EmptyKey, oneOf(EmptyKeyShared, EmptyKeySkip, EmptyKeyDeny))
	case "algorithm":
		return stringArg(d, &z.Algorithm, oneOf(tokenBucketName, slidingWindowName, fixedWindowName, slidingWindowCounterName, concurrencyName))
	case "capacity", "refill_rate", "limit", "window", "max_cost":
		return p.number(d)
	case "period":
		return stringArg(d, &z.Period, oneOf("hour", "day", "week", "month"))
	case "time_zone":
		return stringArg(d, &z.TimeZone, checkTimeZone)
	case "cost":
		return p.parseCost(d)
	case "max_wait":
		return parseMaxWait(d, &z.MaxWait)
	case "match":
		return parseMatch(d, &z.MatcherSetsRaw)
	case "count_status", "charge", "hold_max":
		return p.afterSubdirective(d)
	case "lease":
		return p.parseLease(d)
	case "fail_mode", "ipv4_prefix", "ipv6_prefix", "jitter":
		return parseOverride(d, overrides{&z.FailMode, &z.IPv4Prefix, &z.IPv6Prefix, func(j caddy.Duration) { z.Jitter = &j }})
	}
	return d.Errf("unrecognized subdirective %q", d.Val())
}

// checkTimeZone checks the argument of time_zone.
func checkTimeZone(v string) error {
	if _, err := time.LoadLocation(v); err != nil || v == "" || v == "Local" {
		return fmt.Errorf("%q is not a time zone of the IANA database (such as UTC or Europe/Paris)", v)
	}
	return nil
}

// parseCost parses the cost subdirective at the cursor: an integer > 0, also kept in p.cost, or a
// placeholder.
func (p *zoneParser) parseCost(d *caddyfile.Dispenser) error {
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	if hasPlaceholder(v) {
		p.zone.Cost = v
		return nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if errors.Is(err, strconv.ErrRange) {
		return d.Errf("cost: %q is out of range", v)
	}
	if err != nil {
		return d.Errf("cost: %q is not an integer or a placeholder", v)
	}
	if n <= 0 {
		return d.Errf("cost: %q must be > 0", v)
	}
	p.cost = n
	p.zone.Cost = strconv.FormatInt(n, 10)
	return nil
}

// parseMaxWait parses the max_wait subdirective at the cursor into *field.
func parseMaxWait(d *caddyfile.Dispenser, field *caddy.Duration) error {
	v, dur, err := durationValue(d)
	switch {
	case err != nil:
		return err
	case dur <= 0:
		return d.Errf("max_wait: %q must be > 0 (leave max_wait out to reject at once)", v)
	case dur > limiter.MaxMaxWait:
		return d.Errf("max_wait: %q is longer than %s: a request held that long outlasts most clients' timeouts; "+
			"let it come back instead (429 and Retry-After)", v, limiter.MaxMaxWait)
	}
	*field = caddy.Duration(dur)
	return nil
}

// parseMatch parses the match subdirective at the cursor, on one line or with a block, into
// *field.
func parseMatch(d *caddyfile.Dispenser, field *caddyhttp.RawMatcherSets) error {
	matchToken := d.Token()
	set, err := caddyhttp.ParseCaddyfileNestedMatcherSet(d)
	if err != nil {
		return err
	}
	if len(set) == 0 {
		return errAt(matchToken, "match: no matchers given; write them on the line (match path /login) or in a block")
	}
	*field = caddyhttp.RawMatcherSets{set}
	return nil
}

// number parses the number subdirective at the cursor (capacity, refill_rate, limit, window,
// max_cost): a literal, or a placeholder resolved per request and optionally a literal fallback
// for when it is empty. The literal or the fallback goes into the zone's field, the
// placeholder's text into z.exprs, as JSON has them.
func (p *zoneParser) number(d *caddyfile.Dispenser) error {
	name := d.Val()
	f, _ := numFieldNamed(name)
	args, err := someArgs(d)
	if err != nil {
		return err
	}
	text := strings.Join(args, " ")
	expr, literal, err := splitNumberExpr(text)
	if err != nil {
		return d.Errf("%s: %v", name, err)
	}
	if expr != "" {
		p.zone.exprs[f] = strings.Join(strings.Fields(text), " ")
	}
	if literal == "" {
		p.zone.setNumber(f, numValue{})
		return nil
	}
	// A counter (fixed_window, sliding_window_counter) takes a limit up to 2^53, a sliding window
	// log 1,000,000: checked in finish when the algorithm is not known yet.
	v, err := parseNumber(f, literal, limiter.MaxCapacity)
	if err != nil && f == numLimit && strings.Contains(err.Error(), "out of range") && (p.zone.Algorithm == slidingWindowName || p.zone.Algorithm == "") {
		return d.Errf("limit: %q is out of range (1 to %d)", literal, limiter.MaxLimit)
	}
	if err != nil {
		return d.Errf("%s: %v", name, err)
	}
	p.zone.setNumber(f, v)
	return nil
}

// finish checks the subdirectives of the zone against each other, once all have been parsed.
// An error about one subdirective points at it; one about a missing subdirective at p.start.
func (p *zoneParser) finish() error {
	z := p.zone
	if len(p.seen) == 0 {
		return errAt(p.start, "zone %q has no parameters: a %s zone needs capacity and refill_rate, a %s zone limit and window",
			z.Name, tokenBucketName, slidingWindowName)
	}
	algorithm, hint := z.Algorithm, ""
	if algorithm == "" {
		algorithm, hint = tokenBucketName, " (the default when no algorithm is given)"
	}
	if err := p.finishParameters(algorithm, hint); err != nil {
		return err
	}
	if err := p.finishCost(algorithm); err != nil {
		return err
	}
	return p.finishAfter(algorithm)
}

// finishParameters checks that the zone has its algorithm's parameters, and no other algorithm's.
// hint follows the algorithm's name in an error.
func (p *zoneParser) finishParameters(algorithm, hint string) error {
	z := p.zone
	if tok, ok := p.seen["limit"]; ok && z.Limit > limiter.MaxLimit && (algorithm == slidingWindowName || algorithm == tokenBucketName) {
		return errAt(tok, "limit: %q is out of range (1 to %d)", strconv.FormatInt(z.Limit, 10), limiter.MaxLimit)
	}
	if tok, ok := p.seen["limit"]; ok && z.Limit > limiter.MaxConcurrency && algorithm == concurrencyName {
		return errAt(tok, "limit: %q is out of range (1 to %d requests in flight)", strconv.FormatInt(z.Limit, 10), limiter.MaxConcurrency)
	}
	// Each subdirective of an algorithm's parameters, and the algorithm it belongs to in the
	// error when another algorithm is used.
	owner := map[string]string{"capacity": tokenBucketName, "refill_rate": tokenBucketName,
		"limit": slidingWindowName, "window": slidingWindowName, "period": fixedWindowName, "time_zone": fixedWindowName}
	allowed := map[string]bool{"capacity": true, "refill_rate": true}
	own := []string{"capacity", "refill_rate"}
	if algorithm != tokenBucketName {
		allowed = map[string]bool{"limit": true, "window": true}
		own = []string{"limit", "window"}
	}
	if algorithm == fixedWindowName {
		allowed["period"], allowed["time_zone"] = true, true
		own = []string{"limit"}
	}
	if algorithm == concurrencyName {
		allowed = map[string]bool{"limit": true}
		own = []string{"limit"}
	}
	for _, name := range []string{"capacity", "refill_rate", "limit", "window", "period", "time_zone"} {
		if tok, ok := p.seen[name]; ok && !allowed[name] {
			return errAt(tok, "%s belongs to algorithm %s, not %s%s", name, owner[name], algorithm, hint)
		}
	}
	for _, name := range own {
		if _, ok := p.seen[name]; !ok {
			return errAt(p.start, "zone %q: %s is required for algorithm %s", z.Name, name, algorithm)
		}
	}
	if err := p.finishConcurrency(algorithm); err != nil {
		return err
	}
	if tok, ok := p.seen["max_wait"]; ok && algorithm != tokenBucketName {
		// A token bucket's debt is an exact queue; a window's quota comes back in steps.
		return errAt(tok, "max_wait applies to algorithm %s only, not %s: a window gives its quota back in steps, "+
			"so a held request would have no exact turn; shape with a %s zone", tokenBucketName, algorithm, tokenBucketName)
	}
	if algorithm == fixedWindowName {
		return p.finishFixedWindow()
	}
	return nil
}

// finishConcurrency refuses in a concurrency zone what does not apply to it: max_wait (no queue
// waits for a slot, for now), cost and max_cost (a request takes one slot), count_status and
// charge (a slot is given back when its response ends, whatever it was).
func (p *zoneParser) finishConcurrency(algorithm string) error {
	if algorithm != concurrencyName {
		return nil
	}
	if tok, ok := p.seen["max_wait"]; ok {
		return errAt(tok, "max_wait does not apply to algorithm %s: a request is admitted while one of its client's slots is free, "+
			"else denied (429); no queue waits for a slot", concurrencyName)
	}
	for _, name := range []string{"cost", "max_cost"} {
		if tok, ok := p.seen[name]; ok {
			return errAt(tok, "%s does not apply to algorithm %s: a request takes one slot while it runs", name, concurrencyName)
		}
	}
	for _, name := range []string{"count_status", "charge"} {
		if tok, ok := p.seen[name]; ok {
			return errAt(tok, "%s does not apply to algorithm %s: a slot is given back when its response is complete, whatever it was", name, concurrencyName)
		}
	}
	if tok, ok := p.seen["hold_max"]; ok && time.Duration(p.zone.HoldMax) < MinSlotHold {
		return errAt(tok, "hold_max %s: a %s zone's slots are refreshed every third of it; at least %s", time.Duration(p.zone.HoldMax), concurrencyName, MinSlotHold)
	}
	return nil
}

// finishFixedWindow checks that a fixed_window zone has a window or a period, and a time_zone only
// with a period.
func (p *zoneParser) finishFixedWindow() error {
	_, hasWindow := p.seen["window"]
	period, hasPeriod := p.seen["period"]
	switch {
	case hasWindow && hasPeriod:
		return errAt(period, "period: a %s zone has a window or a period, not both", fixedWindowName)
	case !hasWindow && !hasPeriod:
		return errAt(p.start, "zone %q: window or period is required for algorithm %s", p.zone.Name, fixedWindowName)
	}
	if tok, ok := p.seen["time_zone"]; ok && !hasPeriod {
		return errAt(tok, "time_zone applies to a period (period day), not to a window")
	}
	return nil
}

// finishCost checks cost and max_cost against the quota, and the time a token bucket takes to
// refill.
//
// Numbers from placeholders are checked against each other per request, where they are known
// (Zone.finishNumbers): here only what every value they can take would break. A quota from a
// placeholder bounds cost and max_cost per request (a cost above it is a 429 without
// Retry-After, a max_cost above it counts as the quota); a max_cost from one is bounded by the
// quota, and by 1000 for a sliding window, per request. A fallback counts as a literal for the
// refill time: it is what an empty placeholder gives. Provision and Validate check the same
// (Zone.probe).
func (p *zoneParser) finishCost(algorithm string) error {
	z := p.zone
	quotaName, quota, quotaField := "capacity", z.Capacity, numCapacity
	if algorithm != tokenBucketName {
		quotaName, quota, quotaField = "limit", z.Limit, numLimit
	}
	quotaDynamic, maxCostDynamic := z.dynamic(quotaField), z.dynamic(numMaxCost)
	if p.cost > quota && !quotaDynamic {
		return errAt(p.seen["cost"], "cost %d is larger than %s %d: no request could ever be admitted",
			p.cost, quotaName, quota)
	}
	if tok, ok := p.seen["max_cost"]; ok && !maxCostDynamic {
		if z.MaxCost > quota && !quotaDynamic {
			return errAt(tok, "max_cost %d is larger than %s %d", z.MaxCost, quotaName, quota)
		}
		if p.cost > z.MaxCost {
			return errAt(p.seen["cost"], "cost %d is larger than max_cost %d: no request could ever be admitted", p.cost, z.MaxCost)
		}
		if algorithm == slidingWindowName && hasPlaceholder(z.Cost) && z.MaxCost > MaxSlidingWindowCost {
			return errAt(tok, "max_cost %d: a %s zone stores one entry per unit of cost, so a cost from a placeholder "+
				"(chosen per request) is bounded by max_cost %d at most; use %s for larger costs", z.MaxCost, slidingWindowName, MaxSlidingWindowCost, tokenBucketName)
		}
	}
	if algorithm == tokenBucketName && !z.dynamicNoFallback(numRefillRate) {
		capacity := z.Capacity
		if z.dynamicNoFallback(numCapacity) {
			capacity = 1 // the least it can be: a slower refill fails for every capacity
		}
		if fill := float64(capacity) / z.RefillRate; fill > limiter.MaxWindow.Seconds() {
			return errAt(p.seen["refill_rate"], "zone %q: an empty bucket takes %.0fs to refill (capacity / refill_rate); at most %s is supported",
				z.Name, fill, formatDuration(limiter.MaxWindow))
		}
	}
	return nil
}

// parseRefillRate parses `<n>[/<duration>]` into tokens per second. Its errors quote at most 32
// bytes of s (quoteBounded).
func parseRefillRate(s string) (float64, error) {
	num, per, hasPer := strings.Cut(s, "/")
	n, err := strconv.ParseFloat(num, 64)
	if err != nil || math.IsNaN(n) || math.IsInf(n, 0) {
		return 0, fmt.Errorf("%s is not a number of tokens, optionally per a duration (10, 100/1m)", quoteBounded(s))
	}
	if n <= 0 {
		return 0, fmt.Errorf("%s must be > 0", quoteBounded(s))
	}
	if !hasPer {
		return n, nil
	}
	dur, err := caddy.ParseDuration(per)
	if err != nil {
		return 0, fmt.Errorf("%s: %s is not a duration", quoteBounded(s), quoteBounded(per))
	}
	if dur <= 0 {
		return 0, fmt.Errorf("%s: the duration must be > 0", quoteBounded(s))
	}
	rate := n / dur.Seconds()
	if rate <= 0 || math.IsInf(rate, 0) {
		return 0, fmt.Errorf("%s is out of range", quoteBounded(s))
	}
	return rate, nil
}

// hasPlaceholder reports whether s holds something of the form {…}.
func hasPlaceholder(s string) bool {
	open := strings.IndexByte(s, '{')
	return open >= 0 && strings.IndexByte(s[open:], '}') > 1
}

// formatDuration formats whole days as caddy.ParseDuration writes them (366d), else as
// time.Duration does.
func formatDuration(dur time.Duration) string {
	const day = 24 * time.Hour
	if dur >= day && dur%day == 0 {
		return strconv.FormatInt(int64(dur/day), 10) + "d"
	}
	return dur.String()
}

// seenSubdirectives records the subdirectives of one block, by name, to reject repeated ones and
// to point later errors at them.
type seenSubdirectives map[string]caddyfile.Token

// add records the subdirective at the cursor, or returns an error if the block had it already.
func (s seenSubdirectives) add(d *caddyfile.Dispenser) error {
	if _, dup := s[d.Val()]; dup {
		return d.Errf("duplicate subdirective %q", d.Val())
	}
	s[d.Val()] = d.Token()
	return nil
}

// errAt is d.Errf for a token other than the dispenser's current one: the error names the
// token's file and line (and import chain).
func errAt(tok caddyfile.Token, format string, args ...any) error {
	d := caddyfile.NewDispenser([]caddyfile.Token{tok})
	d.Next()
	return d.Errf(format, args...)
}

// oneArg returns the one argument of the subdirective at the cursor; none, more than one, or a
// block after it is an error.
func oneArg(d *caddyfile.Dispenser) (string, error) {
	name := d.Val()
	if !d.NextArg() {
		return "", d.ArgErr()
	}
	v := d.Val()
	if d.NextArg() {
		switch name { // never echo a piece of a secret
		case "password":
			return "", d.Errf("password: too many arguments (quote a password that contains spaces)")
		case "key_secret":
			return "", d.Errf("key_secret: too many arguments (quote a secret that contains spaces)")
		}
		return "", d.Errf("%s: unexpected argument %q", name, d.Val())
	}
	return v, noBlock(d, name)
}

// someArgs returns the one or more arguments of the subdirective at the cursor; none, or a block
// after them, is an error.
func someArgs(d *caddyfile.Dispenser) ([]string, error) {
	name := d.Val()
	args := d.RemainingArgs()
	if len(args) == 0 {
		return nil, d.ArgErr()
	}
	return args, noBlock(d, name)
}

// noArgs checks that the subdirective at the cursor has neither arguments nor a block.
func noArgs(d *caddyfile.Dispenser) error {
	name := d.Val()
	if err := noArgsBeforeBlock(d); err != nil {
		return err
	}
	return noBlock(d, name)
}

// noArgsBeforeBlock checks that the subdirective at the cursor has no arguments; it may have a
// block.
func noArgsBeforeBlock(d *caddyfile.Dispenser) error {
	name := d.Val()
	if d.NextArg() {
		return d.Errf("%s: unexpected argument %q; it takes no arguments", name, d.Val())
	}
	return nil
}

// noBlock checks that no block, not even an empty one, follows the subdirective name, whose
// arguments have all been read.
func noBlock(d *caddyfile.Dispenser, name string) error {
	if d.NextLine() {
		d.Prev() // leave the next line to the caller's loop
		return nil
	}
	// The next token, if any, is on this line, and not an argument: it opens a block.
	if d.Next() {
		return d.Errf("%s: unexpected block", name)
	}
	return nil
}

// stringArg reads the one argument of the subdirective at the cursor into *field, if every check
// passes it; a check's error follows the subdirective's name.
func stringArg(d *caddyfile.Dispenser, field *string, checks ...func(string) error) error {
	name := d.Val()
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	for _, check := range checks {
		if err := check(v); err != nil {
			return d.Errf("%s: %v", name, err)
		}
	}
	*field = v
	return nil
}

// oneOf returns a check for stringArg that the argument is one of values.
func oneOf(values ...string) func(string) error {
	return func(v string) error {
		if slices.Contains(values, v) {
			return nil
		}
		last := len(values) - 1
		return fmt.Errorf("%q must be %s or %s", v, strings.Join(values[:last], ", "), values[last])
	}
}

// onOffArg reads the one argument of the subdirective at the cursor, on or off, into *field.
func onOffArg(d *caddyfile.Dispenser, field **bool) error {
	var v string
	if err := stringArg(d, &v, oneOf("on", "off")); err != nil {
		return err
	}
	*field = new(v == "on")
	return nil
}

// flagArg sets *field for the subdirective at the cursor, which takes no arguments.
func flagArg(d *caddyfile.Dispenser, field *bool) error {
	if err := noArgs(d); err != nil {
		return err
	}
	*field = true
	return nil
}

// durationArg reads the one argument of the subdirective at the cursor, a duration > 0, into
// *field.
func durationArg(d *caddyfile.Dispenser, field *caddy.Duration) error {
	dur, err := positiveDuration(d)
	if err != nil {
		return err
	}
	*field = caddy.Duration(dur)
	return nil
}

// durationValue parses the one argument of the subdirective at the cursor as a duration; it
// returns the argument too, for the caller's range errors.
func durationValue(d *caddyfile.Dispenser) (string, time.Duration, error) {
	name := d.Val()
	v, err := oneArg(d)
	if err != nil {
		return "", 0, err
	}
	dur, err := caddy.ParseDuration(v)
	if err != nil {
		return "", 0, d.Errf("%s: %q is not a duration", name, v)
	}
	return v, dur, nil
}

// positiveDuration parses the one argument of the subdirective at the cursor as a duration > 0.
func positiveDuration(d *caddyfile.Dispenser) (time.Duration, error) {
	name := d.Val()
	v, dur, err := durationValue(d)
	switch {
	case err != nil:
		return 0, err
	case dur <= 0:
		return 0, d.Errf("%s: %q must be > 0", name, v)
	}
	return dur, nil
}

// jitterDuration parses the one argument of the jitter subdirective at the cursor: a duration
// of a whole number of seconds, >= 0.
func jitterDuration(d *caddyfile.Dispenser) (time.Duration, error) {
	v, dur, err := durationValue(d)
	switch {
	case err != nil:
		return 0, err
	case dur < 0:
		return 0, d.Errf("jitter: %q must be >= 0", v)
	case dur%time.Second != 0:
		return 0, d.Errf("jitter: %q must be a whole number of seconds (Retry-After is in seconds)", v)
	}
	return dur, nil
}

// intInRange reads the one argument of the subdirective at the cursor, an integer from 1 to
// maxValue, into *field.
func intInRange(d *caddyfile.Dispenser, field *int, maxValue int64) error {
	name := d.Val()
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return d.Errf("%s: %q is not an integer", name, v)
	}
	if err != nil || n < 1 || n > maxValue {
		return d.Errf("%s: %q is out of range (1 to %d)", name, v, maxValue)
	}
	*field = int(n)
	return nil
}

// intAtLeast reads the one argument of the subdirective at the cursor, an int of at least
// minValue, into *field; its errors name the subdirective and the value.
func intAtLeast(d *caddyfile.Dispenser, field *int, minValue int) error {
	name := d.Val()
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		return d.Errf("%s: %q is not an integer", name, v)
	}
	if n < minValue {
		return d.Errf("%s: %q must be >= %d", name, v, minValue)
	}
	*field = n
	return nil
}

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*Handler)(nil)
)
