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

// zoneArgN is the number of decide.lua arguments per zone: algorithm tag, quota, rate, cost and
// flags.
const zoneArgN = 5

// encodeDecision returns decide.lua's KEYS and ARGV for the decision of reqs, whose state keys
// are state, its call sent at ref (the instance's clock). crossSlot is set for one hash slot's
// call of a decision across slots: its token bucket charges are taken as holds and its window
// counter charges recorded (see allowSlots).
//
// KEYS are the state keys; then the record and generation keys of each zone whose charge is
// recorded (recorded), in zone order; then, per zone in order, its override key (Overrides), its
// block key (Block), its queue's waiters (Queues), its top's denied and used keys and their error keys (Top)
// and its controller's hash (an adaptive concurrency zone: controlKey). ARGV is the time ref ("" for Redis TIME), the decision's nonce, its hold
// argument (holdArg), its number of zones, then zoneArgN per zone: algorithm tag, quota, rate,
// cost and flags (zoneFlags).
func (l *Limiter) encodeDecision(reqs []Request, state []string, crossSlot bool, ref time.Time) (keys []string, args []any) {
	args = l.scriptArgs(reqs, crossSlot, ref)
	keys = state
	extra := false // keys beyond the state keys: keys is then a copy
	for i, r := range reqs {
		if recorded(r, crossSlot) {
			if !extra {
				keys, extra = append(make([]string, 0, len(state)+2*len(reqs)), state...), true
			}
			keys = append(keys, recordKey(state[i], args[1].(string)), genKey(state[i]))
		}
	}
	for i := range reqs {
		r := &reqs[i]
		// add appends key to keys (a copy of state once it grows) and returns its index.
		add := func(key ...string) int {
			if !extra {
				keys, extra = append(make([]string, 0, len(state)+2*len(reqs)), state...), true
			}
			keys = append(keys, key...)
			return len(keys) - len(key) + 1
		}
		var k flagKeys
		if r.Zone.Overrides {
			k.override = add(overrideKeyOf(state[i]))
		}
		if r.Zone.Block > 0 {
			k.block = add(blockKey(state[i]))
		}
		if r.Zone.Queues() && r.claim == "" {
			k.queue = add(waitersKey(state[i]))
		}
		if r.Zone.Top > 0 {
			k.top = add(l.topKeys(r, state[i], ref))
		}
		if r.Zone.Algorithm.Adapts() {
			k.control = add(controlKey(state[i]))
		}
		if f := zoneFlags(r, k); r.flagsArg() != any(f) {
			args[4+zoneArgN*i+4] = f // scriptArgs wrote the flags that name no key and take none
		}
	}
	return keys, args
}

// scriptArgs returns decide.lua's ARGV for the decision of reqs (see encodeDecision), each zone's
// flags "" or "s" (a shadow zone): encodeDecision writes the flags that name keys. A token bucket
// that may hold the request (maxWait) has its rate sent as "<rate>,<max wait µs>", else the rate
// alone. A cost above the zone's MaxCost is sent as twice the quota (at most 2^54): above the
// quota, so the request is denied and nothing charged (however long a MaxWait); exact in Lua's
// doubles, which would round a larger cost; and small enough that the script's wait for it
// stays an integer Redis can return. A sliding window never adds more entries than MaxCost.
func (l *Limiter) scriptArgs(reqs []Request, hold bool, ref time.Time) []any {
	args := make([]any, 4, 4+zoneArgN*len(reqs))
	if l.now != nil {
		args[0] = ref.UnixMicro()
	} else {
		args[0] = ""
	}
	args[2] = holdArg(reqs, hold)
	args[1] = ""
	if args[2] != "0" || slices.ContainsFunc(reqs, func(r Request) bool { return r.Zone.Algorithm.StoresEntries() }) {
		// The nonce names what the decision adds for later: sliding window members, holds and
		// records. A decision that adds none (token buckets and window counters charged now)
		// needs none, and saves its two allocations.
		args[1] = l.instance + "." + strconv.FormatUint(l.calls.Add(1), 36)
	}
	args[3] = len(reqs)
	for i := range reqs {
		r := &reqs[i] // a copy would escape to the heap through the algorithm's args
		cost := r.Cost
		switch {
		case r.Zone.Overrides:
			// The quota and max cost in force are the override's, known to decide.lua only: it
			// checks the cost itself (see zoneFlags). Above 2^54, a cost is beyond any quota.
			cost = min(cost, 2*MaxCapacity)
		case unsatisfiable(*r):
			cost = 2 * r.Zone.Quota() // <= 2^54
		}
		var quota, rate, costArg any
		if d := r.Zone.Algorithm.describe(); d.args != nil {
			quota, rate, costArg = d.args(r, ref, cost)
		} else { // Zone.Validate refused the algorithm; decide.lua refuses its tag ("?") with an error
			quota, rate, costArg = int64(0), "0", cost
		}
		args = append(args, r.tagArg(), quota, rate, costArg, r.flagsArg())
	}
	return args
}

