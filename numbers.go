package ratelimitredis

// Zone numbers from placeholders (plans and tiers): a zone's capacity, refill_rate, limit,
// window and max_cost may each be a placeholder resolved per request, with an optional literal
// fallback, instead of a literal.
//
// Representation. The exported fields (Capacity, RefillRate, Limit, Window, MaxCost) keep their
// types, so that a config of literal numbers reads, marshals and is built in Go as before; a
// number given by a placeholder is kept in Zone.exprs as written ("{plan_capacity} 100": the
// placeholder expression, then the fallback), and its exported field holds the fallback (0: none)
// once provisioned. In JSON such a number is a string, the Caddyfile's arguments joined by a
// space; a number stays a JSON number, so `caddy adapt` prints literal zones exactly as before.
//
// Cost. A zone whose numbers are all literal takes nothing of this per request: ServeHTTP uses
// its provisioned limiter.Zone as before (Zone.dyn is empty). A zone with placeholder numbers
// gets one limiter.Zone copy per request, with the resolved numbers written in.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
)

// numField names a zone number that may come from a placeholder.
type numField uint8

const (
	numCapacity numField = iota
	numRefillRate
	numLimit
	numWindow
	numMaxCost
	numFields
)

var numFieldNames = [numFields]string{"capacity", "refill_rate", "limit", "window", "max_cost"}

func (f numField) String() string { return numFieldNames[f] }

// numFieldNamed returns the numField of a subdirective or JSON field name.
func numFieldNamed(name string) (numField, bool) {
	for f, n := range numFieldNames {
		if n == name {
			return numField(f), true
		}
	}
	return 0, false
}

// MaxNumberBytes bounds the text of a zone number read per request (a placeholder's value, an
// admin API query parameter): a longer value is an error before it is parsed, and no error shows
// more than its first bytes. 64 bytes hold any valid number of every field
// ("9007199254740992", "0.000001/8784h", "8784h0m0s") with room to spare.
const MaxNumberBytes = 64

// numValue is a parsed number: n for capacity, limit and max_cost, rate (tokens per second) for
// refill_rate, dur for window.
type numValue struct {
	n    int64
	rate float64
	dur  time.Duration
}

// errNumberEmpty is the error of an empty number text.
var errNumberEmpty = errors.New("empty")

// parseNumber parses s as a value of field f with the Caddyfile's grammar: an integer from 1 to
// maxInt (capacity, limit, max_cost), `<n>[/<duration>]` tokens per second > 0 (refill_rate), or
// a duration from 1ms to 366d (window). Its errors quote at most the first 32 bytes of s (so
// they are at most a few hundred bytes whatever s), and name neither the field nor where s came
// from: callers add that.
func parseNumber(f numField, s string, maxInt int64) (numValue, error) {
	if s == "" {
		return numValue{}, errNumberEmpty
	}
	if len(s) > MaxNumberBytes {
		return numValue{}, fmt.Errorf("%s (%d bytes) is too long: a number is at most %d bytes", quoteBounded(s), len(s), MaxNumberBytes)
	}
	switch f {
	case numRefillRate:
		rate, err := parseRefillRate(s)
		return numValue{rate: rate}, err
	case numWindow:
		dur, err := caddy.ParseDuration(s)
		if err != nil {
			return numValue{}, fmt.Errorf("%s is not a duration", quoteBounded(s))
		}
		if dur < limiter.MinWindow || dur > limiter.MaxWindow {
			return numValue{}, fmt.Errorf("%s is out of range (%s to %s)", quoteBounded(s), formatDuration(limiter.MinWindow), formatDuration(limiter.MaxWindow))
		}
		return numValue{dur: dur}, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return numValue{}, fmt.Errorf("%s is not an integer", quoteBounded(s))
	}
	if err != nil || n < 1 || n > maxInt {
		return numValue{}, fmt.Errorf("%s is out of range (1 to %d)", quoteBounded(s), maxInt)
	}
	return numValue{n: n}, nil
}

