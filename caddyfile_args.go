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
)

// Generic helpers of the Caddyfile parser: reading a subdirective's arguments from a
// caddyfile.Dispenser, and pointing errors at a token.

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

// argsArg reads the one or more arguments of the subdirective at the cursor into *field.
func argsArg(d *caddyfile.Dispenser, field *[]string) error {
	args, err := someArgs(d)
	if err != nil {
		return err
	}
	*field = args
	return nil
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

// fractionArg reads the one argument of the subdirective at the cursor, a number (0.8) or a
// percentage (80%), into *field as a fraction: 0, which would mean none, is an error; the zone's
// validation checks the range.
func fractionArg(d *caddyfile.Dispenser, field *float64) error {
	name := d.Val()
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	num, pct := strings.CutSuffix(v, "%")
	f, err := strconv.ParseFloat(num, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return d.Errf("%s: %q is not a fraction (0.8) or a percentage (80%%)", name, v)
	}
	if pct {
		f /= 100
	}
	if f == 0 {
		return d.Errf("%s: %q must be above 0 (leave %s out for none)", name, v, name)
	}
	*field = f
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

// anyDurationArg reads the one argument of the subdirective at the cursor, any duration, into
// *field. Its range is the validation's.
func anyDurationArg(d *caddyfile.Dispenser, field *caddy.Duration) error {
	_, dur, err := durationValue(d)
	if err != nil {
		return err
	}
	*field = caddy.Duration(dur)
	return nil
}

// optDurationArg reads the one argument of the subdirective at the cursor, any duration, into a
// new *field. Its range is the validation's.
func optDurationArg(d *caddyfile.Dispenser, field **caddy.Duration) error {
	v := new(caddy.Duration)
	if err := anyDurationArg(d, v); err != nil {
		return err
	}
	*field = v
	return nil
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

// intArg reads the one argument of the subdirective at the cursor, an integer, into a new *field.
// Its range is the validation's.
func intArg(d *caddyfile.Dispenser, field **int) error {
	name := d.Val()
	v, err := oneArg(d)
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(v)
	switch {
	case errors.Is(err, strconv.ErrRange):
		return d.Errf("%s: %q is out of range", name, v)
	case err != nil:
		return d.Errf("%s: %q is not an integer", name, v)
	}
	*field = &n
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
