package limiter

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Commander is the part of a Client that State and Reset use: plain single-key commands, so
// they are safe on Redis Cluster (a state key lives in one hash slot).
type Commander interface {
	Time(ctx context.Context) *redis.TimeCmd
	TxPipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
	Del(ctx context.Context, keys ...string) *redis.IntCmd
	Publish(ctx context.Context, channel string, message any) *redis.IntCmd
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
	// Negative when the bucket owes tokens: the reservations of held requests (MaxWait), or
	// more used than a lowered capacity.
	Tokens float64
	// Count (window algorithms) is the slots taken: by entries inside the sliding window
	// ending at Now (sliding window log; entries older than the window, not yet removed by a
	// decision, are not counted), in the fixed window holding Now (fixed window), in the current
	// fixed window (sliding window counter); for a concurrency zone, the client's requests in
	// flight at Now (slots whose deadline is after Now; Limiter.InFlight lists them).
	Count int64
	// Learnt (adaptive concurrency only) is the zone's controller for the client: the limit in
	// force (Remaining is counted against it) and the latencies it learnt from, as decide.lua
	// reads them (the min limit before the first sample).
	Learnt Learnt
	// Estimate (sliding window counter only) is the count the zone compares with its limit:
	// Count plus the previous window's count weighted by its share still inside the window.
	Estimate float64
	// WindowStart and WindowEnd (fixed window only) are the window holding Now: [start, end).
	WindowStart, WindowEnd time.Time
	// Remaining is the whole tokens or window slots a request could take at Now: what
	// X-RateLimit-Remaining would say before the request. 0 while the client is blocked.
	Remaining int64
	// RetryAfter is how long from Now until a request of cost 1 would be admitted: 0 when it
	// would be admitted now. With a MaxWait, admitted includes admitted and held.
	RetryAfter time.Duration
	// Wait (token bucket with a MaxWait only) is how long from Now until the bucket holds a
	// whole token: how long a request of cost 1 admitted at Now is held, when that is within
	// MaxWait. 0 when the bucket holds one now.
	Wait time.Duration
	// Reset is how long from Now until the zone is back to its full quota, as a denied request's
	// decision reports it: 0 when it is full. For a concurrency zone, 1µs while a slot is taken
	// (a slot comes back when a response ends, which no clock tells). At least the block's
	// remaining time while the client is blocked.
	Reset time.Duration
	// Next is how long from Now until the zone has at least one more whole unit than Remaining,
	// as a denied request's decision reports it (the `t` of the IETF RateLimit field): 0 when it
	// is full; the block's remaining time while the client is blocked.
	Next time.Duration
	// TTL is the key's time to live in Redis, to the millisecond: when a bucket would be full
	// again, or the newest window entry leaves the window, as of the last admitted request.
	// 0 when !Exists; -1 when the key has no expiry (decide.lua always sets one).
	TTL time.Duration
	// Block (a zone with a Block only) is the client's penalty box: a block in force at Now, the
	// last block remembered and its strikes. RetryAfter is then at least the time until Until.
	Block BlockState
	// Override (a zone with Overrides only) is the client's override, zero when it has none.
	// The state is computed with the numbers in force, Override.Apply(z), as decisions use them.
	Override Override
}

// State reads the client's state in zone z (z as passed to Decide; clientKey raw, as the
// handler resolved it: it is sanitised with ClientKey) without changing it: no key is created,
// nothing expires sooner or later. A zone with Overrides reads the client's override first, and
// computes the state with its numbers. The state's key is read in one MULTI/EXEC transaction, after the
// time is taken (Redis TIME, unless the Limiter has its own clock), so the state is consistent.
//
// The error wraps the Redis or network error (context.DeadlineExceeded when ctx expires first), or
// ErrBadResponse.
func (l *Limiter) State(ctx context.Context, z *Zone, clientKey string) (State, error) {
	var err error
	s := State{Key: StateKey(l.prefix, z, clientKey)}
	if l.now != nil {
		s.Now = l.now()
	} else if s.Now, err = l.rdb.Time(ctx).Result(); err != nil {
		return State{}, fmt.Errorf("redis TIME: %w", err)
	}
	now := s.Now.UnixMicro()
	if z.Overrides {
		o, _, found, err := l.GetOverride(ctx, z, clientKey)
		if err != nil {
			return State{}, err
		}
		if found {
			oz := o.Apply(z)
			z, s.Override = &oz, o
		}
	}
	if read := z.Algorithm.describe().state; read != nil {
		err = read(l, ctx, z, now, &s)
	} else {
		err = fmt.Errorf("state: unknown algorithm %v", z.Algorithm)
	}
	if err == nil && z.Block > 0 {
		err = l.blockState(ctx, now, &s)
	}
	if err != nil {
		return State{}, err
	}
	if !s.Block.Until.IsZero() {
		s.Remaining = 0 // a blocked client's requests are refused, as X-RateLimit-Remaining says
	}
	return s, nil
}

