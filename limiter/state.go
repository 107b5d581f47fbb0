package limiter

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Commander is the part of a Client that State and Reset use: plain single-key commands, so
// they are safe on Redis Cluster (a state key lives in one hash slot).
type Commander interface {
	Time(ctx context.Context) *redis.TimeCmd
	TxPipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
	Del(ctx context.Context, keys ...string) *redis.IntCmd
}

// tokenEpsilon is decide.lua's EPSILON: the float slack with which a bucket is compared to a
// cost and its whole tokens are counted.
const tokenEpsilon = 1e-9

// State is one client's state in one zone, read from Redis by Limiter.State.
type State struct {
	// Key is the Redis key of the state: StateKey(prefix, zone, client key).
	Key string
	// Exists is false when Redis holds no state for the client (never seen, or expired): a
	// token bucket is then full and a window empty.
	Exists bool
	// Now is the time the state is computed for: the Redis server's TIME, or the Limiter's
	// clock when Options.Now is set (`clock local`), as decide.lua would use.
	Now time.Time
	// Tokens (token bucket only) is the tokens in the bucket at Now, fractional: the stored
	// tokens plus the refill since they were stored, at most the capacity, exactly as decide.lua
	// computes it. With `clock local` and a stored time after Now, no refill is credited.
	Tokens float64
	// Count (sliding window only) is the slots taken by entries inside the window ending at Now
	// (entries older than the window, not yet removed by a decision, are not counted).
	Count int64
	// Remaining is the whole tokens or window slots a request could take at Now: what
	// X-RateLimit-Remaining would say before the request.
	Remaining int64
	// RetryAfter is how long from Now until a request of cost 1 would be admitted: 0 when it
	// would be admitted now.
	RetryAfter time.Duration
	// TTL is the key's time to live in Redis, to the millisecond: when a bucket would be full
	// again, or the newest window entry leaves the window, as of the last admitted request.
	// 0 when !Exists; -1 when the key has no expiry (decide.lua always sets one).
	TTL time.Duration
}

// State reads the client's state in zone z (z as passed to Allow; clientKey raw, as the
// handler resolved it: it is sanitised with ClientKey) without changing it: no key is created,
// nothing expires sooner or later. The key is read in one MULTI/EXEC transaction, after the
// time is taken (Redis TIME, unless the Limiter has its own clock), so the state is consistent.
//
// The error wraps the Redis or network error (context.DeadlineExceeded when ctx expires first), or ErrBadResponse.
func (l *Limiter) State(ctx context.Context, z *Zone, clientKey string) (State, error) {
	var err error
	s := State{Key: StateKey(l.prefix, z, clientKey)}
	if l.now != nil {
		s.Now = l.now()
	} else if s.Now, err = l.rdb.Time(ctx).Result(); err != nil {
		return State{}, fmt.Errorf("redis TIME: %w", err)
	}
	now := s.Now.UnixMicro()
	if z.Algorithm == SlidingWindow {
		err = l.windowState(ctx, z, now, &s)
	} else {
		err = l.bucketState(ctx, z, now, &s)
	}
	if err != nil {
		return State{}, err
	}
	return s, nil
}

// bucketState reads a token bucket's hash { t, ts } and refills it to now as decide.lua does.
func (l *Limiter) bucketState(ctx context.Context, z *Zone, now int64, s *State) error {
	var fields *redis.SliceCmd
	var ttl *redis.DurationCmd
	if _, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		fields = p.HMGet(ctx, s.Key, "t", "ts")
		ttl = p.PTTL(ctx, s.Key)
		return nil
	}); err != nil {
		return fmt.Errorf("redis read of %s: %w", s.Key, err)
	}
	if err := s.setTTL(ttl.Val()); err != nil {
		return err
	}
	capacity := float64(z.Capacity)
	v := fields.Val()
	tokens, okT := number(v[0])
	ts, okTS := number(v[1])
	switch {
	case !okT || !okTS:
		tokens = capacity // decide.lua: a missing or unreadable bucket is a full one
	case float64(now) > ts:
		tokens = math.Min(capacity, tokens+(float64(now)-ts)*z.RefillRate/1e6)
	}
	s.Tokens = tokens
	s.Remaining = int64(math.Floor(tokens + tokenEpsilon))
	if tokens+tokenEpsilon < 1 {
		s.RetryAfter = time.Duration(math.Ceil((1-tokens)/z.RefillRate*1e6)) * time.Microsecond
	}
	return nil
}