// bucketCallArgs are a token bucket's numbers of decide.lua's call (algorithm.args): its
// capacity, its refill rate (tokens/s) and, with a max_wait, ",<max_wait µs>" after it, and its
// cost with the bound asked for (costArg).
func bucketCallArgs(r *Request, _ time.Time, cost int64) (quota, rate, costArg any) {
	capacity, rate := r.Zone.bucketArgs()
	if w := r.maxWait(); w > 0 {
		// go-redis formats a float64 argument so ('f', -1): the same number either way.
		rate = strconv.FormatFloat(r.Zone.RefillRate, 'f', -1, 64) + "," + strconv.FormatInt(w.Microseconds(), 10)
	}
	return capacity, rate, r.costArg(cost)
}

// windowCallArgs are a sliding window's (log or counter) numbers of decide.lua's call: its
// limit, its window (µs) and its cost.
func windowCallArgs(r *Request, _ time.Time, cost int64) (quota, rate, costArg any) {
	limit, window := r.Zone.windowArgs()
	return limit, window, cost
}

// fixedWindowCallArgs are a fixed window's numbers of decide.lua's call: its limit, the bounds
// of the windows around ref (windowBounds) and its cost with the bound asked for (costArg).
func fixedWindowCallArgs(r *Request, ref time.Time, cost int64) (quota, rate, costArg any) {
	limit, _ := r.Zone.windowArgs()
	return limit, windowBounds(r.Zone, ref), r.costArg(cost)
}

// slotCallArgs are a concurrency zone's numbers of decide.lua's call: its limit, "0" and its
// cost (one slot).
func slotCallArgs(r *Request, _ time.Time, cost int64) (quota, rate, costArg any) {
	limit, _ := r.Zone.windowArgs()
	return limit, "0", cost
}

// tagArg is decide.lua's algorithm argument for r's zone: its tag, or for an algorithm missing
// from the table "?", which decide.lua refuses.
func (r *Request) tagArg() any {
	if a := int(r.Zone.Algorithm); a > 0 && a < len(tagArgs) {
		return tagArgs[a]
	}
	return "?"
}

// flagsArg is decide.lua's flags argument for r before encodeDecision adds the flags that name
// keys (zoneFlags): "s" for a shadow zone, "u" for a zone with UpTo asked for a bound, else "".
func (r *Request) flagsArg() any {
	switch {
	case r.Zone.Shadow:
		return "s"
	case r.ask > 0 && r.Zone.UpTo:
		return "u"
	}
	return ""
}

// tagArgs are decide.lua's algorithm arguments, boxed once (a string boxed per call would be an
// allocation per zone of every decision): per algorithm, its tag.
var tagArgs = func() (t [len(algorithms)]any) {
	for a := range algorithms {
		t[a] = Algorithm(a).tag()
	}
	return t
}()

// flagKeys are the indexes, in its decision's KEYS (from 1; 0: none), of the keys a zone's
// flags name: its override key, its block key, its queue's waiters and its top's denied key
// (the used key and the two error keys follow it).
type flagKeys struct{ override, block, queue, top, control int }

