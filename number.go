package ratelimitredis

// Zone numbers from placeholders (plans and tiers): a zone's capacity, refill_rate, limit,
// window and max_cost may each be a placeholder resolved per request, with an optional literal
// fallback, instead of a literal. Each is a Number, which holds the number as configured; the
// zone's provision parses it (its field and algorithm give its grammar and range) into the
// zone's limiter.Zone, and each placeholder into a dynNumber.
//
// Cost. A zone whose numbers are all literal takes nothing of this per request: ServeHTTP uses
// its provisioned limiter.Zone (Zone.dyn is empty). A zone with placeholder numbers gets one
// limiter.Zone copy per request, with the resolved numbers written in.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
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

// numberFields holds, for each numField, its name and where the field is kept: in a Zone, in an
// override's body, in a limiter.Zone and in a limiter.Override. A new number is a new row here.
var numberFields = [numFields]struct {
	name     string
	zone     func(*Zone) *Number
	body     func(*overrideBody) Number
	set      func(*limiter.Zone, numValue)
	override func(*limiter.Override, numValue)
}{
	numCapacity: {"capacity",
		func(z *Zone) *Number { return &z.Capacity },
		func(b *overrideBody) Number { return b.Capacity },
		func(lz *limiter.Zone, v numValue) { lz.Capacity = v.n },
		func(o *limiter.Override, v numValue) { o.Capacity = v.n }},
	numRefillRate: {"refill_rate",
		func(z *Zone) *Number { return &z.RefillRate },
		func(b *overrideBody) Number { return b.RefillRate },
		func(lz *limiter.Zone, v numValue) { lz.RefillRate = v.rate },
		func(o *limiter.Override, v numValue) { o.RefillRate = v.rate }},
	numLimit: {"limit",
		func(z *Zone) *Number { return &z.Limit },
		func(b *overrideBody) Number { return b.Limit },
		func(lz *limiter.Zone, v numValue) { lz.Limit = v.n },
		func(o *limiter.Override, v numValue) { o.Limit = v.n }},
	numWindow: {"window",
		func(z *Zone) *Number { return &z.Window },
		func(b *overrideBody) Number { return b.Window },
		func(lz *limiter.Zone, v numValue) { lz.Window = v.dur },
		func(o *limiter.Override, v numValue) { o.Window = v.dur }},
	numMaxCost: {"max_cost",
		func(z *Zone) *Number { return &z.MaxCost },
		func(b *overrideBody) Number { return b.MaxCost },
		func(lz *limiter.Zone, v numValue) { lz.MaxCost = v.n },
		func(o *limiter.Override, v numValue) { o.MaxCost = v.n }},
}

func (f numField) String() string { return numberFields[f].name }

// numFieldNamed returns the numField of a subdirective or JSON field name.
func numFieldNamed(name string) (numField, bool) {
	for f, n := range numberFields {
		if n.name == name {
			return numField(f), true
		}
	}
	return 0, false
}

// Number is a zone number: capacity, refill_rate, limit, window or max_cost. It is a literal, or
// a placeholder resolved per request (plans and tiers) with an optional literal fallback for
// when the placeholder is empty. In JSON it is a number (a window's in nanoseconds), or a string:
// a literal in the Caddyfile's syntax ("100", "100/1m", "1h"), or the placeholder and,
// optionally after a space, the fallback ("{http.vars.plan_capacity} 100"). Like
// caddy.Duration, one type takes every form; unlike it, a Number is parsed when its zone is
// provisioned or validated, where its field, and so its grammar and range, are known. The zero
// Number is a number not given.
type Number struct {
	text   string // as configured: a JSON number's text, or a string's words joined by a space
	quoted bool   // given as a JSON string
}

// NumberOf returns the Number of the literal v: a count (capacity, limit, max_cost), tokens per
// second (refill_rate), or a duration (window: a time.Duration or caddy.Duration). 0 is a
// number not given, as in JSON.
func NumberOf[T ~int | ~int64 | ~float64](v T) Number {
	if v == 0 {
		return Number{}
	}
	if reflect.TypeFor[T]().Kind() != reflect.Float64 {
		return Number{text: strconv.FormatInt(int64(v), 10)}
	}
	b, err := json.Marshal(float64(v))
	if err != nil { // NaN or an infinity: no JSON number; a string that fails to parse
		return Number{text: strconv.FormatFloat(float64(v), 'g', -1, 64), quoted: true}
	}
	return Number{text: string(b)}
}

// NumberText returns the Number of text as the Caddyfile's arguments give it, and JSON as a
// string: a literal in the Caddyfile's syntax ("100/1m"), or a placeholder and, optionally after
// a space, a literal fallback ("{http.vars.plan_capacity} 100").
func NumberText(text string) Number {
	return Number{text: strings.Join(strings.Fields(text), " "), quoted: true}
}

// IsZero reports whether n was not given.
func (n Number) IsZero() bool { return n == Number{} }

