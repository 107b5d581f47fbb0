package ratelimitredis

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// The penalty box's admin API: PUT /rate_limit_redis/block, and the block in the state that
// GET /rate_limit_redis/state reports. DELETE /rate_limit_redis/state lifts a block with the
// state (limiter.Reset).

// blockResult is one entry of PUT /rate_limit_redis/block.
type blockResult struct {
	// The zone's name and the client key, as given.
	Zone string `json:"zone"`
	Key  string `json:"key"`
	// Which of the zone's key candidates the key is of, counted from 1.
	Candidate int `json:"candidate"`
	// The Redis key of the block, the Redis addresses and database.
	RedisKey string   `json:"redis_key"`
	Redis    []string `json:"redis"`
	DB       int      `json:"db,omitempty"`
	// When the block ends, in milliseconds since the Unix epoch (Redis server time).
	BlockedUntilMs int64 `json:"blocked_until_ms"`
	// Whether the block was announced to the other instances, which then forget their cached
	// denials of the client at once (a cached denial of a longer block must not outlast a
	// shorter one). The block itself reaches every instance at once: each decision of the zone
	// reads it in Redis. broadcast_error says why it was not announced.
	Broadcast      bool   `json:"broadcast"`
	BroadcastError string `json:"broadcast_error,omitempty"`
}

// handleBlock serves PUT /rate_limit_redis/block?zone=&key=&for=: the client is blocked in the
// zone for `for` (a duration, 1s to 366d) from now, on every instance, whether or not it ever
// went over the limit; a block it had is replaced, its strikes with it (one strike of `for`).
// The zone must have a block: a zone without one reads no block key, so that it costs nothing.
// Errors as for /state: 400 (a parameter missing or out of range, a zone without block), 404,
// 405, 502, 504.
func (a *AdminAPI) handleBlock(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodPut {
		w.Header().Set("Allow", http.MethodPut)
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed: use PUT", r.Method)}
	}
	q := r.URL.Query()
	zone, key, forText := q.Get("zone"), q.Get("key"), q.Get("for")
	if zone == "" || key == "" || forText == "" {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: errors.New("query parameters zone, key and for are required")}
	}
	d, err := caddy.ParseDuration(forText)
	if err != nil || d < limiter.MinBlock || d > limiter.MaxBlock {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("for: %q must be a duration between %v and %s", forText,
			limiter.MinBlock, formatDuration(limiter.MaxBlock))}
	}
	if n, _ := limiter.ParseCandidateKey(key); n == limiter.KeyedCandidate {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: errors.New(
			"key: candidates are counted from 1 (0= is no client key's): give the key as {http.rate_limit_redis.key} shows it")}
	}
	ts := a.registry().targets(zone)
	if len(ts) == 0 {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no rate_limit_redis zone named %q is loaded", zone)}
	}
	for _, t := range ts {
		if t.z.lz.Block <= 0 {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf(
				"zone %s has no block: give it one (block <duration>) so that its decisions read the client's block", zone)}
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	return blockClient(ctx, w, ts, key, d)
}

// blockClient writes the block of each distinct Redis key of the client once, and clears the
// cached denials of every handler with the zone.
func blockClient(ctx context.Context, w http.ResponseWriter, ts []target, key string, d time.Duration) error {
	out := []blockResult{}
	seen := make(map[string]bool)
	candidate, _ := limiter.ParseCandidateKey(key)
	for _, t := range ts {
		lk := t.h.limiterKey(key)
		redisKey := limiter.BlockKey(t.h.KeyPrefix, &t.z.lz, lk)
		id := t.redisID + "|" + redisKey
		if seen[id] {
			t.h.limiter.Forget(&t.z.lz, lk) // blocked already: only this handler's deny cache is left
			continue
		}
		seen[id] = true
		until, err := t.h.limiter.Block(ctx, &t.z.lz, lk, d)
		notBroadcast := ""
		if errors.Is(err, limiter.ErrNotBroadcast) {
			notBroadcast, err = err.Error(), nil
		}
		if err != nil {
			return redisError(err)
		}
		out = append(out, blockResult{Zone: t.z.Name, Key: key, Candidate: candidate, RedisKey: redisKey, Redis: t.redis, DB: t.h.Redis.DB,
			BlockedUntilMs: until.UnixMilli(), Broadcast: notBroadcast == "", BroadcastError: notBroadcast})
	}
	return writeJSON(w, out)
}

// setBlockState fills the block fields of cs from b, for zone lz: blocked_until_ms when the
// client is blocked, and with a block_max its strikes and last block.
func setBlockState(cs *clientState, lz *limiter.Zone, b limiter.BlockState) {
	if lz.Block <= 0 {
		return
	}
	if !b.Until.IsZero() {
		ms := b.Until.UnixMilli()
		cs.BlockedUntilMs = &ms
	}
	if lz.BlockMax > 0 {
		strikes, last := b.Strikes, ceilMs(b.Length)
		cs.Strikes = &strikes
		if last > 0 {
			cs.LastBlockMs = &last
		}
	}
}
