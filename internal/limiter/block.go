package limiter

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The penalty box (Zone.Block): once a zone with a Block denies a client, decide.lua writes, in
// the same call, the client's block in the key BlockKey (in the state key's hash slot), and every
// later decision of the zone reads it before the zone's algorithm: while it lasts, the zone
// refuses the client, whatever its cost and on every instance, and the request charges no zone.
//
// The block key holds the string "<until>:<length>:<strikes>": when the block ends (µs since the
// Unix epoch, on the scripts' clock), how long it was (µs), and how many blocks in a row it ends
// (1 for a first offence). Without a BlockMax it expires when the block ends. With one it lives
// as long again after that: a client denied again meanwhile is a repeat offender, whose block is
// twice the last one, at most BlockMax, with one strike more; a client that stays out of trouble
// that long is forgotten, and its next block is Block again.

// Bounds of a zone's Block and BlockMax.
const (
	MinBlock = time.Second          // Retry-After counts whole seconds
	MaxBlock = 366 * 24 * time.Hour // as MaxWindow: every TTL stays within what Redis accepts
)

// blockTag ends a block key: `<prefix>{<client key>}:<zone>:block`. It is no algorithm's tag, so
// a block outlives a change of the zone's algorithm, and never meets a state key.
const blockTag = "block"

// BlockKey returns the Redis key of a client's block in zone z:
// `<prefix>{<ClientKey(rawClientKey)>}:<zone name>:block`, in the hash slot of the client's
// state keys.
func BlockKey(prefix string, z *Zone, rawClientKey string) string {
	return blockKey(StateKey(prefix, z, rawClientKey))
}

// blockKey returns the block key of the zone and client of state key stateKey.
func blockKey(stateKey string) string {
	return stateKey[:strings.LastIndexByte(stateKey, ':')+1] + blockTag
}

// validateBlock checks Block and BlockMax against each other and z's algorithm.
func (z *Zone) validateBlock() *FieldError {
	switch {
	case z.Block == 0 && z.BlockMax == 0:
		return nil
	case z.Block == 0:
		return z.fieldError("block_max", "block_max needs block: the first block's length, which a repeat offender's doubles")
	case z.Algorithm.HoldsSlots():
		return z.fieldError("block", "block does not apply to algorithm concurrency: its denials are momentary (a slot comes back whenever "+
			"a request ends), not a client going over a rate")
	case z.Shadow:
		return z.fieldError("block", "block excludes dry_run in a zone: a shadow zone never refuses a client, so it has no denial to start a block with")
	case z.Lease != nil:
		return z.fieldError("block", "block excludes lease: a grant admits requests in process, without reading Redis, so it would not see the block")
	case z.Block < MinBlock || z.Block > MaxBlock:
		return z.fieldError("block", "block %v must be between %v and %s", z.Block, MinBlock, FormatDuration(MaxBlock))
	case z.BlockMax != 0 && (z.BlockMax < z.Block || z.BlockMax > MaxBlock):
		return z.fieldError("block_max", "block_max %v must be between block (%v) and %s", z.BlockMax, z.Block, FormatDuration(MaxBlock))
	}
	return nil
}

// BlockState is a client's block in a zone, as Limiter.State reads it.
type BlockState struct {
	// Until is when the block ends, on the scripts' clock; the zero Time when the client is not
	// blocked at State.Now.
	Until time.Time
	// Length is how long the last block lasted (or lasts); 0 when Redis remembers none.
	Length time.Duration
	// Strikes is how many blocks in a row the last one ends (1: a first offence); 0 when Redis
	// remembers none. With a BlockMax, a block is remembered as long after its end as it
	// lasted; without, until its end.
	Strikes int64
}

// parseBlock reads a block key's value, "<until µs>:<length µs>:<strikes>"; ok is false for
// anything else.
func parseBlock(v string) (until, length, strikes int64, ok bool) {
	parts := strings.Split(v, ":")
	if len(parts) != 3 {
		return 0, 0, 0, false
	}
	var errs [3]error
	until, errs[0] = strconv.ParseInt(parts[0], 10, 64)
	length, errs[1] = strconv.ParseInt(parts[1], 10, 64)
	strikes, errs[2] = strconv.ParseInt(parts[2], 10, 64)
	return until, length, strikes, errors.Join(errs[:]...) == nil
}

// blockState reads the client's block key (zone z with a Block) at now (µs) into s.Block.
func (l *Limiter) blockState(ctx context.Context, now int64, s *State) error {
	key := blockKey(s.Key)
	v, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.Get(ctx, key)
		return nil
	})
	if errors.Is(err, redis.Nil) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("redis read of %s: %w", key, err)
	}
	until, length, strikes, ok := parseBlock(v[0].(*redis.StringCmd).Val())
	if !ok {
		return nil // as decide.lua: a value it cannot read is no block
	}
	s.Block.Length, s.Block.Strikes = time.Duration(length)*time.Microsecond, strikes
	if until > now {
		s.Block.Until = time.UnixMicro(until)
		left := time.Duration(until-now) * time.Microsecond
		s.RetryAfter, s.Reset, s.Next = max(s.RetryAfter, left), max(s.Reset, left), left
	}
	return nil
}

// ErrNoBlock is Block's error for a zone without a Block: its decisions read no block key.
var ErrNoBlock = errors.New("the zone has no block: its decisions read no block key")

// Block puts the client (clientKey raw, as for State) in zone z's penalty box for d (MinBlock to
// MaxBlock), from now on every instance, whether or not it ever went over the zone's limit: it
// replaces the client's block, if any, by one of length d and one strike (so a denial soon
// after it ends, with a BlockMax, gets 2d). The time is the Redis server's TIME, or the
// Limiter's clock, as decide.lua's. Then this Limiter forgets its cached denials of the client,
// and the block key is published on `<prefix>reset`, so every instance's ResetListener does too
// (a shorter block replacing a longer one must not be answered by a cached denial of the longer).
// It returns when the block ends, on the scripts' clock.
//
// The error is ErrNoBlock for a zone without a Block, wraps the Redis error, or wraps
// ErrNotBroadcast when the block is set but its announcement failed.
func (l *Limiter) Block(ctx context.Context, z *Zone, clientKey string, d time.Duration) (until time.Time, err error) {
	if z.Block <= 0 {
		return time.Time{}, ErrNoBlock
	}
	if d < MinBlock || d > MaxBlock {
		return time.Time{}, fmt.Errorf("block %v must be between %v and %s", d, MinBlock, FormatDuration(MaxBlock))
	}
	key := BlockKey(l.prefix, z, clientKey)
	var now time.Time
	if l.now != nil {
		now = l.now()
	} else if now, err = l.rdb.Time(ctx).Result(); err != nil {
		return time.Time{}, fmt.Errorf("redis TIME: %w", err)
	}
	us := d.Microseconds()
	ttl := d
	if z.BlockMax > 0 {
		ttl = 2 * d // remembered as long again after its end, as decide.lua's
	}
	until = time.UnixMicro(now.UnixMicro() + us)
	val := strconv.FormatInt(until.UnixMicro(), 10) + ":" + strconv.FormatInt(us, 10) + ":1"
	if _, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.Set(ctx, key, val, ttl)
		return nil
	}); err != nil {
		return time.Time{}, fmt.Errorf("redis SET %s: %w", key, err)
	}
	l.Forget(z, clientKey)
	if err := l.rdb.Publish(ctx, resetChannel(l.prefix), key).Err(); err != nil {
		return until, fmt.Errorf("%w: redis PUBLISH %s: %w", ErrNotBroadcast, resetChannel(l.prefix), err)
	}
	return until, nil
}
