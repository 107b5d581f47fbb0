package ratelimitredis

// The numbers of a per-client override, set through the admin API (PUT
// /rate_limit_redis/override, package adminapi): the body's, checked against the zone as the
// Caddyfile's numbers are.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// maxOverrideTTL bounds expires_in: the longest window a zone may have.
const maxOverrideTTL = limiter.MaxWindow

// overrideBody is the JSON body of PUT /rate_limit_redis/override: any of the zone's numbers
// that apply to its algorithm, each as the zone's JSON takes it (a number, or a string in the
// Caddyfile's syntax: "100/1m", "1h"; a window as a JSON number is nanoseconds), and how long
// the override lasts.
type overrideBody struct {
	Capacity   Number `json:"capacity"`
	RefillRate Number `json:"refill_rate"`
	Limit      Number `json:"limit"`
	Window     Number `json:"window"`
	MaxCost    Number `json:"max_cost"`
	// How long the override lasts (a duration string, or nanoseconds), 1ms to 366d; absent:
	// until it is deleted. Kept as written, for the errors; readOverrideBody parses it.
	ExpiresIn json.RawMessage `json:"expires_in"`
	expiresIn time.Duration
}

// number returns the body's number f.
func (b *overrideBody) number(f numField) Number { return numberFields[f].body(b) }

// readOverrideBody decodes data, the body of PUT /rate_limit_redis/override: a JSON object of
// overrideBody's fields only.
func readOverrideBody(data []byte, body *overrideBody) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(body); err != nil {
		return fmt.Errorf("the body must be a JSON object of the zone's numbers (capacity, refill_rate, limit, window, max_cost) and expires_in: %w", err)
	}
	if dec.More() {
		return errors.New("the body must be one JSON object")
	}
	if body.ExpiresIn == nil {
		return nil
	}
	var d caddy.Duration
	if err := d.UnmarshalJSON(body.ExpiresIn); err != nil {
		return fmt.Errorf("expires_in %s: %w", body.ExpiresIn, err)
	}
	switch {
	case time.Duration(d) < time.Millisecond:
		return fmt.Errorf("expires_in %s must be at least 1ms (leave it out for an override that lasts until it is deleted)", body.ExpiresIn)
	case time.Duration(d) > maxOverrideTTL:
		return fmt.Errorf("expires_in %s is out of range (at most %s)", body.ExpiresIn, limiter.FormatDuration(maxOverrideTTL))
	}
	body.expiresIn = time.Duration(d)
	return nil
}

// override returns the limiter.Override of body's numbers for zone z, checked as the
// Caddyfile's numbers are: each parsed with its field's grammar and range, then the zone with
// them in place of its own (a placeholder's fallback standing for its value) against the same
// rules (a number of another algorithm, a max_cost above the quota, a cost above it). Its error
// is a *limiter.FieldError naming the field.
func (z *Zone) override(body *overrideBody) (limiter.Override, error) {
	lz := z.probe(z.lz)
	var o limiter.Override
	for f := range numFields {
		n := body.number(f)
		if n.IsZero() {
			continue
		}
		if p, _ := n.placeholder(); p {
			return o, z.fieldError(f.String(), "%s: an override is a number, not a placeholder", f)
		}
		v, _, err := n.parse(f, lz.Algorithm)
		if err != nil {
			return o, z.fieldError(f.String(), "%s: %v", f, err)
		}
		if f == numWindow && v.dur%time.Microsecond != 0 {
			return o, z.fieldError("window", "window %s: an override's window is whole microseconds", v.dur)
		}
		setLimiterNumber(&lz, f, v)
		numberFields[f].override(&o, v)
	}
	if o.IsZero() {
		return o, &limiter.FieldError{Zone: z.Name, Msg: "an override sets at least one of the zone's numbers"}
	}
	if o.MaxCost == 0 && lz.MaxCost > lz.Quota() {
		lz.MaxCost = lz.Quota() // the zone's max_cost counts as the quota in force (decide.lua)
	}
	// The numbers in force are checked as a zone's without overrides: an override's max_cost
	// is at most its quota in force.
	lz.Overrides = false
	if err := lz.Validate(); err != nil {
		return o, err
	}
	if err := z.validateTogether(lz, z.fixedCost); err != nil {
		return o, err
	}
	return o, nil
}
