package ratelimitredis

import (
	"errors"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
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
	if names[name] {
		return nil, d.Errf("%v", errZoneNameTwice(name))
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

// isZoneSubdirective reports whether name, written at the top level, is a zone subdirective: the
// shorthand for a zone named "default". A name the handler has too (fail_mode, dry_run,
// ipv4_prefix, ipv6_prefix, jitter, no_retry_over) is the handler's there, for every zone.
func isZoneSubdirective(name string) bool {
	_, zone := zoneSubdirectives[name]
	_, handler := handlerSubdirectives[name]
	return zone && !handler
}

// zoneSubdirectives parses each subdirective of a zone block into the zone. They check the syntax
// only; the zone's validation checks the values when the zone ends (zoneParser.finish).
var zoneSubdirectives = map[string]func(*zoneParser, *caddyfile.Dispenser) error{
	"key":             func(p *zoneParser, d *caddyfile.Dispenser) error { return argsArg(d, &p.zone.Key) },
	"empty_key":       func(p *zoneParser, d *caddyfile.Dispenser) error { return stringArg(d, &p.zone.EmptyKey) },
	"algorithm":       func(p *zoneParser, d *caddyfile.Dispenser) error { return stringArg(d, &p.zone.Algorithm) },
	"capacity":        (*zoneParser).number,
	"refill_rate":     (*zoneParser).number,
	"limit":           (*zoneParser).number,
	"window":          (*zoneParser).number,
	"max_cost":        (*zoneParser).number,
	"period":          func(p *zoneParser, d *caddyfile.Dispenser) error { return stringArg(d, &p.zone.Period) },
	"time_zone":       func(p *zoneParser, d *caddyfile.Dispenser) error { return stringArg(d, &p.zone.TimeZone) },
	"cost":            (*zoneParser).parseCost,
	"max_wait":        func(p *zoneParser, d *caddyfile.Dispenser) error { return optDurationArg(d, &p.zone.MaxWait) },
	"priority":        func(p *zoneParser, d *caddyfile.Dispenser) error { return parsePriority(d, p.zone) },
	"fair_by":         func(p *zoneParser, d *caddyfile.Dispenser) error { return stringArg(d, &p.zone.FairBy) },
	"fair_tenants":    func(p *zoneParser, d *caddyfile.Dispenser) error { return intAtLeast(d, &p.zone.FairTenants, 1) },
	"match":           func(p *zoneParser, d *caddyfile.Dispenser) error { return parseMatch(d, &p.zone.MatcherSetsRaw) },
	"count_status":    func(p *zoneParser, d *caddyfile.Dispenser) error { return argsArg(d, &p.zone.CountStatus) },
	"charge":          (*zoneParser).parseCharge,
	"cap_output":      (*zoneParser).parseCapOutput,
	"hold_max":        func(p *zoneParser, d *caddyfile.Dispenser) error { return durationArg(d, &p.zone.HoldMax) },
	"lease":           (*zoneParser).parseLease,
	"block":           func(p *zoneParser, d *caddyfile.Dispenser) error { return durationArg(d, &p.zone.Block) },
	"block_max":       func(p *zoneParser, d *caddyfile.Dispenser) error { return durationArg(d, &p.zone.BlockMax) },
	"overrides":       func(p *zoneParser, d *caddyfile.Dispenser) error { return flagArg(d, &p.zone.Overrides) },
	"dry_run":         func(p *zoneParser, d *caddyfile.Dispenser) error { return flagArg(d, &p.zone.DryRun) },
	"top":             (*zoneParser).parseTop,
	"top_window":      func(p *zoneParser, d *caddyfile.Dispenser) error { return durationArg(d, &p.zone.TopWindow) },
	"near_limit":      func(p *zoneParser, d *caddyfile.Dispenser) error { return fractionArg(d, &p.zone.NearLimit) },
	"fail_mode":       func(p *zoneParser, d *caddyfile.Dispenser) error { return stringArg(d, &p.zone.FailMode) },
	"ipv4_prefix":     func(p *zoneParser, d *caddyfile.Dispenser) error { return intArg(d, &p.zone.IPv4Prefix) },
	"ipv6_prefix":     func(p *zoneParser, d *caddyfile.Dispenser) error { return intArg(d, &p.zone.IPv6Prefix) },
	"jitter":          (*zoneParser).parseJitter,
	"no_retry_over":   func(p *zoneParser, d *caddyfile.Dispenser) error { return parseNoRetryOver(d, &p.zone.NoRetryOver) },
	"min_limit":       func(p *zoneParser, d *caddyfile.Dispenser) error { return intAtLeast(d, &p.zone.MinLimit, 1) },
	"buffer":          func(p *zoneParser, d *caddyfile.Dispenser) error { return fractionArg(d, &p.zone.Buffer) },
	"update_interval": func(p *zoneParser, d *caddyfile.Dispenser) error { return durationArg(d, &p.zone.UpdateInterval) },
	"probe_interval":  func(p *zoneParser, d *caddyfile.Dispenser) error { return durationArg(d, &p.zone.ProbeInterval) },
	"probe_samples":   func(p *zoneParser, d *caddyfile.Dispenser) error { return intAtLeast(d, &p.zone.ProbeSamples, 1) },
}

// zoneParser fills one Zone from its subdirectives, whether they are in a zone block or at the top
// level (the shorthand), and validates it once the zone ends.
type zoneParser struct {
	zone *Zone
	// start is where errors about the zone as a whole point: the zone's name, or for the
	// shorthand its first subdirective.
	start caddyfile.Token
	seen  seenSubdirectives
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
	if parse, ok := zoneSubdirectives[d.Val()]; ok {
		return parse(p, d)
	}
	return errUnrecognized(d)
}

// parseCost parses the cost subdirective at the cursor: an integer is written as it parses
// (05 as 5), anything else as it is, a placeholder or what the zone's validation reports.
func (p *zoneParser) parseCost(d *caddyfile.Dispenser) error {
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	if n, err := strconv.ParseInt(v, 10, 64); err == nil {
		v = strconv.FormatInt(n, 10)
	}
	p.zone.Cost = v
	return nil
}

// parseJitter parses a zone's jitter subdirective at the cursor: a duration, not
// caddy-ratelimit's fraction (checkMholtJitter).
func (p *zoneParser) parseJitter(d *caddyfile.Dispenser) error {
	if err := checkMholtJitter(d); err != nil {
		return err
	}
	return optDurationArg(d, &p.zone.Jitter)
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
// for when it is empty. A literal that parses goes into the zone's field as a JSON number, so
// that `caddy adapt` prints it as one; a placeholder, or a literal the zone's validation will
// report, as the string written.
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
	*p.zone.number(f) = NumberText(text)
	if expr == "" {
		// The widest range: a limit's depends on the algorithm, which may come later.
		if v, err := parseNumber(f, literal, limiter.MaxCapacity); err == nil {
			*p.zone.number(f) = literalNumber(f, v)
		}
	}
	return nil
}

// parseCharge parses a zone's charge subdirective at the cursor:
//
//	charge header <field> [scale <n>]
//	charge openai_usage|anthropic_usage|gemini_usage [total|prompt|completion | weights <kind> <n>...] [missing <n>]
//
// where a kind of weights is prompt, completion, cached or cache_write. The values' ranges are
// the zone's validation's.
func (p *zoneParser) parseCharge(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) == 0 {
		return d.Errf("charge: a source is required: header <field> [scale <n>], or openai_usage, anthropic_usage or gemini_usage [total|prompt|completion|weights ...] [missing <n>]")
	}
	c := &Charge{Source: args[0]}
	var err error
	switch args[0] {
	case ChargeHeader:
		err = parseChargeHeader(d, c, args[1:])
	case ChargeOpenAIUsage, ChargeAnthropicUsage, ChargeGeminiUsage:
		err = parseChargeUsage(d, c, args[1:])
	}
	if err != nil {
		return err
	}
	if err := noBlock(d, "charge"); err != nil {
		return err
	}
	p.zone.Charge = c
	return nil
}

// parseCapOutput parses the cap_output subdirective at the cursor: [min_output <n>]
// [default_output <n>] [unreadable refuse|pass] [insert_max_tokens], in any order.
func (p *zoneParser) parseCapOutput(d *caddyfile.Dispenser) error {
	c := &CapOutput{}
	args := d.RemainingArgs()
	for len(args) > 0 {
		if args[0] == "insert_max_tokens" {
			c.InsertMaxTokens = true
			args = args[1:]
			continue
		}
		if len(args) < 2 || (args[0] != "min_output" && args[0] != "default_output" && args[0] != "unreadable") {
			return d.Errf("cap_output: expected min_output <tokens>, default_output <tokens>, unreadable refuse|pass or insert_max_tokens, got %q (cap_output min_output 16 default_output 4096)", args[0])
		}
		if args[0] == "unreadable" {
			c.Unreadable = args[1]
			args = args[2:]
			continue
		}
		n, err := strconv.ParseInt(args[1], 10, 64)
		if err != nil {
			return d.Errf("cap_output: %s %q is not an integer", args[0], args[1])
		}
		if args[0] == "min_output" {
			c.MinOutput = &n
		} else {
			c.DefaultOutput = n
		}
		args = args[2:]
	}
	if err := noBlock(d, "cap_output"); err != nil {
		return err
	}
	p.zone.CapOutput = c
	return nil
}

// parseChargeHeader parses the arguments after `charge header`: <field> [scale <n>].
func parseChargeHeader(d *caddyfile.Dispenser, c *Charge, args []string) error {
	if len(args) != 1 && (len(args) != 3 || args[1] != "scale") {
		return d.Errf("charge header: one response header field name is required, optionally with a scale (charge header X-Tokens-Used, charge header x-litellm-response-cost scale 1000000)")
	}
	c.Header = args[0]
	if len(args) == 3 {
		v, err := strconv.ParseFloat(args[2], 64)
		if err != nil || v == 0 {
			return d.Errf("charge header: scale %q is not a number greater than 0", args[2])
		}
		c.Scale = v
	}
	return nil
}

// parseChargeUsage parses the arguments after `charge openai_usage` (or anthropic_usage,
// gemini_usage):
// [total|prompt|completion | weights <kind> <n>...] [missing <n>].
func parseChargeUsage(d *caddyfile.Dispenser, c *Charge, rest []string) error {
	source := "charge " + c.Source
	switch {
	case len(rest) > 0 && rest[0] == "weights":
		c.Weights = new(ChargeWeights)
		rest = rest[1:]
		n := 0
		for ; len(rest) > 0 && rest[0] != "missing"; rest = rest[2:] {
			if err := parseWeight(d, source, c.Weights, rest); err != nil {
				return err
			}
			n++
		}
		if n == 0 {
			return d.Errf("%s: weights needs at least one weight: prompt, completion, cached or cache_write, each followed by a number (weights prompt 1 completion 4 cached 0.1)", source)
		}
	case len(rest) > 0 && rest[0] != "missing":
		c.Usage, rest = rest[0], rest[1:]
	}
	if len(rest) > 0 && rest[0] == "missing" {
		if len(rest) < 2 {
			return d.Errf("%s: missing needs the amount a response without usage is charged (missing 4000)", source)
		}
		n, err := strconv.ParseInt(rest[1], 10, 64)
		if err != nil {
			return d.Errf("%s: missing %q is not an integer", source, rest[1])
		}
		c.Missing, rest = &n, rest[2:]
	}
	if len(rest) > 0 {
		return d.Errf("%s: unexpected argument %q", source, rest[0])
	}
	return nil
}

// parseWeight parses the weight at the start of args, `<kind> <n>`, into w.
func parseWeight(d *caddyfile.Dispenser, source string, w *ChargeWeights, args []string) error {
	fields := map[string]**Weight{"prompt": &w.Prompt, "completion": &w.Completion, "cached": &w.Cached, "cache_write": &w.CacheWrite}
	field, ok := fields[args[0]]
	switch {
	case !ok:
		return d.Errf("%s: unknown weight %q: prompt, completion, cached or cache_write", source, args[0])
	case *field != nil:
		return d.Errf("%s: weight %s given twice", source, args[0])
	case len(args) < 2:
		return d.Errf("%s: weight %s needs a number or a placeholder", source, args[0])
	}
	v, err := WeightText(args[1])
	if err != nil {
		return d.Errf("%s: weight %s %q is not a number or a placeholder", source, args[0], args[1])
	}
	*field = v
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
	seen := make(seenSubdirectives)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if d.Val() != "max" && d.Val() != "ttl" {
			return d.Errf("lease: unrecognized subdirective %q (max, ttl)", d.Val())
		}
		if err := seen.add(d); err != nil {
			return err
		}
		if d.Val() == "ttl" {
			_, dur, err := durationValue(d)
			if err != nil {
				return err
			}
			le.TTL = caddy.Duration(dur)
			continue
		}
		v, err := oneArg(d)
		if err != nil {
			return err
		}
		if le.Max, err = strconv.ParseInt(v, 10, 64); err != nil {
			return d.Errf("lease max: %q is not an integer", v)
		}
	}
	p.zone.Lease = le
	return nil
}

// finish validates the zone once all its subdirectives have been parsed, as Validate does for a
// JSON config (Zone.validate): an error about one field points at its subdirective, one about
// the zone as a whole at p.start.
func (p *zoneParser) finish() error {
	err := p.zone.validate()
	if err == nil {
		return nil
	}
	tok := p.start
	var fe *limiter.FieldError
	if errors.As(err, &fe) {
		if t, ok := p.seen[fe.Field]; ok {
			tok = t
		}
		p.mholtWindow(fe)
	}
	return errAt(tok, "%v", err)
}

// parseTop reads `top <entries>`: the zone's top's size (its range is the validation's).
func (p *zoneParser) parseTop(d *caddyfile.Dispenser) error {
	var n *int
	if err := intArg(d, &n); err != nil {
		return err
	}
	p.zone.Top = *n
	return nil
}
