package limiter

// A decide.lua call's layout (KEYS, ARGV and the reply, stated at the top of lua/decide.lua) is
// known to this file only: encodeDecision writes one decision's KEYS and ARGV, mergeCalls puts
// the decisions of a batch into one call, and decodeReply reads one decision's reply. Every call
// path (allowExact, allowSlots, the lease paths, the Batcher) goes through them, and no other code
// appends to or rewrites their slices.

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// encodeDecision returns decide.lua's KEYS and ARGV for the decision of reqs, whose state keys
// are state, its call sent at ref (the instance's clock). The keys are the state keys, then the
// record and generation keys of each zone whose charge is recorded, then the override key of
// each zone with Overrides, then the block key of each zone with a Block, each kind in zone
// order. crossSlot is set for one hash slot's call of a decision across slots: its token bucket
// charges are taken as holds and its window counter charges recorded (see allowSlots).
func (l *Limiter) encodeDecision(reqs []Request, state []string, crossSlot bool, ref time.Time) (keys []string, args []any) {
	args = l.scriptArgs(reqs, crossSlot, ref)
	keys = withRecords(state, reqs, args, crossSlot)
	keys = withOverrides(keys, state, reqs, args)
	return withBlocks(keys, state, reqs), args
}

// scriptArgs returns decide.lua's ARGV for the decision of reqs: the time ref (the instance's
// clock when the call is sent; "" for Redis TIME), then the decision's nonce, whether to take
// token bucket charges as holds, its number of zones, and algorithm, quota, rate and cost per
// zone; with a zone's Block, the number of zones carries the zones' blocks (blockArg). (A Batcher merges the decisions of a batch into one call: mergeCalls.) A token bucket
// that may hold the request (maxWait) has its rate sent as "<rate>,<max wait µs>", else the rate
// alone. A cost above the zone's MaxCost is sent as twice the quota (at most 2^54): above the
// quota, so the request is denied and nothing charged (however long a MaxWait); exact in Lua's
// doubles, which would round a larger cost; and small enough that the script's wait for it
// stays an integer Redis can return. A sliding window never adds more entries than MaxCost.
func (l *Limiter) scriptArgs(reqs []Request, hold bool, ref time.Time) []any {
	args := make([]any, 4, 4+4*len(reqs))
	if l.now != nil {
		args[0] = ref.UnixMicro()
	} else {
		args[0] = ""
	}
	args[2] = holdArg(reqs, hold)
	args[1] = ""
	if args[2] != "0" || slices.ContainsFunc(reqs, func(r Request) bool { return r.Zone.Algorithm == SlidingWindow }) {
		// The nonce names what the decision adds for later: sliding window members, holds and
		// records. A decision that adds none (token buckets and window counters charged now)
		// needs none, and saves its two allocations.
		args[1] = l.instance + "." + strconv.FormatUint(l.calls.Add(1), 36)
	}
	args[3] = blockArg(reqs)
	for _, r := range reqs {
		cost := r.Cost
		switch {
		case r.Zone.Overrides:
			// The quota and max cost in force are the override's, known to decide.lua only: it
			// checks the cost itself (see withOverrides). Above 2^54, a cost is beyond any quota.
			cost = min(cost, 2*MaxCapacity)
		case unsatisfiable(r):
			cost = 2 * r.Zone.Quota() // <= 2^54
		}
		tag := zoneTag(r.Zone)
		switch r.Zone.Algorithm {
		case SlidingWindow, SlidingWindowCounter:
			limit, window := r.Zone.windowArgs()
			args = append(args, tag, limit, window, cost)
		case FixedWindow:
			limit, _ := r.Zone.windowArgs()
			args = append(args, tag, limit, windowBounds(r.Zone, ref), r.costArg(cost))
		case Concurrency:
			limit, _ := r.Zone.windowArgs()
			args = append(args, tag, limit, "0", cost)
		default:
			capacity, rate := r.Zone.bucketArgs()
			if w := r.maxWait(); w > 0 {
				// go-redis formats a float64 argument so ('f', -1): the same number either way.
				rate = strconv.FormatFloat(r.Zone.RefillRate, 'f', -1, 64) + "," + strconv.FormatInt(w.Microseconds(), 10)
			}
			args = append(args, tag, capacity, rate, r.costArg(cost))
		}
	}
	return args
}

