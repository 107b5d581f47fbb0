package ratelimitredis

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
)

// The zone block of the Caddyfile (and the shorthand's zone subdirectives at the top level).

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
	// vals are the numbers' literals, or their fallbacks; 0 without one.
	vals [numFields]numValue
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
// for when it is empty. A literal goes into the zone's field as a JSON number, so that `caddy
// adapt` prints it as one; a placeholder as the string written.
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
		*p.zone.number(f) = NumberText(text)
	}
	if literal == "" {
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
	p.vals[f] = v
	if expr == "" {
		*p.zone.number(f) = literalNumber(f, v)
	}
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
	limit := p.vals[numLimit].n
	if tok, ok := p.seen["limit"]; ok && limit > limiter.MaxLimit && (algorithm == slidingWindowName || algorithm == tokenBucketName) {
		return errAt(tok, "limit: %q is out of range (1 to %d)", strconv.FormatInt(limit, 10), limiter.MaxLimit)
	}
	if tok, ok := p.seen["limit"]; ok && limit > limiter.MaxConcurrency && algorithm == concurrencyName {
		return errAt(tok, "limit: %q is out of range (1 to %d requests in flight)", strconv.FormatInt(limit, 10), limiter.MaxConcurrency)
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
	quotaName, quota, quotaField := "capacity", p.vals[numCapacity].n, numCapacity
	if algorithm != tokenBucketName {
		quotaName, quota, quotaField = "limit", p.vals[numLimit].n, numLimit
	}
	quotaDynamic, _ := z.number(quotaField).placeholder()
	maxCostDynamic, _ := z.MaxCost.placeholder()
	maxCost := p.vals[numMaxCost].n
	if p.cost > quota && !quotaDynamic {
		return errAt(p.seen["cost"], "cost %d is larger than %s %d: no request could ever be admitted",
			p.cost, quotaName, quota)
	}
	if tok, ok := p.seen["max_cost"]; ok && !maxCostDynamic {
		if maxCost > quota && !quotaDynamic {
			return errAt(tok, "max_cost %d is larger than %s %d", maxCost, quotaName, quota)
		}
		if p.cost > maxCost {
			return errAt(p.seen["cost"], "cost %d is larger than max_cost %d: no request could ever be admitted", p.cost, maxCost)
		}
		if algorithm == slidingWindowName && hasPlaceholder(z.Cost) && maxCost > MaxSlidingWindowCost {
			return errAt(tok, "max_cost %d: a %s zone stores one entry per unit of cost, so a cost from a placeholder "+
				"(chosen per request) is bounded by max_cost %d at most; use %s for larger costs", maxCost, slidingWindowName, MaxSlidingWindowCost, tokenBucketName)
		}
	}
	if algorithm == tokenBucketName && !z.RefillRate.noFallback() {
		capacity := p.vals[numCapacity].n
		if z.Capacity.noFallback() {
			capacity = 1 // the least it can be: a slower refill fails for every capacity
		}
		if fill := float64(capacity) / p.vals[numRefillRate].rate; fill > limiter.MaxWindow.Seconds() {
			return errAt(p.seen["refill_rate"], "zone %q: an empty bucket takes %.0fs to refill (capacity / refill_rate); at most %s is supported",
				z.Name, fill, formatDuration(limiter.MaxWindow))
		}
	}
	return nil
}

// afterSubdirective parses a zone's count_status, charge or hold_max at the cursor (already
// recorded in p.seen). Syntax:
//
//	count_status <code|Nxx>...
//	charge header <field>
//	charge openai_usage [total|prompt|completion] [missing <n>]
//	hold_max <duration>
func (p *zoneParser) afterSubdirective(d *caddyfile.Dispenser) error {
	z := p.zone
	switch d.Val() {
	case "count_status":
		args, err := someArgs(d)
		if err != nil {
			return err
		}
		for _, s := range args {
			if _, _, err := parseStatus(s); err != nil {
				return d.Errf("count_status: %v", err)
			}
		}
		z.CountStatus = args

	case "charge":
		args := d.RemainingArgs()
		if len(args) == 0 {
			return d.Errf("charge: a source is required: header <field> or openai_usage [total|prompt|completion] [missing <n>]")
		}
		c := &Charge{Source: args[0]}
		switch args[0] {
		case ChargeHeader:
			if len(args) != 2 {
				return d.Errf("charge header: one response header field name is required (charge header X-Tokens-Used)")
			}
			c.Header = args[1]
		case ChargeOpenAIUsage:
			rest := args[1:]
			if len(rest) > 0 && rest[0] != "missing" {
				switch rest[0] {
				case UsageTotal, UsagePrompt, UsageCompletion:
					c.Usage = rest[0]
				default:
					return d.Errf("charge openai_usage: %q must be total, prompt or completion", rest[0])
				}
				rest = rest[1:]
			}
			if len(rest) > 0 && rest[0] == "missing" {
				if len(rest) < 2 {
					return d.Errf("charge openai_usage: missing needs the amount a response without usage is charged (missing 4000)")
				}
				n, err := strconv.ParseInt(rest[1], 10, 64)
				if err != nil || n < 0 || n > limiter.MaxCapacity {
					return d.Errf("charge openai_usage: missing %q must be an integer between 0 and %d", rest[1], int64(limiter.MaxCapacity))
				}
				c.Missing = &n
				rest = rest[2:]
			}
			if len(rest) > 0 {
				return d.Errf("charge openai_usage: unexpected argument %q", rest[0])
			}
		default:
			return d.Errf("charge: %q must be header or openai_usage", args[0])
		}
		if err := noBlock(d, "charge"); err != nil {
			return err
		}
		z.Charge = c

	case "hold_max":
		dur, err := positiveDuration(d)
		if err != nil {
			return err
		}
		if dur > MaxHoldMax {
			return d.Errf("hold_max: %q is out of range (at most %s)", formatDuration(dur), formatDuration(MaxHoldMax))
		}
		z.HoldMax = caddy.Duration(dur)
	}
	return nil
}

// finishAfter checks count_status, charge and hold_max against the zone's algorithm, once the
// zone is parsed.
func (p *zoneParser) finishAfter(algorithm string) error {
	z := p.zone
	tok, counting := p.seen["count_status"]
	if ctok, ok := p.seen["charge"]; ok {
		tok = ctok
	}
	if z.Charge == nil && !counting {
		if tok, ok := p.seen["hold_max"]; ok && algorithm != concurrencyName {
			return errAt(tok, "hold_max applies to a zone with count_status or charge, or of algorithm concurrency")
		}
		return nil
	}
	if msg := afterAlgorithmError(algorithm, z.Charge != nil); msg != "" {
		return errAt(tok, "%s", msg)
	}
	return nil
}

// parseLease parses a zone's lease block at the cursor:
//
//	lease {
//		max <n>
//		ttl <duration>
//	}
func (p *zoneParser) parseLease(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.Errf("lease: unexpected argument %q (lease takes a block: max and ttl)", d.Val())
	}
	le := new(Lease)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "max":
			v, err := oneArg(d)
			if err != nil {
				return err
			}
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 1 || n > limiter.MaxCapacity {
				return d.Errf("lease max: %q must be an integer between 1 and %d", v, int64(limiter.MaxCapacity))
			}
			le.Max = n
		case "ttl":
			v, dur, err := durationValue(d)
			if err != nil {
				return err
			}
			if dur < limiter.MinLeaseTTL || dur > limiter.MaxLeaseTTL {
				return d.Errf("lease ttl: %q must be between %v and %v", v, limiter.MinLeaseTTL, limiter.MaxLeaseTTL)
			}
			le.TTL = caddy.Duration(dur)
		default:
			return d.Errf("lease: unrecognized subdirective %q (max, ttl)", d.Val())
		}
	}
	if le.Max == 0 || le.TTL == 0 {
		return d.Errf("lease: both max and ttl are required")
	}
	p.zone.Lease = le
	return nil
}