// bucketState reads a token bucket's hash and computes its tokens at now as decide.lua does.
func (l *Limiter) bucketState(ctx context.Context, z *Zone, now int64, s *State) error {
	var fields *redis.MapStringStringCmd
	var ttl *redis.DurationCmd
	if _, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		fields = p.HGetAll(ctx, s.Key)
		ttl = p.PTTL(ctx, s.Key)
		return nil
	}); err != nil {
		return fmt.Errorf("redis read of %s: %w", s.Key, err)
	}
	if err := s.setTTL(ttl.Val()); err != nil {
		return err
	}
	tokens := bucketTokens(fields.Val(), float64(now), float64(z.Capacity), z.RefillRate)
	s.Tokens = tokens
	s.Remaining = max(0, int64(math.Floor(tokens+tokenEpsilon)))
	var wait time.Duration
	if tokens+tokenEpsilon < 1 {
		wait = time.Duration(math.Ceil((1-tokens)/z.RefillRate*1e6)) * time.Microsecond
	}
	s.RetryAfter = max(0, wait-z.MaxWait.Truncate(time.Microsecond))
	if z.MaxWait > 0 {
		s.Wait = wait
	}
	capacity := float64(z.Capacity)
	s.Reset = bucketWait(tokens, capacity, z.RefillRate)
	if whole := math.Floor(tokens + tokenEpsilon); whole < capacity {
		s.Next = bucketWait(tokens, max(whole, 0)+1, z.RefillRate)
	}
	return nil
}

// bucketWait is decide.lua's wait: how long a bucket holding tokens takes to hold want at rate
// tokens per second, rounded up to the µs; 0 when it holds them now.
func bucketWait(tokens, want, rate float64) time.Duration {
	if tokens+tokenEpsilon >= want {
		return 0
	}
	return time.Duration(math.Ceil((want-tokens)*1e6/rate)) * time.Microsecond
}

// bucketTokens is decide.lua's reading of a token bucket hash at now: capacity less what is
// used (drained at rate since ts) and held (a hold older than holdMax counting as used). A hash
// last written by the previous script (t without a leading '+', the tokens left at ts) is read
// as that script would. A missing or unreadable bucket is a full one. The result is negative
// when more is used than the capacity in force.
func bucketTokens(f map[string]string, now, capacity, rate float64) float64 {
	used, okU := number(f["u"])
	ts, okTS := number(f["ts"])
	if t, ok := f["t"]; ok && !strings.HasPrefix(t, "+") && okTS {
		if left, ok := number(t); ok {
			used, okU = math.Max(0, capacity-left), true
		}
	}
	if !okU || !okTS {
		return capacity
	}
	if now > ts {
		used = math.Max(0, used-(now-ts)*rate/1e6)
	}
	held := 0.0
	for k, v := range f {
		if !strings.HasPrefix(k, "h:") {
			continue
		}
		c, at, ok := strings.Cut(v, "@")
		cost, err1 := strconv.ParseInt(c, 10, 64)
		when, err2 := strconv.ParseInt(at, 10, 64)
		if !ok || err1 != nil || err2 != nil {
			continue
		}
		if now-float64(when) > holdMax {
			used += float64(cost)
		} else {
			held += float64(cost)
		}
	}
	return capacity - used - held
}

// holdMax is decide.lua's HOLD_MAX: µs a hold may wait for settle.lua before it counts as used.
const holdMax = 5e6

