package adminapi

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// The penalty box's admin API: PUT /rate_limit_redis/block, and the block in the state that
// GET /rate_limit_redis/state reports. DELETE /rate_limit_redis/state lifts a block with the
// state (limiter.Reset).

// BlockResult is one entry of PUT /rate_limit_redis/block.
type BlockResult struct {
	ClientEntry // redis_key: the block's
	// When the block ends, in milliseconds since the Unix epoch (Redis server time).
	BlockedUntilMs int64 `json:"blocked_until_ms"`
	// The block itself reaches every instance at once: each decision of the zone reads it in
	// Redis. The announcement makes the other instances forget their cached denials of the
	// client (a cached denial of a longer block must not outlast a shorter one).
	BroadcastResult
}

// handleBlock serves PUT /rate_limit_redis/block?zone=&key=&for=: the client is blocked in the
// zone for `for` (a duration, 1s to 366d) from now, on every instance, whether or not it ever
// went over the limit; a block it had is replaced, its strikes with it (one strike of `for`).
// The zone must have a block: a zone without one reads no block key, so that it costs nothing.
// Errors as for /state: 400 (a parameter missing or out of range, a zone without block), 404,
// 405, 502, 504.
func (a *AdminAPI) handleBlock(w http.ResponseWriter, r *http.Request) error {
	q, zone, key, err := clientQuery(w, r, []string{http.MethodPut}, "for")
	if err != nil {
		return err
	}
	forText := q.Get("for")
	d, err := caddy.ParseDuration(forText)
	if err != nil || d < limiter.MinBlock || d > limiter.MaxBlock {
		return badRequest(fmt.Errorf("for: %q must be a duration between %v and %s", forText, limiter.MinBlock, limiter.FormatDuration(limiter.MaxBlock)))
	}
	ts, err := a.clientTargets(zone, key)
	if err != nil {
		return err
	}
	for _, t := range ts {
		if t.Params().Block <= 0 {
			return badRequest(fmt.Errorf("zone %s has no block: give it one (block <duration>) so that its decisions read the client's block", zone))
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	return blockClient(ctx, w, ts, d)
}

// blockClient writes the block of each distinct Redis key of the client once, and clears the
// cached denials of every handler with the zone.
func blockClient(ctx context.Context, w http.ResponseWriter, ts []target, d time.Duration) error {
	out := []BlockResult{}
	err := eachClientKey(ts, true, limiter.BlockKey, func(_ int, t target, lk string, e ClientEntry) error {
		until, err := t.Limiter().Block(ctx, t.Params(), lk, d)
		b, err := broadcastOf(err)
		if err != nil {
			return t.redisError(err)
		}
		out = append(out, BlockResult{ClientEntry: e, BlockedUntilMs: until.UnixMilli(), BroadcastResult: b})
		return nil
	})
	if err != nil {
		return err
	}
	return writeJSON(w, out)
}

// setBlockState fills the block fields of cs from b, for zone lz: blocked_until_ms when the
// client is blocked, and with a block_max its strikes and last block.
func setBlockState(cs *ClientState, lz *limiter.Zone, b limiter.BlockState) {
	if lz.Block <= 0 {
		return
	}
	if !b.Until.IsZero() {
		ms := b.Until.UnixMilli()
		cs.BlockedUntilMs = &ms
	}
	if lz.BlockMax > 0 {
		strikes, last := b.Strikes, limiter.CeilMs(b.Length)
		cs.Strikes = &strikes
		if last > 0 {
			cs.LastBlockMs = &last
		}
	}
}