// tagArgs are decide.lua's algorithm arguments, boxed once (a string boxed per call would be an
// allocation per zone of every decision): per algorithm, its tag, and its tag with the shadow
// flag "s" (a shadow zone).
var tagArgs = func() (t [len(algorithms)][2]any) {
	for a := range algorithms {
		t[a] = [2]any{Algorithm(a).tag(), Algorithm(a).tag() + "s"}
	}
	return t
}()

// zoneTag is decide.lua's algorithm argument of zone z, boxed: its algorithm's tag, followed by
// "s" for a shadow zone. withOverrides adds the override flag.
func zoneTag(z *Zone) any {
	t := &tagArgs[min(int(z.Algorithm), len(tagArgs)-1)]
	if z.Shadow {
		return t[1]
	}
	return t[0]
}

// argTag returns the algorithm tag of decide.lua's algorithm argument a, without its flags
// (shadow, override): what settle.lua and refresh.lua are told of a zone.
func argTag(a any) string {
	s, _ := a.(string)
	if len(s) > 2 {
		return s[:2]
	}
	return s
}

// withRecords returns keys (the state keys of reqs, one decide.lua call's with args) followed by
// the record key and the generation key of each zone whose charge is recorded (recorded; the
// call is one slot's of a decision across slots when crossSlot), in order.
func withRecords(keys []string, reqs []Request, args []any, crossSlot bool) []string {
	out := keys
	for i, r := range reqs {
		if recorded(r, crossSlot) {
			if len(out) == len(keys) {
				out = append(make([]string, 0, len(keys)+2*len(reqs)), keys...)
			}
			out = append(out, recordKey(keys[i], args[1].(string)), genKey(keys[i]))
		}
	}
	return out
}

// hasOverride reports whether a, decide.lua's algorithm argument of a zone, carries the override
// flag (withOverrides).
func hasOverride(a any) bool {
	s, _ := a.(string)
	return len(s) > 2 && strings.IndexByte(s[2:], 'o') >= 0
}

// withOverrides returns keys (one decide.lua call's KEYS so far; state the state keys of reqs)
// with the override key of each zone of reqs with Overrides appended, and writes into that
// zone's algorithm argument in args the override flag: "o<k>:<max cost>", where k is the key's
// index in the call's KEYS (from 1) and max cost the zone's MaxCost (0: the quota in force).
func withOverrides(keys, state []string, reqs []Request, args []any) []string {
	out := keys
	for i, r := range reqs {
		if !r.Zone.Overrides {
			continue
		}
		if len(out) == len(keys) {
			out = append(make([]string, 0, len(keys)+len(reqs)), keys...)
		}
		out = append(out, overrideKeyOf(state[i]))
		mc := r.Zone.MaxCost
		if r.Zone.Algorithm == Concurrency {
			mc = 0
		}
		args[4+4*i] = args[4+4*i].(string) + "o" + strconv.Itoa(len(out)) + ":" + strconv.FormatInt(mc, 10)
	}
	return out
}

// blockArg is decide.lua's per-decision argument n for reqs: the number of zones, or when a zone
// has a Block, "<n>" followed by "/<block µs>,<block_max µs>" for each zone, "/" alone for a
// zone without one. The script then takes a block key per such zone, after the call's other keys
// (withBlocks).
func blockArg(reqs []Request) any {
	blocks := false
	for i := range reqs {
		blocks = blocks || reqs[i].Zone.Block > 0
	}
	if !blocks {
		return len(reqs)
	}
	b := strconv.AppendInt(make([]byte, 0, 2+24*len(reqs)), int64(len(reqs)), 10)
	for i := range reqs {
		b = append(b, '/')
		if z := reqs[i].Zone; z.Block > 0 {
			b = strconv.AppendInt(b, z.Block.Microseconds(), 10)
			b = append(b, ',')
			b = strconv.AppendInt(b, z.BlockMax.Microseconds(), 10)
		}
	}
	return string(b)
}

// withBlocks returns ckeys (one decide.lua call's keys: the state keys of reqs, stateKeys, then
// their record keys) followed by the block key of each zone of reqs with a Block, in order.
func withBlocks(ckeys, stateKeys []string, reqs []Request) []string {
	out := ckeys
	for i := range reqs {
		if reqs[i].Zone.Block > 0 {
			if len(out) == len(ckeys) {
				out = append(make([]string, 0, len(ckeys)+len(reqs)), ckeys...)
			}
			out = append(out, blockKey(stateKeys[i]))
		}
	}
	return out
}

// The block figure of a zone's reply (its first integer): 0 denied, 1 admitted, and for a zone
// with a Block, replyBlocked when a block in force refused the request (the zone's algorithm did
// not run) and replyBlockStarted when the zone denied it and its block starts now.
const (
	replyBlocked      = 2
	replyBlockStarted = 3
)