// windowState counts a sliding window log's entries inside the window ending at now. The
// entry that must leave before a request of cost 1 fits is the Limit-th newest one in the
// window (there is one only when the window is full): it is read in the same transaction.
func (l *Limiter) windowState(ctx context.Context, z *Zone, now int64, s *State) error {
	// decide.lua removes entries scored at or before now - window: the window is (now - window, +inf).
	min := "(" + strconv.FormatInt(now-z.Window.Microseconds(), 10)
	var count *redis.IntCmd
	var edge, oldest, newest *redis.ZSliceCmd
	var ttl *redis.DurationCmd
	if _, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		count = p.ZCount(ctx, s.Key, min, "+inf")
		edge = p.ZRevRangeByScoreWithScores(ctx, s.Key, &redis.ZRangeBy{Min: min, Max: "+inf", Offset: z.Limit - 1, Count: 1})
		oldest = p.ZRangeByScoreWithScores(ctx, s.Key, &redis.ZRangeBy{Min: min, Max: "+inf", Count: 1})
		newest = p.ZRevRangeByScoreWithScores(ctx, s.Key, &redis.ZRangeBy{Min: min, Max: "+inf", Count: 1})
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
	// As decide.lua's denial: the next unit comes back when the oldest entry leaves the window,
	// the whole quota when the newest does.
	if o, n := oldest.Val(), newest.Val(); len(o) == 1 && len(n) == 1 {
		s.Next = time.Duration(max(1, int64(o[0].Score)+z.Window.Microseconds()-now)) * time.Microsecond
		s.Reset = time.Duration(max(0, int64(n[0].Score)+z.Window.Microseconds()-now)) * time.Microsecond
	}
	return nil
}

// Slot is a concurrency zone's slot in flight: the request's decision nonce and its deadline.
type Slot struct {
	ID       string
	Deadline time.Time
}

// slotState counts a concurrency zone's slots whose deadline is after now: what decide.lua
// counts as taken. Limiter.InFlight lists them.
func (l *Limiter) slotState(ctx context.Context, z *Zone, now int64, s *State) error {
	var count *redis.IntCmd
	var ttl *redis.DurationCmd
	var learnt *redis.SliceCmd
	if _, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		count = p.ZCount(ctx, s.Key, "("+strconv.FormatInt(now, 10), "+inf")
		ttl = p.PTTL(ctx, s.Key)
		if z.Adaptive != nil { // adaptive concurrency (the table's property: an initialization cycle)
			learnt = p.HMGet(ctx, controlKey(s.Key), "e", "m", "r")
		}
		return nil
	}); err != nil {
		return fmt.Errorf("redis read of %s: %w", s.Key, err)
	}
	if err := s.setTTL(ttl.Val()); err != nil {
		return err
	}
	limit := z.Limit
	if learnt != nil {
		s.Learnt = readLearnt(learnt.Val(), z)
		limit = s.Learnt.Limit
	}
	s.Count = count.Val()
	s.Remaining = max(0, limit-s.Count)
	if s.Remaining < 1 {
		s.RetryAfter = time.Second // decide.lua's: a slot comes back when a response ends
	}
	if s.Count > 0 {
		s.Reset, s.Next = time.Microsecond, time.Microsecond // decide.lua's: a slot may come back at any moment
	}
	return nil
}

// InFlight lists the client's slots in concurrency zone z (clientKey raw, as for State) whose
// deadline is after now (the Redis server's TIME, or the Limiter's clock): the requests in
// flight, with the time each frees itself unless refreshed or given back first, soonest first.
// It changes nothing.
func (l *Limiter) InFlight(ctx context.Context, z *Zone, clientKey string) ([]Slot, error) {
	key := StateKey(l.prefix, z, clientKey)
	var now time.Time
	var err error
	if l.now != nil {
		now = l.now()
	} else if now, err = l.rdb.Time(ctx).Result(); err != nil {
		return nil, fmt.Errorf("redis TIME: %w", err)
	}
	var slots *redis.ZSliceCmd
	if _, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		// ZREVRANGEBYSCORE, as windowState reads: the admin API's grant has it.
		slots = p.ZRevRangeByScoreWithScores(ctx, key, &redis.ZRangeBy{Min: "(" + strconv.FormatInt(now.UnixMicro(), 10), Max: "+inf"})
		return nil
	}); err != nil {
		return nil, fmt.Errorf("redis read of %s: %w", key, err)
	}
	var out []Slot
	for _, e := range slices.Backward(slots.Val()) {
		id, _ := e.Member.(string)
		out = append(out, Slot{ID: id, Deadline: time.UnixMicro(int64(e.Score))})
	}
	return out, nil
}

