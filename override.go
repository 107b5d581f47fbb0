package ratelimitredis

// Per-client overrides through the admin API: PUT, GET and DELETE
// /rate_limit_redis/override?zone=<name>&key=<key>, for zones with `overrides`. The numbers are
// stored in Redis (limiter.SetOverride) and read by the decision script in the decision's own
// call, so every instance's next decision uses them.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// maxOverrideBody bounds the JSON body of PUT /rate_limit_redis/override.
const maxOverrideBody = 16 << 10

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

// overrideState is one entry of the replies of /rate_limit_redis/override.
type overrideState struct {
	clientEntry // redis_key: the override's (a hash)
	// Whether the client has an override (GET), had one (DELETE: deleted), or now has this one
	// (PUT).
	Exists bool `json:"exists"`
	overrideNumbers
	// PUT and DELETE: whether the change was announced to the other instances, which then
	// forget their cached denials of the client at once (else within their deny cache's
	// max_age); broadcast_error says why not.
	Broadcast      *bool  `json:"broadcast,omitempty"`
	BroadcastError string `json:"broadcast_error,omitempty"`
}

// overrideNumbers are an override's numbers and how long it lasts, in the replies of
// /rate_limit_redis/override and /rate_limit_redis/overrides.
type overrideNumbers struct {
	// The override's numbers (absent: the zone's own apply): tokens, tokens per second,
	// requests, milliseconds, tokens or slots.
	Capacity   int64   `json:"capacity,omitempty"`
	RefillRate float64 `json:"refill_rate,omitempty"`
	Limit      int64   `json:"limit,omitempty"`
	WindowMs   int64   `json:"window_ms,omitempty"`
	MaxCost    int64   `json:"max_cost,omitempty"`
	// Milliseconds until the override ends; absent when it lasts until it is deleted.
	ExpiresInMs int64 `json:"expires_in_ms,omitempty"`
}

// handleOverride serves PUT (set), GET (read) and DELETE (remove)
// /rate_limit_redis/override?zone=&key=. Every loaded zone of that name must have overrides
// (else 400). A PUT's body is validated against each such zone as the Caddyfile's numbers are
// (same ranges, same errors; a 400 naming the field) before anything is written.
func (a *AdminAPI) handleOverride(w http.ResponseWriter, r *http.Request) error {
	_, zone, key, err := clientQuery(w, r, []string{http.MethodGet, http.MethodPut, http.MethodDelete})
	if err != nil {
		return err
	}
	ts, err := a.clientTargets(zone, key)
	if err != nil {
		return err
	}
	for _, t := range ts {
		if !t.z.Overrides {
			return badRequest(fmt.Errorf("zone %s has no overrides: add `overrides` to its block to set a client's numbers at run time", zone))
		}
	}
	var body overrideBody
	overrides := make([]limiter.Override, len(ts))
	if r.Method == http.MethodPut {
		if err := readOverrideBody(r, &body); err != nil {
			return badRequest(err)
		}
		for i, t := range ts {
			o, err := t.z.override(&body)
			if err != nil {
				return badRequest(err)
			}
			overrides[i] = o
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	out := []overrideState{}
	err = eachClientKey(ts, r.Method != http.MethodGet, limiter.OverrideKey, func(i int, t target, lk string, e clientEntry) error {
		st := overrideState{clientEntry: e}
		var err error
		switch r.Method {
		case http.MethodPut:
			err = t.h.limiter.SetOverride(ctx, &t.z.lz, lk, overrides[i], body.expiresIn)
			if err == nil || errors.Is(err, limiter.ErrNotBroadcast) {
				st.Exists = true
				st.set(overrides[i], body.expiresIn)
			}
		case http.MethodDelete:
			st.Exists, err = t.h.limiter.DeleteOverride(ctx, &t.z.lz, lk)
		default:
			var o limiter.Override
			var ttl time.Duration
			o, ttl, st.Exists, err = t.h.limiter.GetOverride(ctx, &t.z.lz, lk)
			st.set(o, ttl)
		}
		if r.Method != http.MethodGet {
			var b broadcastResult
			b, err = broadcastOf(err)
			st.Broadcast, st.BroadcastError = &b.Broadcast, b.BroadcastError
		}
		if err != nil {
			return redisError(err)
		}
		out = append(out, st)
		return nil
	})
	if err != nil {
		return err
	}
	return writeJSON(w, out)
}

// set fills in the override's numbers and how long it lasts.
func (st *overrideNumbers) set(o limiter.Override, ttl time.Duration) {
	st.Capacity, st.RefillRate, st.Limit, st.MaxCost = o.Capacity, o.RefillRate, o.Limit, o.MaxCost
	st.WindowMs = ceilMs(o.Window)
	if ttl > 0 {
		st.ExpiresInMs = ceilMs(ttl)
	}
}

// readOverrideBody decodes r's body, a JSON object of overrideBody's fields only.
func readOverrideBody(r *http.Request, body *overrideBody) error {
	data, err := io.ReadAll(io.LimitReader(r.Body, maxOverrideBody+1))
	if err != nil {
		return fmt.Errorf("reading the body: %w", err)
	}
	if len(data) > maxOverrideBody {
		return fmt.Errorf("the body is larger than %d bytes", maxOverrideBody)
	}
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
		return fmt.Errorf("expires_in %s is out of range (at most %s)", body.ExpiresIn, formatDuration(maxOverrideTTL))
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

// badRequest is the admin API's 400 with err.
func badRequest(err error) error {
	return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
}