// MarshalJSON writes n as it was given: a JSON number, or a string.
func (n Number) MarshalJSON() ([]byte, error) {
	switch {
	case n.quoted:
		return json.Marshal(n.text)
	case n.text == "":
		return []byte("null"), nil
	}
	return []byte(n.text), nil
}

// UnmarshalJSON reads a JSON number or string as it is; null and 0 are a number not given, as
// for the JSON numbers of Caddy's modules (omitempty). It is parsed when the zone is provisioned.
func (n *Number) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	switch {
	case bytes.Equal(b, []byte("null")):
		*n = Number{}
	case len(b) > 0 && b[0] == '"':
		var text string
		if err := json.Unmarshal(b, &text); err != nil {
			return err
		}
		*n = NumberText(text)
	case len(b) > 0 && (b[0] == '-' || b[0] >= '0' && b[0] <= '9'):
		*n = Number{text: string(b)}
		if f, err := strconv.ParseFloat(n.text, 64); err == nil && f == 0 {
			*n = Number{}
		}
	default:
		kind := "value"
		if len(b) > 0 {
			kind = map[byte]string{'t': "bool", 'f': "bool", '{': "object", '[': "array"}[b[0]]
		}
		return &json.UnmarshalTypeError{Value: kind, Type: reflect.TypeFor[Number]()}
	}
	return nil
}

// literalNumber is the Number of the value v of field f, as JSON has it: a number.
func literalNumber(f numField, v numValue) Number {
	switch f {
	case numRefillRate:
		return NumberOf(v.rate)
	case numWindow:
		return NumberOf(v.dur)
	}
	return NumberOf(v.n)
}

// placeholder reports whether n comes from a placeholder; fallback whether it has a fallback
// then.
func (n Number) placeholder() (placeholder, fallback bool) {
	if !n.quoted {
		return false, false
	}
	expr, literal, err := splitNumberExpr(n.text)
	return err == nil && expr != "", err == nil && expr != "" && literal != ""
}

// noFallback reports whether n comes from a placeholder without a fallback.
func (n Number) noFallback() bool {
	p, f := n.placeholder()
	return p && !f
}

// parse parses n as the number f of a zone of algorithm algo: its value (a literal's, or a
// placeholder's fallback; zero without one) and, for a placeholder, its expression as written.
// Its errors name neither the zone nor the field.
func (n Number) parse(f numField, algo limiter.Algorithm) (v numValue, expr string, err error) {
	if !n.quoted {
		v, err = parseJSONNumber(f, n.text, maxInt(f, algo))
		return v, "", err
	}
	expr, literal, err := splitNumberExpr(n.text)
	if err != nil || literal == "" {
		return numValue{}, expr, err
	}
	v, err = parseNumber(f, literal, maxInt(f, algo))
	if err != nil && expr != "" {
		err = fmt.Errorf("fallback %w", err)
	}
	return v, expr, err
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
		return windowValue(dur, quoteBounded(s))
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

// parseJSONNumber parses s, the text of a JSON number, as the number f: as parseNumber parses a
// literal, except that a window is a whole number of nanoseconds, as caddy.Duration reads one.
func parseJSONNumber(f numField, s string, maxInt int64) (numValue, error) {
	if f != numWindow {
		return parseNumber(f, s, maxInt)
	}
	ns, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return numValue{}, fmt.Errorf("%s is not a duration in nanoseconds", quoteBounded(s))
	}
	return windowValue(time.Duration(ns), strconv.Quote(limiter.FormatDuration(time.Duration(ns))))
}