// quoteBounded quotes s, or its first 32 bytes and an ellipsis when it is longer, so that an
// error never carries a client's 100 kB header.
func quoteBounded(s string) string {
	if len(s) <= 32 {
		return strconv.Quote(s)
	}
	return strconv.Quote(s[:32]) + "…"
}

// splitNumberExpr splits a number's text as configured (the Caddyfile's arguments joined by
// spaces, or the JSON string): a literal (expr ""), or a placeholder expression and, optionally
// after a space, a literal fallback. The fallback is checked to be no placeholder, not parsed.
func splitNumberExpr(text string) (expr, fallback string, err error) {
	parts := strings.Fields(text)
	switch {
	case len(parts) == 0:
		return "", "", errNumberEmpty
	case !hasPlaceholder(parts[0]):
		if len(parts) > 1 {
			return "", "", fmt.Errorf("unexpected argument %q", parts[1])
		}
		return "", parts[0], nil
	case len(parts) > 2:
		return "", "", fmt.Errorf("unexpected argument %q", parts[2])
	case len(parts) == 2 && hasPlaceholder(parts[1]):
		return "", "", fmt.Errorf("the fallback %q must be a literal, not a placeholder", parts[1])
	case len(parts) == 2:
		return parts[0], parts[1], nil
	}
	return parts[0], "", nil
}

// dynNumber is a zone number given by a placeholder, as provisioned.
type dynNumber struct {
	field numField
	// expr is the placeholder expression, Caddyfile shorthands expanded: "{http.vars.plan}".
	expr string
	// name is the placeholder's name when expr is exactly one placeholder, which is then looked
	// up directly (no string building); "" otherwise.
	name        string
	hasFallback bool
	// errPrefix begins the errors of this number: "zone api: capacity {plan_capacity}".
	errPrefix string
	errEmpty  error // the placeholder is empty and there is no fallback
}

// value returns the number's text for the request of repl.
func (dn *dynNumber) value(repl *caddy.Replacer) string {
	if dn.name != "" {
		v, _ := repl.GetString(dn.name)
		return v
	}
	return repl.ReplaceAll(dn.expr, "")
}

// singlePlaceholder returns the name of the placeholder that expr is made of, or "" when expr
// is anything else (text around it, several, escaped braces).
func singlePlaceholder(expr string) string {
	if len(expr) < 3 || expr[0] != '{' || expr[len(expr)-1] != '}' {
		return ""
	}
	name := expr[1 : len(expr)-1]
	if strings.ContainsAny(name, "{}\\") {
		return ""
	}
	return name
}

// maxInt is the upper bound of the integer number f in a zone of algorithm algo.
func maxInt(f numField, algo limiter.Algorithm) int64 {
	if f == numLimit && algo == limiter.SlidingWindow {
		return limiter.MaxLimit
	}
	if f == numLimit && algo == limiter.Concurrency {
		return limiter.MaxConcurrency
	}
	return limiter.MaxCapacity
}

// setNumber writes v, a value of field f, into the zone's exported field.
func (z *Zone) setNumber(f numField, v numValue) {
	switch f {
	case numCapacity:
		z.Capacity = v.n
	case numRefillRate:
		z.RefillRate = v.rate
	case numLimit:
		z.Limit = v.n
	case numWindow:
		z.Window = caddy.Duration(v.dur)
	case numMaxCost:
		z.MaxCost = v.n
	}
}

// setLimiterNumber writes v, a value of field f, into lz.
func setLimiterNumber(lz *limiter.Zone, f numField, v numValue) {
	switch f {
	case numCapacity:
		lz.Capacity = v.n
	case numRefillRate:
		lz.RefillRate = v.rate
	case numLimit:
		lz.Limit = v.n
	case numWindow:
		lz.Window = v.dur
	case numMaxCost:
		lz.MaxCost = v.n
	}
}

// dynamic reports whether the zone's number f comes from a placeholder.
func (z *Zone) dynamic(f numField) bool { return z.exprs[f] != "" }

// dynamicNoFallback reports whether the zone's number f comes from a placeholder without a
// fallback (its exported field is then 0).
func (z *Zone) dynamicNoFallback(f numField) bool {
	_, fallback, err := splitNumberExpr(z.exprs[f])
	return z.dynamic(f) && err == nil && fallback == ""
}

