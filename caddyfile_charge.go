package ratelimitredis

import (
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
)

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