// windowValue is the window dur, or an error when it is out of range, showing it as shown.
func windowValue(dur time.Duration, shown string) (numValue, error) {
	if dur < limiter.MinWindow || dur > limiter.MaxWindow {
		return numValue{}, fmt.Errorf("%s is out of range (%s to %s)", shown, limiter.FormatDuration(limiter.MinWindow), limiter.FormatDuration(limiter.MaxWindow))
	}
	return numValue{dur: dur}, nil
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

// maxInt is the upper bound of the integer number f in a zone of algorithm algo. An algorithm
// whose quota is a capacity has no limit: one is bounded as a sliding window's, the algorithm
// that takes a limit when none is given.
func maxInt(f numField, algo limiter.Algorithm) int64 {
	if f != numLimit {
		return limiter.MaxCapacity
	}
	if m := algo.MaxLimit(); m > 0 {
		return m
	}
	return limiter.MaxLimit
}

// setLimiterNumber writes v, a value of field f, into lz.
func setLimiterNumber(lz *limiter.Zone, f numField, v numValue) { numberFields[f].set(lz, v) }

// number returns the zone's number f.
func (z *Zone) number(f numField) *Number { return numberFields[f].zone(z) }

// quotaPlaceholder reports whether the quota (capacity or limit) of a zone of algorithm algo
// comes from a placeholder.
func (z *Zone) quotaPlaceholder(algo limiter.Algorithm) bool {
	quota := &z.Limit
	if algo.QuotaIsCapacity() {
		quota = &z.Capacity
	}
	p, _ := quota.placeholder()
	return p
}

// parseNumbers sets lz's numbers (lz.Algorithm set) from the zone's: each literal, and each
// placeholder's fallback (0 without one); and returns the placeholder numbers, their
// expressions passed through expand (nil: as written). Its error is a *limiter.FieldError.
func (z *Zone) parseNumbers(lz *limiter.Zone, expand func(field, expr string) string) ([]dynNumber, error) {
	var dyn []dynNumber
	for f := range numFields {
		n := z.number(f)
		if n.IsZero() {
			continue
		}
		v, expr, err := n.parse(f, lz.Algorithm)
		if err != nil {
			return nil, z.fieldError(f.String(), "%s: %v", f, err)
		}
		setLimiterNumber(lz, f, v)
		if expr == "" {
			continue
		}
		_, hasFallback := n.placeholder()
		if expand != nil {
			expr = expand(f.String(), expr)
		}
		dn := dynNumber{
			field: f, expr: expr, name: singlePlaceholder(expr), hasFallback: hasFallback,
			errPrefix: "zone " + z.Name + ": " + f.String() + " " + expr,
		}
		dn.errEmpty = fmt.Errorf("%s: the placeholder is empty and %s has no fallback (write one after the placeholder: %s %s <n>)",
			dn.errPrefix, f, f, expr)
		dyn = append(dyn, dn)
	}
	return dyn, nil
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
	if lz.Algorithm.QuotaIsCapacity() {
		if fill := float64(lz.Capacity) / lz.RefillRate; fill > limiter.MaxWindow.Seconds() {
			return fmt.Errorf("zone %s: capacity %d and refill_rate %g: an empty bucket would take %.4gs to refill; at most %s is supported",
				z.Name, lz.Capacity, lz.RefillRate, fill, limiter.FormatDuration(limiter.MaxWindow))
		}
	}
	if lz.Algorithm.HoldsSlots() {
		lz.MaxCost = 0 // one slot per request
		return nil
	}
	q := lz.Quota()
	mc := lz.MaxCost
	if mc == 0 || mc > q {
		mc = q
	}
	if lz.Algorithm.StoresEntries() && z.fixedCost == 0 {
		mc = min(mc, MaxSlidingWindowCost)
		if lz.Overrides && z.MaxCost.IsZero() {
			mc = MaxSlidingWindowCost // at most the quota in force, a client's override's when it has one (decide.lua)
		}
	} else if lz.Overrides && z.MaxCost.IsZero() {
		mc = 0 // the quota in force: a client's override's, when it has one (decide.lua)
	}
	lz.MaxCost = mc
	return nil
}

// probe returns lz, the zone's parameters with each placeholder's fallback, as Validate checks
// them: a number from a placeholder without a fallback as the value that constrains the others
// least (capacity and limit 1, a refill_rate that refills that in a second, window 1ms, max_cost
// the quota); a max_cost above the quota clamped to it when either comes from a placeholder (it
// is, per request).
func (z *Zone) probe(lz limiter.Zone) limiter.Zone {
	p := lz
	if z.Capacity.noFallback() {
		p.Capacity = 1
	}
	if z.RefillRate.noFallback() {
		p.RefillRate = float64(max(p.Capacity, 1))
	}
	if z.Limit.noFallback() {
		p.Limit = 1
	}
	if z.Window.noFallback() {
		p.Window = limiter.MinWindow // with a period too: Validate reports both
	}
	if z.MaxCost.noFallback() {
		p.MaxCost = p.Quota()
	}
	maxCostPlaceholder, _ := z.MaxCost.placeholder()
	if (z.quotaPlaceholder(p.Algorithm) || maxCostPlaceholder) && p.MaxCost > p.Quota() {
		p.MaxCost = p.Quota()
	}
	return p
}

// policyValue is the RateLimit-Policy item of a zone decided with lz:
// `"<zone>";q=<quota>;w=<window s>`; a concurrency zone's
// `"<zone>";q=<limit>;qu="concurrent-requests"` (draft-ietf-httpapi-ratelimit-headers: the quota
// unit of a limit of concurrent requests).
func policyValue(quotedName string, lz *limiter.Zone) string {
	if lz.Algorithm.HoldsSlots() {
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

// quotaOf is X-RateLimit-Limit for the zone decided with lz: formatted once when lz is the zone's
// own (literal numbers, and no client override in force), per request otherwise (placeholders,
// an override: lz is then the request's).
func (z *Zone) quotaOf(lz *limiter.Zone) string {
	if lz == &z.lz {
		return z.quota
	}
	return strconv.FormatInt(lz.Quota(), 10)
}

// policyOf is the RateLimit-Policy item of the zone decided with lz, as quotaOf.
func (z *Zone) policyOf(lz *limiter.Zone) string {
	if lz == &z.lz {
		return z.policy
	}
	return policyValue(z.quotedName, lz)
}

// errUnsatisfiableOf is the error of a request whose cost the zone, decided with lz, can never
// admit, as quotaOf.
func (z *Zone) errUnsatisfiableOf(lz *limiter.Zone) error {
	if lz == &z.lz {
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