// quotaDynamic reports whether the zone's quota (capacity or limit) comes from a placeholder.
func (z *Zone) quotaDynamic(algo limiter.Algorithm) bool {
	if algo == limiter.TokenBucket {
		return z.dynamic(numCapacity)
	}
	return z.dynamic(numLimit)
}

// provisionNumbers parses the zone's placeholder numbers into z.dyn, expanding Caddyfile
// shorthands (with checkPlaceholder's warnings), and writes each one's fallback (0: none) into
// its exported field. algo is the zone's algorithm.
func (z *Zone) provisionNumbers(algo limiter.Algorithm, check func(field, value string) string) error {
	z.dyn = nil
	for f := range numFields {
		text := z.exprs[f]
		if text == "" {
			continue
		}
		expr, fallback, err := splitNumberExpr(text)
		if err == nil && expr == "" {
			err = fmt.Errorf("%q holds no placeholder: give a literal as a number", text)
		}
		if err != nil {
			return fmt.Errorf("zone %s: %s: %w", z.Name, f, err)
		}
		var v numValue // 0: no fallback
		if fallback != "" {
			if v, err = parseNumber(f, fallback, maxInt(f, algo)); err != nil {
				return fmt.Errorf("zone %s: %s: fallback %w", z.Name, f, err)
			}
		}
		z.setNumber(f, v)
		expr = check(f.String(), expr)
		dn := dynNumber{
			field: f, expr: expr, name: singlePlaceholder(expr), hasFallback: fallback != "",
			errPrefix: "zone " + z.Name + ": " + f.String() + " " + expr,
		}
		dn.errEmpty = fmt.Errorf("%s: the placeholder is empty and %s has no fallback (write one after the placeholder: %s %s <n>)",
			dn.errPrefix, f, f, expr)
		z.dyn = append(z.dyn, dn)
	}
	return nil
}

// numbers returns the zone's parameters for the request of repl: the provisioned limiter.Zone
// itself when every number is a literal (nothing allocated), else a copy with each placeholder's
// value, or its fallback when it is empty, written in. The error says which number is wrong and
// why; nothing has been decided or charged then.
func (z *Zone) numbers(repl *caddy.Replacer) (*limiter.Zone, error) {
	if len(z.dyn) == 0 {
		return &z.lz, nil
	}
	return z.resolve(func(dn *dynNumber) string { return dn.value(repl) })
}

// resolve returns a copy of the zone's parameters with the placeholder numbers set from value:
// the value of each (empty: its fallback), parsed and range-checked as the Caddyfile parses a
// literal, then checked together (see finishNumbers).
func (z *Zone) resolve(value func(*dynNumber) string) (*limiter.Zone, error) {
	lz := new(limiter.Zone)
	*lz = z.lz
	for i := range z.dyn {
		dn := &z.dyn[i]
		v := value(dn)
		if v == "" {
			if !dn.hasFallback {
				return nil, dn.errEmpty
			}
			continue // the provisioned zone holds the fallback
		}
		n, err := parseNumber(dn.field, v, maxInt(dn.field, lz.Algorithm))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", dn.errPrefix, err)
		}
		setLimiterNumber(lz, dn.field, n)
	}
	if err := z.finishNumbers(lz); err != nil {
		return nil, err
	}
	return lz, nil
}

// finishNumbers checks and completes a zone's resolved numbers together, as Validate does for
// literals: a token bucket must refill from empty within 366 days; max_cost is the one given
// (literal, resolved or fallback), at most the quota (a larger one counts as the quota: a plan's
// quota may be below a max_cost meant for larger plans), and for a sliding window whose cost is
// a placeholder at most the quota or 1000, as for literals.
func (z *Zone) finishNumbers(lz *limiter.Zone) error {
	if lz.Algorithm == limiter.TokenBucket {
		if fill := float64(lz.Capacity) / lz.RefillRate; fill > limiter.MaxWindow.Seconds() {
			return fmt.Errorf("zone %s: capacity %d and refill_rate %g: an empty bucket would take %.4gs to refill; at most %s is supported",
				z.Name, lz.Capacity, lz.RefillRate, fill, formatDuration(limiter.MaxWindow))
		}
	}
	if lz.Algorithm == limiter.Concurrency {
		lz.MaxCost = 0 // one slot per request
		return nil
	}
	q := lz.Quota()
	mc := lz.MaxCost
	if mc == 0 || mc > q {
		mc = q
	}
	if lz.Algorithm == limiter.SlidingWindow && z.fixedCost == 0 {
		mc = min(mc, MaxSlidingWindowCost)
	}
	lz.MaxCost = mc
	return nil
}