// windowState counts a sliding window log's entries inside the window ending at now. The
// entry that must leave before a request of cost 1 fits is the Limit-th newest one in the
// window (there is one only when the window is full): it is read in the same transaction.
func (l *Limiter) windowState(ctx context.Context, z *Zone, now int64, s *State) error {
	// decide.lua removes entries scored at or before now - window: the window is (now - window, +inf).
	min := "(" + strconv.FormatInt(now-z.Window.Microseconds(), 10)
	var count *redis.IntCmd
	var edge *redis.ZSliceCmd
	var ttl *redis.DurationCmd
	if _, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		count = p.ZCount(ctx, s.Key, min, "+inf")
		edge = p.ZRevRangeByScoreWithScores(ctx, s.Key, &redis.ZRangeBy{Min: min, Max: "+inf", Offset: z.Limit - 1, Count: 1})
		ttl = p.PTTL(ctx, s.Key)
		return nil
	}); err != nil {
		return fmt.Errorf("redis read of %s: %w", s.Key, err)
	}
	if err := s.setTTL(ttl.Val()); err != nil {
		return err
	}
	s.Count = count.Val()
	s.Remaining = max(0, z.Limit-s.Count)
	if e := edge.Val(); len(e) == 1 {
		// As decide.lua: the request fits once that entry is older than the window.
		s.RetryAfter = time.Duration(max(1, int64(e[0].Score)+z.Window.Microseconds()-now)) * time.Microsecond
	}
	return nil
}

// setTTL records PTTL's reply: -2 (no key), -1 (no expiry) or the time to live.
func (s *State) setTTL(ttl time.Duration) error {
	switch {
	case ttl == -2:
		s.Exists, s.TTL = false, 0
	case ttl == -1 || ttl >= 0:
		s.Exists, s.TTL = true, ttl
	default:
		return fmt.Errorf("%w: PTTL %s replied %d", ErrBadResponse, s.Key, ttl)
	}
	return nil
}

// number reads a hash field as decide.lua's tonumber would; false when it is absent or not a
// number.
func number(v any) (float64, bool) {
	str, ok := v.(string)
	if !ok {
		return 0, false
	}
	f, err := strconv.ParseFloat(str, 64)
	return f, err == nil && !math.IsNaN(f)
}

// Reset deletes the client's state in zone z from Redis, so that its next request finds a full
// bucket or an empty window, and forgets this Limiter's cached denial of it (Forget). existed
// reports whether Redis held state for the client. Other Limiters' deny caches (other
// instances) are not reached: they may deny the client until their cached retry time passes.
//
// On error nothing is forgotten; the Redis key
// may or may not have been deleted, and calling Reset again is safe.
func (l *Limiter) Reset(ctx context.Context, z *Zone, clientKey string) (existed bool, err error) {
	key := StateKey(l.prefix, z, clientKey)
	n, err := l.rdb.Del(ctx, key).Result()
	if err != nil {
		return false, fmt.Errorf("redis DEL %s: %w", key, err)
	}
	// After the delete, not before, so that a denial decided on the old state and recorded
	// meanwhile is dropped too (one still in flight after Forget can outlive the reset).
	l.Forget(z, clientKey)
	return n > 0, nil
}

// Forget removes this Limiter's cached denial of the client in zone z (z the pointer passed to
// Allow), if any, so that its next request is decided by Redis. It never contacts Redis.
func (l *Limiter) Forget(z *Zone, clientKey string) {
	if l.denials != nil {
		l.denials.c.Remove(denyKey{z, ClientKey(clientKey)})
	}
}