// fixedWindowState reads a fixed window's count ("<window mark>:<count>") and counts it at now as
// decide.lua does.
func (l *Limiter) fixedWindowState(ctx context.Context, z *Zone, now int64, s *State) error {
	var value *redis.StringCmd
	var ttl *redis.DurationCmd
	if _, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		value = p.Get(ctx, s.Key)
		ttl = p.PTTL(ctx, s.Key)
		return nil
	}); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("redis read of %s: %w", s.Key, err)
	}
	if err := s.setTTL(ttl.Val()); err != nil {
		return err
	}
	start, end := z.windowAt(time.UnixMicro(now))
	s.WindowStart, s.WindowEnd = start, end
	mark, count, ok := strings.Cut(value.Val(), ":")
	if n, err := strconv.ParseInt(count, 10, 64); ok && err == nil && mark == windowMark(start.UnixMicro()) {
		s.Count = n
	}
	s.Remaining = max(0, z.Limit-s.Count)
	left := time.Duration(max(1, end.UnixMicro()-now)) * time.Microsecond
	if s.Remaining < 1 {
		s.RetryAfter = left
	}
	if s.Count > 0 {
		s.Reset, s.Next = left, left // the count starts again at the window's end
	}
	return nil
}

// counterState reads a sliding window counter's hash and counts it at now as decide.lua does.
func (l *Limiter) counterState(ctx context.Context, z *Zone, now int64, s *State) error {
	var fields *redis.MapStringStringCmd
	var ttl *redis.DurationCmd
	if _, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		fields = p.HGetAll(ctx, s.Key)
		ttl = p.PTTL(ctx, s.Key)
		return nil
	}); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("redis read of %s: %w", s.Key, err)
	}
	if err := s.setTTL(ttl.Val()); err != nil {
		return err
	}
	f := fields.Val()
	stored, _ := strconv.ParseInt(f["s"], 10, 64)
	c, _ := strconv.ParseInt(f["c"], 10, 64)
	w := z.Window.Microseconds()
	start := now - now%w
	var cur, prev int64
	switch stored {
	case start:
		cur = c
		prev, _ = strconv.ParseInt(f["p"], 10, 64)
	case start - w:
		prev = c
	}
	elapsed := float64(now - start)
	s.Count = cur
	s.Estimate = float64(prev)*(float64(w)-elapsed)/float64(w) + float64(cur)
	s.Remaining = max(0, int64(math.Floor(float64(z.Limit)-s.Estimate+tokenEpsilon)))
	when := func(target int64) time.Duration {
		return counterWhen(float64(target), s.Estimate, float64(cur), float64(prev), float64(w), elapsed)
	}
	if s.Remaining < 1 {
		s.RetryAfter = when(z.Limit - 1)
	}
	s.Reset = when(0)
	if s.Estimate > tokenEpsilon {
		s.Next = when(max(0, z.Limit-s.Remaining-1))
	}
	return nil
}

// counterWhen is decide.lua's when(target) of a sliding window counter of w µs, elapsed µs into
// its current window whose count is cur, the previous window's prev: how long until the
// estimate est is at most target if nothing more is admitted. The previous window's weight
// falls within this window, the current count's within the next.
func counterWhen(target, est, cur, prev, w, elapsed float64) time.Duration {
	if est <= target+tokenEpsilon {
		return 0
	}
	var us float64
	if cur <= target+tokenEpsilon {
		us = math.Ceil(w*(1-(target-cur)/prev)) - elapsed
	} else {
		us = w - elapsed + math.Ceil(w*(1-target/cur))
	}
	return time.Duration(max(1, us)) * time.Microsecond
}

