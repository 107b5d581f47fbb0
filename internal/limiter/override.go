package limiter

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Overrides: a client's own numbers for a zone, set at run time (SetOverride) and read by
// decide.lua in the decision's own script call, so that every instance's next decision uses
// them. A zone reads them only with Zone.Overrides: a zone without pays no read.
//
// The override key (OverrideKey) is a hash with the client's state's hash tag, so it is in the
// state's slot on Redis Cluster. Its fields are the numbers' configuration names, each optional:
//
//	capacity     token bucket: tokens, an integer
//	refill_rate  token bucket: tokens per second, a float
//	limit        the window algorithms and concurrency: an integer
//	window       sliding_window, sliding_window_counter, fixed_window of a window: µs, an integer
//	max_cost     every algorithm but concurrency: an integer
//
// A number stored there takes the place of the zone's (its literal, or a placeholder's value);
// the others stay the zone's. A max_cost not stored is the zone's max_cost when it has one,
// else the quota in force; either way at most the quota in force. The key's TTL, when it has
// one, is when the override ends.

// Override is a client's override of a zone's numbers: each number set (not zero) takes the
// place of the zone's. Only the numbers of the zone's algorithm apply (see the table above).
type Override struct {
	Capacity   int64
	RefillRate float64 // tokens per second
	Limit      int64
	Window     time.Duration // whole µs
	MaxCost    int64
}

// IsZero reports whether o sets no number.
func (o Override) IsZero() bool { return o == Override{} }

// Apply returns z with o's numbers in place of its own (a copy; z is not changed), as decide.lua
// applies them: a max cost not set is z's, at most the new quota.
func (o Override) Apply(z *Zone) Zone {
	c := *z
	c.boxed = nil
	if o.Capacity > 0 {
		c.Capacity = o.Capacity
	}
	if o.RefillRate > 0 {
		c.RefillRate = o.RefillRate
	}
	if o.Limit > 0 {
		c.Limit = o.Limit
	}
	if o.Window > 0 {
		c.Window = o.Window
	}
	if o.MaxCost > 0 {
		c.MaxCost = o.MaxCost
	}
	if c.MaxCost > c.Quota() {
		c.MaxCost = c.Quota()
	}
	return c
}

// overrideFields are the override hash's field names, in the order of Override's fields.
var overrideFields = [...]string{"capacity", "refill_rate", "limit", "window", "max_cost"}

// overrideKeyOf returns the override key of the zone and client whose state key is stateKey
// (`…:<zone>:<tag>`, the tag two letters): `…:<zone>:ov`.
func overrideKeyOf(stateKey string) string { return stateKey[:len(stateKey)-2] + "ov" }

// applyOverrides sets the Zone of each of reqs whose reply has an override in force (zones) to a
// copy of it with the override's numbers, so that the Decision, each Result and the caller see
// the numbers that decided.
func applyOverrides(reqs []Request, zones []zoneReply) {
	for i := range zones {
		ov := zones[i].ov
		if !reqs[i].Zone.Overrides {
			continue
		}
		if ov.quota == 0 {
			if z := reqs[i].Zone; z.MaxCost > z.Quota() && ov.maxCost > 0 {
				// No override: the max cost in force is the zone's, at most its own quota.
				c := *z
				c.boxed, c.MaxCost = nil, ov.maxCost
				reqs[i].Zone = &c
			}
			continue
		}
		c := *reqs[i].Zone
		c.boxed = nil
		if !c.Algorithm.windowed() {
			c.Capacity = ov.quota
			if ov.windowUs > 0 {
				c.RefillRate = float64(ov.quota) / (float64(ov.windowUs) / 1e6)
			}
		} else {
			c.Limit = ov.quota
			if ov.windowUs > 0 && c.Period == NoPeriod && c.Algorithm.describe().window {
				c.Window = time.Duration(ov.windowUs) * time.Microsecond
			}
		}
		c.MaxCost = ov.maxCost
		if c.Algorithm.HoldsSlots() {
			c.MaxCost = 0
		}
		reqs[i].Zone = &c
	}
}

// settleZone returns settle.lua's zone arguments za (zoneArgsOf: algorithm, quota, rate, cost)
// of a zone with Overrides with the numbers in force that decided it (o, from its reply) in place
// of the zone's own, so that a charge settled after the response is settled as it was reserved
// whatever the override has become since. No override in force: za itself.
//   - Token bucket: the capacity in force, and the refill rate in force: the zone's own when the
//     policy window says the override left it (capacity / rate, µs rounded up, as decide.lua
//     reports it), else capacity / window, exact to the window's µs. A max_wait stays.
//   - Sliding window, sliding window counter: the limit and the window (µs) in force.
//   - Fixed window: the limit in force and, when the override sets a window, that window (µs,
//     one integer: windows aligned to the epoch, as decide.lua takes them) in place of the bounds.
//   - Concurrency: the limit in force (settle.lua reads none).
func (o overrideReply) settleZone(za []any) []any {
	if o.quota == 0 {
		return za
	}
	out := []any{za[0], o.quota, za[2], za[3]}
	switch a := algorithmOfTag(argTag(za[0])).describe(); {
	case a.capacity:
		own, wait, _ := strings.Cut(fmt.Sprint(za[2]), ",")
		r, err := strconv.ParseFloat(own, 64)
		if err != nil || o.windowUs <= 0 || math.Ceil(float64(o.quota)/r*1e6) != float64(o.windowUs) {
			r = float64(o.quota) / (float64(o.windowUs) / 1e6)
		}
		rate := strconv.FormatFloat(r, 'f', -1, 64)
		if wait != "" {
			rate += "," + wait
		}
		out[2] = rate
	case a.window:
		if o.windowUs > 0 {
			out[2] = o.windowUs
		}
	}
	return out
}

