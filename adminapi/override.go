package adminapi

// Per-client overrides through the admin API: PUT, GET and DELETE
// /rate_limit_redis/override?zone=<name>&key=<key>, for zones with `overrides`. A PUT's body is
// checked by the zone (Zone.Override). The numbers are
// stored in Redis (limiter.SetOverride) and read by the decision script in the decision's own
// call, so every instance's next decision uses them.

import (
	"context"
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

// OverrideState is one entry of the replies of /rate_limit_redis/override.
type OverrideState struct {
	ClientEntry // redis_key: the override's (a hash)
	// Whether the client has an override (GET), had one (DELETE: deleted), or now has this one
	// (PUT).
	Exists bool `json:"exists"`
	OverrideNumbers
	// PUT and DELETE: whether the change was announced to the other instances, which then
	// forget their cached denials of the client at once (else within their deny cache's
	// max_age); broadcast_error says why not.
	Broadcast      *bool  `json:"broadcast,omitempty"`
	BroadcastError string `json:"broadcast_error,omitempty"`
}

// OverrideNumbers are an override's numbers and how long it lasts, in the replies of
// /rate_limit_redis/override and /rate_limit_redis/overrides.
type OverrideNumbers struct {
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
		if !t.info.Overrides {
			return badRequest(fmt.Errorf("zone %s has no overrides: add `overrides` to its block to set a client's numbers at run time", zone))
		}
	}
	overrides := make([]limiter.Override, len(ts))
	var expiresIn time.Duration
	if r.Method == http.MethodPut {
		body, err := readOverrideBody(r)
		if err != nil {
			return badRequest(err)
		}
		for i, t := range ts {
			if overrides[i], expiresIn, err = t.Override(body); err != nil {
				return badRequest(err)
			}
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	out := []OverrideState{}
	err = eachClientKey(ts, r.Method != http.MethodGet, limiter.OverrideKey, func(i int, t target, lk string, e ClientEntry) error {
		st := OverrideState{ClientEntry: e}
		var err error
		switch r.Method {
		case http.MethodPut:
			err = t.Limiter().SetOverride(ctx, t.Params(), lk, overrides[i], expiresIn)
			if err == nil || errors.Is(err, limiter.ErrNotBroadcast) {
				st.Exists = true
				st.set(overrides[i], expiresIn)
			}
		case http.MethodDelete:
			st.Exists, err = t.Limiter().DeleteOverride(ctx, t.Params(), lk)
		default:
			var o limiter.Override
			var ttl time.Duration
			o, ttl, st.Exists, err = t.Limiter().GetOverride(ctx, t.Params(), lk)
			st.set(o, ttl)
		}
		if r.Method != http.MethodGet {
			var b BroadcastResult
			b, err = broadcastOf(err)
			st.Broadcast, st.BroadcastError = &b.Broadcast, b.BroadcastError
		}
		if err != nil {
			return t.redisError(err)
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
func (st *OverrideNumbers) set(o limiter.Override, ttl time.Duration) {
	st.Capacity, st.RefillRate, st.Limit, st.MaxCost = o.Capacity, o.RefillRate, o.Limit, o.MaxCost
	st.WindowMs = limiter.CeilMs(o.Window)
	if ttl > 0 {
		st.ExpiresInMs = limiter.CeilMs(ttl)
	}
}

// readOverrideBody reads r's body, at most maxOverrideBody bytes.
func readOverrideBody(r *http.Request) ([]byte, error) {
	data, err := io.ReadAll(io.LimitReader(r.Body, maxOverrideBody+1))
	if err != nil {
		return nil, fmt.Errorf("reading the body: %w", err)
	}
	if len(data) > maxOverrideBody {
		return nil, fmt.Errorf("the body is larger than %d bytes", maxOverrideBody)
	}
	return data, nil
}

// badRequest is the admin API's 400 with err.
func badRequest(err error) error {
	return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
}