// zoneFlags is decide.lua's flags argument of r's zone z, whose flags name the keys k: "s" for a
// shadow zone; "u" for a zone with UpTo whose request has a bound (SetUpTo); "o<key>:<max
// cost>" with Overrides, the max cost the zone's MaxCost (0: the quota in force); "b<block
// µs>,<block_max µs>:<key>" with a Block; "q<key>" for a queue the request would wait in
// (Queues); "t<key>:<entries>,<ttl ms>" with a Top, the denied key at index key, then the used
// key and their error keys; "n<ppm>" with a NearLimit (millionths of the quota); "a<key>" for an
// adaptive concurrency zone, its controller's hash (controlKey) at index key; "|<waiter id>"
// last for a request that claims a Waiter's reserved slot.
func zoneFlags(r *Request, k flagKeys) string {
	okey, bkey := k.override, k.block
	z := r.Zone
	var buf [48]byte // most flags fit: no allocation but the string's
	b := buf[:0]
	if z.Shadow {
		b = append(b, 's')
	}
	if z.UpTo && r.ask > 0 {
		b = append(b, 'u')
	}
	if okey > 0 {
		mc := z.MaxCost
		if z.Algorithm.HoldsSlots() {
			mc = 0
		}
		b = append(b, 'o')
		b = strconv.AppendInt(b, int64(okey), 10)
		b = append(b, ':')
		b = strconv.AppendInt(b, mc, 10)
	}
	if bkey > 0 {
		b = append(b, 'b')
		b = strconv.AppendInt(b, z.Block.Microseconds(), 10)
		b = append(b, ',')
		b = strconv.AppendInt(b, z.BlockMax.Microseconds(), 10)
		b = append(b, ':')
		b = strconv.AppendInt(b, int64(bkey), 10)
	}
	if k.queue > 0 {
		b = append(b, 'q')
		b = strconv.AppendInt(b, int64(k.queue), 10)
	}
	if k.top > 0 {
		b = append(b, 't')
		b = strconv.AppendInt(b, int64(k.top), 10)
		b = append(b, ':')
		b = strconv.AppendInt(b, int64(z.Top), 10)
		b = append(b, ',')
		b = strconv.AppendInt(b, 2*z.TopWindow.Milliseconds(), 10)
	}
	if z.NearLimit > 0 {
		b = append(b, 'n')
		b = strconv.AppendInt(b, nearPPM(z.NearLimit), 10)
	}
	if k.control > 0 {
		b = append(b, 'a')
		b = strconv.AppendInt(b, int64(k.control), 10)
	}
	if r.claim != "" {
		b = append(b, '|')
		b = append(b, r.claim...)
	}
	return string(b)
}

// argTag returns the algorithm tag of decide.lua's algorithm argument a: what settle.lua and
// refresh.lua are told of a zone.
func argTag(a any) string {
	s, _ := a.(string)
	return s
}

// hasFlag reports whether flags, decide.lua's flags argument of a zone, holds flag f: 'o'
// (overrides), 'b' (a block), 'q' (a queue), 'n' (a near limit) or 'a' (an adaptive concurrency
// zone's controller); a claim's waiter id, last,
// is not flags.
func hasFlag(flags any, f byte) bool {
	s, _ := flags.(string)
	s, _, _ = strings.Cut(s, "|")
	return strings.IndexByte(s, f) >= 0
}

// The block integer of a zone with a Block in decide.lua's reply: 0 when its block played no
// part, replyBlocked when a block in force refused the request (the zone's algorithm did not
// run), replyBlockStarted when the zone denied it and its block starts now.
const (
	replyBlocked      = 1
	replyBlockStarted = 2
)