// inForce returns the decide.lua call c of one decision whose reply is zones with each zone's
// quota and rate those in force (settleZone), a copy: what settle.lua takes to give back or
// commit the charges with the numbers that took them. c itself when no zone has an override in
// force.
func inForce(c *call, zones []zoneReply) *call {
	out := c
	for j := range argZones(c.args) {
		if zones[j].ov.quota == 0 {
			continue
		}
		if out == c {
			out = &call{keys: c.keys, args: append([]any(nil), c.args...)}
		}
		za := zones[j].ov.settleZone(zoneArgsOf(c.args, j))
		b := 4 + zoneArgN*j
		out.args[b+1], out.args[b+2] = za[1], za[2]
	}
	return out
}

// ErrNoOverrides is the error of an override call for a zone without Overrides.
var ErrNoOverrides = errors.New("the zone has no overrides")

// SetOverride stores o as the client's override of zone z (which must have Overrides), in place
// of any it had, for ttl (0: until it is deleted), and announces it as Reset announces a reset:
// every Limiter that hears it forgets its cached denials of the client, so that a raised limit
// is not hidden by them. o's numbers must have been validated (see Override.Apply and
// Zone.Validate). The error wraps the Redis error; one wrapping ErrNotBroadcast means the
// override is stored but was not announced.
func (l *Limiter) SetOverride(ctx context.Context, z *Zone, clientKey string, o Override, ttl time.Duration) error {
	if !z.Overrides {
		return ErrNoOverrides
	}
	key := OverrideKey(l.prefix, z, clientKey)
	vals := o.fields()
	if len(vals) == 0 {
		return errors.New("an override sets at least one number")
	}
	_, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.Del(ctx, key)
		p.HSet(ctx, key, vals...)
		if ttl > 0 {
			p.PExpire(ctx, key, ttl)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("redis HSET %s: %w", key, err)
	}
	return l.announce(ctx, z, clientKey)
}

// fields are o's numbers as the override hash holds them: name, value, ….
func (o Override) fields() []any {
	var vals []any
	for i, v := range [...]any{o.Capacity, o.RefillRate, o.Limit, o.Window.Microseconds(), o.MaxCost} {
		switch x := v.(type) {
		case int64:
			if x > 0 {
				vals = append(vals, overrideFields[i], strconv.FormatInt(x, 10))
			}
		case float64:
			if x > 0 {
				vals = append(vals, overrideFields[i], strconv.FormatFloat(x, 'g', -1, 64))
			}
		}
	}
	return vals
}

// GetOverride returns the client's override of zone z, and how long it lasts (0: until it is
// deleted); found is false when the client has none. A field that does not parse is an error
// wrapping ErrBadResponse.
func (l *Limiter) GetOverride(ctx context.Context, z *Zone, clientKey string) (o Override, ttl time.Duration, found bool, err error) {
	key := OverrideKey(l.prefix, z, clientKey)
	var all *redis.MapStringStringCmd
	var pttl *redis.DurationCmd
	_, err = l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		all = p.HGetAll(ctx, key)
		pttl = p.PTTL(ctx, key)
		return nil
	})
	if err != nil {
		return Override{}, 0, false, fmt.Errorf("redis HGETALL %s: %w", key, err)
	}
	m := all.Val()
	if len(m) == 0 {
		return Override{}, 0, false, nil
	}
	if o, err = parseOverride(key, m); err != nil {
		return Override{}, 0, false, err
	}
	if d := pttl.Val(); d > 0 {
		ttl = d
	}
	return o, ttl, true, nil
}

// parseOverride reads the fields m of the override hash key. A field that does not parse is an
// error wrapping ErrBadResponse; fields of other names are ignored.
func parseOverride(key string, m map[string]string) (o Override, err error) {
	for name, v := range m {
		f, perr := strconv.ParseFloat(v, 64)
		if perr != nil || f <= 0 || math.IsInf(f, 0) {
			return Override{}, fmt.Errorf("%w: override %s field %s is %q", ErrBadResponse, key, name, v)
		}
		switch name {
		case "capacity":
			o.Capacity = int64(f)
		case "refill_rate":
			o.RefillRate = f
		case "limit":
			o.Limit = int64(f)
		case "window":
			o.Window = time.Duration(f) * time.Microsecond
		case "max_cost":
			o.MaxCost = int64(f)
		}
	}
	return o, nil
}

// DeleteOverride deletes the client's override of zone z, so that its next decision on every
// instance uses the zone's own numbers, and announces it as SetOverride does. existed reports
// whether there was one.
func (l *Limiter) DeleteOverride(ctx context.Context, z *Zone, clientKey string) (existed bool, err error) {
	key := OverrideKey(l.prefix, z, clientKey)
	n, err := l.rdb.Del(ctx, key).Result()
	if err != nil {
		return false, fmt.Errorf("redis DEL %s: %w", key, err)
	}
	return n > 0, l.announce(ctx, z, clientKey)
}

// announce forgets this Limiter's cached denials of the client in zone z and publishes its state
// key on the reset channel, so that every Limiter that hears it forgets its own (a change of
// the client's numbers may give it capacity back, as a reset does).
func (l *Limiter) announce(ctx context.Context, z *Zone, clientKey string) error {
	l.Forget(z, clientKey)
	key := StateKey(l.prefix, z, clientKey)
	if err := l.rdb.Publish(ctx, resetChannel(l.prefix), key).Err(); err != nil {
		return fmt.Errorf("%w: redis PUBLISH %s: %w", ErrNotBroadcast, resetChannel(l.prefix), err)
	}
	return nil
}