// windowMark is decide.lua's window_mark: a fixed window's start (µs) as stored with its count.
func windowMark(start int64) string {
	if start%1e6 == 0 {
		return strconv.FormatInt(start/1e6, 10)
	}
	return strconv.FormatFloat(float64(start)/1e6, 'f', 6, 64)
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
// bucket or an empty window, and its block (BlockKey: the block in force and the strikes
// remembered, whether or not z has a Block now), forgets this Limiter's cached denials of it (Forget), and publishes
// the state key on the Redis channel `<prefix>reset`, so that every Limiter whose ResetListener
// hears it forgets its own. existed reports whether Redis held state or a block for the client. An instance
// that misses the message (not subscribed, or disconnected at that moment) may deny the client
// from its deny cache for at most its DenyCacheMaxAge. A charge held for settlement after the
// response (Request.Hold) is not taken from the new state when it is settled.
//
// On an error other than ErrNotBroadcast nothing is forgotten; the Redis key may or may not
// have been deleted, and calling Reset again is safe. An error wrapping ErrNotBroadcast is a
// failed publish: the reset is done (existed is set), but other instances may deny the client
// from their deny caches for up to their DenyCacheMaxAge.
func (l *Limiter) Reset(ctx context.Context, z *Zone, clientKey string) (existed bool, err error) {
	key := StateKey(l.prefix, z, clientKey)
	var del, delBlock *redis.IntCmd
	// A window counter's count generation (genKey) goes with it, in one transaction: the charges
	// pending settlement, no longer in the count, then find their generation gone and are never
	// taken from the new count (see settle.lua).
	_, err = l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		del = p.Del(ctx, key)
		delBlock = p.Del(ctx, blockKey(key))
		if z.Algorithm.recorded() {
			p.Del(ctx, genKey(key))
		}
		if z.Algorithm.Adapts() { // what it learnt goes too: the next sample starts a probe
			p.Del(ctx, controlKey(key))
		}
		return nil
	})
	n := del.Val() + delBlock.Val()
	if err != nil {
		return false, fmt.Errorf("redis DEL %s: %w", key, err)
	}
	// After the delete, not before, so that a denial decided on the old state and recorded
	// meanwhile is dropped too (one still in flight after Forget can outlive the reset).
	l.Forget(z, clientKey)
	if err := l.rdb.Publish(ctx, resetChannel(l.prefix), key).Err(); err != nil {
		return n > 0, fmt.Errorf("%w: redis PUBLISH %s: %w", ErrNotBroadcast, resetChannel(l.prefix), err)
	}
	return n > 0, nil
}

// ErrNotBroadcast is Reset's error when the reset is done but its announcement to the other
// instances (a PUBLISH on `<prefix>reset`) failed.
var ErrNotBroadcast = errors.New("reset done, but not announced to the other instances")

// resetChannel is the Redis pub/sub channel on which Reset announces the state keys it deleted,
// for Limiters of the key prefix prefix: `<prefix>reset`.
func resetChannel(prefix string) string { return prefix + "reset" }

// Forget removes this Limiter's cached denials of the client in the zone named as z, whatever
// their numbers and cost, and ends its lease grants of them (see Lease), so that its next
// request is decided by Redis. The grants are returned before it returns (within
// Options.CallTimeout; a grant asked and not answered yet, within twice that): a hold the reset
// deleted gives nothing back, one Redis made on the new state gives back what it holds. Without
// grants it never contacts Redis.
func (l *Limiter) Forget(z *Zone, clientKey string) {
	if l.denials != nil {
		l.denials.forget(z.Name, ClientKey(clientKey))
	}
	if l.leases != nil {
		if gs := l.leases.drop(z.Name, ClientKey(clientKey), 2*l.callTime); len(gs) > 0 {
			l.returnWithin(gs)
		}
	}
}

// forgetKey removes this Limiter's cached denials of the state key key (as Reset publishes it):
// the zone of that name and the client of that key, whatever the cost, and ends its grants of
// them as Forget does, returning them in the background. A key of another prefix, or not of
// StateKey's form, is ignored. Without grants it never contacts Redis.
func (l *Limiter) forgetKey(key string) {
	if l.denials == nil && l.leases == nil {
		return
	}
	client, zone, ok := parseStateKey(l.prefix, key)
	if !ok {
		return
	}
	if l.denials != nil {
		l.denials.forget(zone, client)
	}
	if l.leases != nil {
		if gs := l.leases.drop(zone, client, 2*l.callTime); len(gs) > 0 {
			go l.returnWithin(gs)
		}
	}
}