// probe returns the zone's parameters as Validate checks them when some come from placeholders:
// a number with a fallback as the fallback; one without, as the value that constrains the others
// least (capacity and limit 1, a refill_rate that refills that in a second, window 1ms); a
// max_cost above the quota clamped to it when either comes from a placeholder (it is, per
// request). The Caddyfile
// parser's checks between numbers are the same (zoneParser.finish).
func (z *Zone) probe() limiter.Zone {
	p := z.lz
	if z.dynamicNoFallback(numCapacity) {
		p.Capacity = 1
	}
	if z.dynamicNoFallback(numRefillRate) {
		p.RefillRate = float64(max(p.Capacity, 1))
	}
	if z.dynamicNoFallback(numLimit) {
		p.Limit = 1
	}
	if z.dynamicNoFallback(numWindow) {
		p.Window = limiter.MinWindow // with a period too: Validate reports both
	}
	if (z.quotaDynamic(p.Algorithm) || z.dynamic(numMaxCost)) && p.MaxCost > p.Quota() {
		p.MaxCost = p.Quota()
	}
	return p
}

// plainZone is Zone without its JSON methods.
type plainZone Zone

// MarshalJSON writes the zone as its fields say, except that a number given by a placeholder is
// the string it was configured as ("{plan_capacity} 100").
func (z *Zone) MarshalJSON() ([]byte, error) {
	if z.exprs == ([numFields]string{}) {
		return json.Marshal((*plainZone)(z))
	}
	out := struct {
		*plainZone
		Capacity   any `json:"capacity,omitempty"`
		RefillRate any `json:"refill_rate,omitempty"`
		Limit      any `json:"limit,omitempty"`
		Window     any `json:"window,omitempty"`
		MaxCost    any `json:"max_cost,omitempty"`
	}{plainZone: (*plainZone)(z)}
	fields := [numFields]*any{&out.Capacity, &out.RefillRate, &out.Limit, &out.Window, &out.MaxCost}
	literals := [numFields]any{z.Capacity, z.RefillRate, z.Limit, z.Window, z.MaxCost}
	zeros := [numFields]any{int64(0), float64(0), int64(0), caddy.Duration(0), int64(0)}
	for f := range numFields {
		switch {
		case z.exprs[f] != "":
			*fields[f] = z.exprs[f]
		case literals[f] != zeros[f]:
			*fields[f] = literals[f]
		}
	}
	return json.Marshal(out)
}

// UnmarshalJSON reads the zone, strictly (an unknown field is an error, as Caddy decodes
// modules). Each of capacity, refill_rate, limit, window and max_cost is a JSON number as before
// (window also a duration string), or a string: a placeholder, optionally followed by a space and
// a literal fallback ("{plan_capacity} 100"), or a literal in the Caddyfile's syntax ("100",
// "100/1m").
func (z *Zone) UnmarshalJSON(b []byte) error {
	in := struct {
		*plainZone
		Capacity   json.RawMessage `json:"capacity,omitempty"`
		RefillRate json.RawMessage `json:"refill_rate,omitempty"`
		Limit      json.RawMessage `json:"limit,omitempty"`
		Window     json.RawMessage `json:"window,omitempty"`
		MaxCost    json.RawMessage `json:"max_cost,omitempty"`
	}{plainZone: (*plainZone)(z)}
	if err := caddy.StrictUnmarshalJSON(b, &in); err != nil {
		return err
	}
	raws := [numFields]json.RawMessage{in.Capacity, in.RefillRate, in.Limit, in.Window, in.MaxCost}
	targets := [numFields]any{&z.Capacity, &z.RefillRate, &z.Limit, &z.Window, &z.MaxCost}
	for f := range numFields {
		raw := bytes.TrimSpace(raws[f])
		if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
			continue
		}
		if err := z.unmarshalNumber(f, raw, targets[f]); err != nil {
			return fmt.Errorf("zone %s: %s: %w", z.Name, f, err)
		}
	}
	return nil
}