// zoneReply is one zone's part of the script's reply.
type zoneReply struct {
	allowed bool
	// block is replyBlocked or replyBlockStarted when a zone's block refused the request or
	// starts now; 0 otherwise. A byte in allowed's padding.
	block uint8
	// granted is the tokens a grant took (a zone that asked one: Request.ask, so at most 2^31 −
	// 1), its cost included; an int32 in allowed's padding, so that a zoneReply is no larger.
	granted   int32
	remaining int64
	// retryAfter is, when allowed, the delay: how long to hold the request (0 but with MaxWait).
	retryAfter, reset, next int64 // µs
	// ov, of a zone with Overrides, is the client's override in force: the quota, the policy
	// window (µs; 0: the zone's) and the max cost that decided; the zero value when the client
	// has none.
	ov overrideReply
}

// overrideReply is the override in force in a zone's reply (zoneReply.ov).
type overrideReply struct {
	quota, windowUs, maxCost int64
}

// overrideWidth is the number of integers a zone with Overrides adds to its reply: the quota in
// force (0: no override), the policy window in force (µs; 0: the zone's) and the max cost in
// force.
const overrideWidth = 3

// replyWidth is the number of integers per zone in decide.lua's reply; a zone that asked for a
// grant has one more: the tokens granted.
const replyWidth = 5

// costArg is decide.lua's cost argument for r, whose cost as sent is cost: cost, or
// "<cost>,<ask>" for a zone that asks for a grant (see leaseTable.plan).
func (r *Request) costArg(cost int64) any {
	if r.ask > 0 {
		return strconv.FormatInt(cost, 10) + "," + strconv.FormatInt(int64(r.ask), 10)
	}
	return cost
}

// width is the number of integers of r's zone in decide.lua's reply.
func (r *Request) width() int {
	w := replyWidth
	if r.ask > 0 {
		w++
	}
	if r.Zone.Overrides {
		w += overrideWidth
	}
	return w
}

// decodeResult decodes the reply of a decide script call for reqs, or wraps its error.
func decodeResult(reply any, err error, reqs []Request) (bool, []zoneReply, error) {
	if errors.Is(err, redis.Nil) {
		// The script always returns an array: a nil reply is not Redis speaking.
		return false, nil, fmt.Errorf("%w: got a nil reply, want an array", ErrBadResponse)
	}
	if err != nil {
		return false, nil, fmt.Errorf("redis decide script: %w", err)
	}
	arr, ok := reply.([]any)
	if !ok {
		return false, nil, fmt.Errorf("%w: got %T, want an array", ErrBadResponse, reply)
	}
	return decodeReply(arr, reqs, nil)
}

// decodeReply checks and decodes the script's reply for reqs: an array of 1 + 5n integers (n
// zones, and one more per zone that asked for a grant), the first 0 or 1, then per zone allowed
// (0 or 1; for a zone with a Block, also replyBlocked or replyBlockStarted), remaining, retry after (µs; when the zone admits the request, its delay), reset (µs)
// and next (µs), and for a zone that asked for a grant the tokens granted, none negative, and no
// delay longer than the zone may hold the request (maxWait: none without MaxWait). Any other
// shape, type or value is an error wrapping ErrBadResponse: a request is never held past its
// MaxWait, whatever Redis replies. The zones are decoded into into's array when it has room for
// them.
func decodeReply(arr []any, reqs []Request, into []zoneReply) (bool, []zoneReply, error) {
	n, want := len(reqs), 1
	for i := range reqs {
		want += reqs[i].width()
	}
	if len(arr) != want {
		return false, nil, fmt.Errorf("%w: got %d values, want %d", ErrBadResponse, len(arr), want)
	}
	first, err := replyInt(arr, 0, true)
	if err != nil {
		return false, nil, err
	}
	zones := into[:0]
	if cap(zones) < n {
		zones = make([]zoneReply, 0, n)
	}
	zones = zones[:n]
	off := 1
	for z := range reqs {
		var v [replyWidth + 1 + overrideWidth]int64 // one zone's values
		w := reqs[z].width()
		for k := range w {
			if k == 0 && blockFigure(arr[off], reqs[z]) {
				v[0] = arr[off].(int64)
				continue
			}
			if v[k], err = replyInt(arr, off+k, k == 0); err != nil {
				return false, nil, err
			}
		}
		off += w
		var ov overrideReply
		if reqs[z].Zone.Overrides {
			o := w - overrideWidth
			ov = overrideReply{quota: v[o], windowUs: v[o+1], maxCost: v[o+2]}
			v[o], v[o+1], v[o+2] = 0, 0, 0
			if ov.quota > 0 && (ov.quota > MaxCapacity || ov.maxCost > ov.quota || ov.maxCost < 1) {
				return false, nil, fmt.Errorf("%w: zone %d's override quota %d and max cost %d are out of range", ErrBadResponse, z, ov.quota, ov.maxCost)
			}
		}
		if v[5] > int64(reqs[z].ask) {
			return false, nil, fmt.Errorf("%w: zone %d granted %d, more than the %d asked", ErrBadResponse, z, v[5], reqs[z].ask)
		}
		zones[z] = zoneReply{allowed: v[0] == 1, remaining: v[1], retryAfter: v[2], reset: v[3], next: v[4], granted: int32(v[5]), ov: ov}
		if v[0] > 1 {
			zones[z].block = uint8(v[0])
		}
		if zones[z].allowed && zones[z].retryAfter > reqs[z].maxWait().Microseconds() {
			return false, nil, fmt.Errorf("%w: zone %d admits with a delay of %dµs, beyond its max_wait of %v",
				ErrBadResponse, z, zones[z].retryAfter, reqs[z].maxWait())
		}
	}
	return first == 1, zones, nil
}