// zoneReply is one zone's part of the script's reply.
type zoneReply struct {
	allowed bool
	// block is replyBlocked or replyBlockStarted when a zone's block refused the request or
	// starts now; 0 otherwise. A byte in allowed's padding.
	block uint8
	// near, of a zone with a NearLimit, is set when the zone admitted the request and its
	// charge crosses the near limit (charged only when the decision admits). In the padding too.
	near bool
	// granted is the tokens a grant took (a zone that asked one: Request.ask, so at most 2^31 −
	// 1), its cost included; an int32 in allowed's padding, so that a zoneReply is no larger.
	granted   int32
	remaining int64
	// retryAfter is, when allowed, the delay: how long to hold the request (0 but with MaxWait).
	retryAfter, reset, next int64 // µs
	// learnt, of an adaptive concurrency zone, is its controller as the decision read it.
	learnt Learnt
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
	if r.Zone.Block > 0 {
		w++
	}
	if r.Zone.Overrides {
		w += overrideWidth
	}
	if r.Zone.NearLimit > 0 {
		w++
	}
	if r.Zone.Algorithm.Adapts() {
		w += adaptiveWidth
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

// decodeReply checks and decodes the script's reply for reqs: an array of integers, the first 0
// or 1, then per zone: allowed (0 or 1), remaining, retry after (µs; when the zone admits the
// request, its delay), reset (µs) and next (µs); then the tokens granted for a zone that asked for
// a grant (at most what it asked); then the block integer (0, replyBlocked or replyBlockStarted)
// for a zone with a Block; then the quota, policy window (µs) and max cost in force for a zone
// with Overrides (overrideWidth); then the near integer (0 or 1) for a zone with a NearLimit; then
// for an adaptive concurrency zone the limit in force (1 to its Limit), the minimum latency and
// the last window's latency (µs, adaptiveWidth). None
// is negative, and no delay is longer than the zone may hold
// the request (maxWait: none without MaxWait). Any other shape, type or value is an error
// wrapping ErrBadResponse: a request is never held past its MaxWait, whatever Redis replies. The
// zones are decoded into into's array when it has room for them.
func decodeReply(arr []any, reqs []Request, into []zoneReply) (bool, []zoneReply, error) {
	n, want := len(reqs), 1
	for i := range reqs {
		want += reqs[i].width()
	}
	if len(arr) != want {
		return false, nil, fmt.Errorf("%w: got %d values, want %d", ErrBadResponse, len(arr), want)
	}
	first, err := replyInt(arr, 0, 1)
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
		r := &reqs[z]
		var v [replyWidth]int64 // the zone's first values
		for k := range replyWidth {
			most := int64(-1) // no bound
			if k == 0 {
				most = 1
			}
			if v[k], err = replyInt(arr, off+k, most); err != nil {
				return false, nil, err
			}
		}
		off += replyWidth
		zones[z] = zoneReply{allowed: v[0] == 1, remaining: v[1], retryAfter: v[2], reset: v[3], next: v[4]}
		if off, err = decodeOptions(arr, off, r, z, &zones[z]); err != nil {
			return false, nil, err
		}
		if zones[z].allowed && zones[z].retryAfter > r.maxWait().Microseconds() {
			return false, nil, fmt.Errorf("%w: zone %d admits with a delay of %dµs, beyond its max_wait of %v",
				ErrBadResponse, z, zones[z].retryAfter, r.maxWait())
		}
	}
	return first == 1, zones, nil
}

// decodeOptions decodes into zr the integers that zone z's options add to its reply at arr[off]
// (see decodeReply), and returns the offset after them.
func decodeOptions(arr []any, off int, r *Request, z int, zr *zoneReply) (int, error) {
	if r.ask > 0 {
		g, err := replyInt(arr, off, int64(r.ask))
		if err != nil {
			return 0, fmt.Errorf("zone %d's grant: %w", z, err)
		}
		zr.granted, off = int32(g), off+1
	}
	if r.Zone.Block > 0 {
		b, err := replyInt(arr, off, replyBlockStarted)
		if err != nil {
			return 0, fmt.Errorf("zone %d's block: %w", z, err)
		}
		zr.block, off = uint8(b), off+1
	}
	if r.Zone.Overrides {
		var err error
		if zr.ov, err = decodeOverride(arr, off, z); err != nil {
			return 0, err
		}
		off += overrideWidth
	}
	if r.Zone.NearLimit > 0 {
		c, err := replyInt(arr, off, 1)
		if err != nil {
			return 0, fmt.Errorf("zone %d's near limit: %w", z, err)
		}
		zr.near, off = c == 1, off+1
	}
	if r.Zone.Algorithm.Adapts() {
		var err error
		if zr.learnt, err = decodeLearnt(arr, off, r.Zone.Ceiling()); err != nil {
			return 0, fmt.Errorf("zone %d's learnt limit: %w", z, err)
		}
		off += adaptiveWidth
	}
	return off, nil
}

// decodeOverride decodes zone z's override integers (overrideWidth of them) at arr[off].
func decodeOverride(arr []any, off, z int) (overrideReply, error) {
	var o [overrideWidth]int64
	for k := range overrideWidth {
		var err error
		if o[k], err = replyInt(arr, off+k, -1); err != nil {
			return overrideReply{}, err
		}
	}
	ov := overrideReply{quota: o[0], windowUs: o[1], maxCost: o[2]}
	if ov.quota > 0 && (ov.quota > MaxCapacity || ov.maxCost > ov.quota || ov.maxCost < 1) {
		return overrideReply{}, fmt.Errorf("%w: zone %d's override quota %d and max cost %d are out of range", ErrBadResponse, z, ov.quota, ov.maxCost)
	}
	return ov, nil
}

// replyInt returns arr[i], which must be an integer >= 0, and at most most (-1: no bound).
func replyInt(arr []any, i int, most int64) (int64, error) {
	x, ok := arr[i].(int64)
	if !ok {
		return 0, fmt.Errorf("%w: value %d is %T, want an integer", ErrBadResponse, i, arr[i])
	}
	if x < 0 || (most >= 0 && x > most) {
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

// zones is the number of zones a decide.lua call of one decision decides.
func (c *call) zones() int { return argZones(c.args) }

// argZones is the number of zones of one decision whose decide.lua arguments are args (as
// encodeDecision returns them): zoneArgN each after now, nonce, hold and n.
func argZones(args []any) int { return (len(args) - 4) / zoneArgN }

// zoneArgsOf returns the first 4 decide.lua arguments of zone j of one decision whose arguments
// are args: algorithm tag, quota, rate and cost, as settle.lua takes them.
func zoneArgsOf(args []any, j int) []any {
	b := 4 + zoneArgN*j
	return args[b : b+4 : b+4]
}

// flagsOf returns the flags argument of zone j of one decision whose arguments are args.
func flagsOf(args []any, j int) any { return args[4+zoneArgN*j+4] }

// settleArgs returns settle.lua's ARGV for the decision of decide.lua arguments args: now, its
// nonce, mode, then each zone's algorithm tag, quota, rate and cost.
func settleArgs(args []any, now any, mode string) []any {
	n := argZones(args)
	out := make([]any, 0, 3+4*n)
	out = append(out, now, args[1], mode)
	for j := range n {
		out = append(out, zoneArgsOf(args, j)...)
	}
	return out
}

// replyLen is the length of the reply of a decide.lua call of one decision: 1 + replyWidth per
// zone, one more per zone that asked for a grant (its cost sent as the string "<cost>,<ask>":
// Request.ask), one more per zone with a block, overrideWidth more per zone with overrides and
// one more per zone with a near limit and adaptiveWidth more per adaptive concurrency zone (their
// flags: zoneFlags).
func (c *call) replyLen() int {
	n := 1 + replyWidth*c.zones()
	for j := range c.zones() {
		if _, ok := zoneArgsOf(c.args, j)[3].(string); ok {
			n++
		}
		f := flagsOf(c.args, j)
		if hasFlag(f, 'b') {
			n++
		}
		if hasFlag(f, 'o') {
			n += overrideWidth
		}
		if hasFlag(f, 'n') {
			n++
		}
		if hasFlag(f, 'a') {
			n += adaptiveWidth
		}
	}
	return n
}

// holdsInState reports whether the decide.lua call c decides a zone whose held charges are
// holds in its state key (a token bucket's).
func (c *call) holdsInState() bool {
	for j := range c.zones() {
		if algorithmOfTag(argTag(zoneArgsOf(c.args, j)[0])).holdsInState() {
			return true
		}
	}
	return false
}

// withoutHeld returns c (one slot's decide.lua call of a decision across slots, of the zones idx
// of reqs) without its zones that have a Hold: what the Redis Cluster two-phase decision commits
// at once (a token bucket's hold, a window counter's record).
func withoutHeld(c *call, reqs []Request, idx []int) *call {
	out := &call{args: append([]any{}, c.args[:4]...)}
	var records []string
	for j, i := range idx {
		if reqs[i].Hold > 0 {
			continue
		}
		out.keys = append(out.keys, c.keys[j])
		out.args = append(out.args, c.args[4+zoneArgN*j:4+zoneArgN*(j+1)]...)
		if recorded(reqs[i], true) {
			records = append(records, recordKey(c.keys[j], c.args[1].(string)), genKey(c.keys[j]))
		}
	}
	out.args[3] = len(out.keys)
	out.keys = append(out.keys, records...)
	return out
}