// unmarshalNumber reads the JSON value raw of field f into target (its exported field), or into
// z.exprs when it is a string with a placeholder.
func (z *Zone) unmarshalNumber(f numField, raw []byte, target any) error {
	if raw[0] != '"' {
		return json.Unmarshal(raw, target)
	}
	var text string
	if err := json.Unmarshal(raw, &text); err != nil {
		return err
	}
	expr, fallback, err := splitNumberExpr(text)
	if err != nil {
		return err
	}
	if expr != "" {
		z.exprs[f] = strings.Join(strings.Fields(text), " ")
		return nil // the fallback is parsed when the zone is provisioned: the algorithm is known then
	}
	if f == numWindow {
		return json.Unmarshal(raw, target) // a duration string, as before
	}
	v, err := parseNumber(f, fallback, limiter.MaxCapacity)
	if err != nil {
		return err
	}
	z.setNumber(f, v)
	return nil
}

// policyValue is the RateLimit-Policy item of a zone decided with lz:
// `"<zone>";q=<quota>;w=<window s>`; a concurrency zone's
// `"<zone>";q=<limit>;qu="concurrent-requests"` (draft-ietf-httpapi-ratelimit-headers: the quota
// unit of a limit of concurrent requests).
func policyValue(quotedName string, lz *limiter.Zone) string {
	if lz.Algorithm == limiter.Concurrency {
		// Requests in flight at once: the draft's quota unit concurrent-requests, over no
		// window (w is optional, and must not be 0).
		return quotedName + ";q=" + strconv.FormatInt(min(lz.Quota(), sfMaxInteger), 10) + `;qu="concurrent-requests"`
	}
	q, w := policyWindow(lz.Quota(), lz.PolicyWindow())
	return quotedName + ";q=" + strconv.FormatInt(q, 10) + ";w=" + strconv.FormatInt(w, 10)
}

// unsatisfiableError is the error of a request whose cost the zone, decided with lz, can never
// admit.
func unsatisfiableError(name string, lz *limiter.Zone) error {
	if lz.MaxCost > 0 && lz.MaxCost < lz.Quota() {
		return fmt.Errorf("zone %s: cost exceeds the zone's max_cost of %d", name, lz.MaxCost)
	}
	return fmt.Errorf("zone %s: cost exceeds the zone's quota of %d", name, lz.Quota())
}

// quotaOf is X-RateLimit-Limit for the zone decided with lz: formatted once when the zone's
// numbers are literal (lz is then the zone's own), per request when they come from placeholders.
func (z *Zone) quotaOf(lz *limiter.Zone) string {
	if len(z.dyn) == 0 {
		return z.quota
	}
	return strconv.FormatInt(lz.Quota(), 10)
}

// policyOf is the RateLimit-Policy item of the zone decided with lz, as quotaOf.
func (z *Zone) policyOf(lz *limiter.Zone) string {
	if len(z.dyn) == 0 {
		return z.policy
	}
	return policyValue(z.quotedName, lz)
}

// errUnsatisfiableOf is the error of a request whose cost the zone, decided with lz, can never
// admit, as quotaOf.
func (z *Zone) errUnsatisfiableOf(lz *limiter.Zone) error {
	if len(z.dyn) == 0 {
		return z.errUnsatisfiable
	}
	return unsatisfiableError(z.Name, lz)
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

// formatDuration formats whole days as caddy.ParseDuration writes them (366d), else as
// time.Duration does.
func formatDuration(dur time.Duration) string {
	const day = 24 * time.Hour
	if dur >= day && dur%day == 0 {
		return strconv.FormatInt(int64(dur/day), 10) + "d"
	}
	return dur.String()
}