// blockFigure reports whether x (a zone's first reply integer) is a block figure of r's zone:
// replyBlocked or replyBlockStarted, from a zone with a Block.
func blockFigure(x any, r Request) bool {
	v, ok := x.(int64)
	return ok && r.Zone.Block > 0 && (v == replyBlocked || v == replyBlockStarted)
}

// replyInt returns arr[i], which must be an integer >= 0, and at most 1 when flag.
func replyInt(arr []any, i int, flag bool) (int64, error) {
	x, ok := arr[i].(int64)
	if !ok {
		return 0, fmt.Errorf("%w: value %d is %T, want an integer", ErrBadResponse, i, arr[i])
	}
	if x < 0 || (flag && x > 1) {
		return 0, fmt.Errorf("%w: value %d is %d, out of range", ErrBadResponse, i, x)
	}
	return x, nil
}

// mergeCalls returns the one decide.lua call that decides calls in order: their keys one after
// the other, and their arguments after one time (the first call's: "" for the Redis clock).
func mergeCalls(calls []*call) *call {
	if len(calls) == 1 {
		return calls[0] // split then hands it its whole reply
	}
	nk, na := 0, 1
	for _, c := range calls {
		nk += len(c.keys)
		na += len(c.args) - 1
	}
	m := &call{keys: make([]string, 0, nk), args: make([]any, 1, na)}
	m.args[0] = calls[0].args[0]
	for _, c := range calls {
		m.keys = append(m.keys, c.keys...)
		m.args = append(m.args, c.args[1:]...)
	}
	return m
}

// zones is the number of zones a decide.lua call decides: 4 arguments each after now, nonce,
// hold and n.
func (c *call) zones() int { return argZones(c.args) }

// argZones is the number of zones of one decision whose decide.lua arguments are args (as
// encodeDecision returns them): 4 arguments each after now, nonce, hold and n.
func argZones(args []any) int { return (len(args) - 4) / 4 }

// zoneArgsOf returns the 4 decide.lua arguments of zone j of one decision whose arguments are args:
// algorithm (with its flags), quota, rate and cost.
func zoneArgsOf(args []any, j int) []any { return args[4+4*j : 8+4*j : 8+4*j] }

// replyLen is the length of a decide.lua call's reply: 1 + 5 per zone, and one more per zone
// that asked for a grant (its cost sent as the string "<cost>,<ask>": Request.ask).
//
// A zone with Overrides has overrideWidth more (its algorithm argument carries the override
// flag: see withOverrides).
func (c *call) replyLen() int {
	n := 1 + replyWidth*c.zones()
	for j := 7; j < len(c.args); j += 4 {
		if _, ok := c.args[j].(string); ok {
			n++
		}
		if hasOverride(c.args[j-3]) {
			n += overrideWidth
		}
	}
	return n
}

// hasBucket reports whether the decide.lua call c decides a token bucket zone.
func (c *call) hasBucket() bool {
	for j := 4; j < len(c.args); j += 4 {
		if argTag(c.args[j]) == TokenBucket.tag() {
			return true
		}
	}
	return false
}
