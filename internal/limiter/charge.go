package limiter

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// holdMaxDefault is decide.lua's HOLD_MAX, as a hold time: how long a Redis Cluster hold waits
// for its commit or release.
const holdMaxDefault = 5_000_000 // µs

// holdArg is decide.lua's per-decision hold argument for reqs: "0" (every zone charged now) or
// "1" (every token bucket charge held for HOLD_MAX: the Redis Cluster two-phase decision, cluster)
// when no zone has a Hold of its own; else one number per zone, comma-separated: the µs its
// charge is held (its Hold; HOLD_MAX for the others when cluster; 0: charged now).
func holdArg(reqs []Request, cluster bool) string {
	own := false
	for _, r := range reqs {
		own = own || r.Hold > 0 || r.leases()
	}
	switch {
	case !own && cluster:
		return "1"
	case !own:
		return "0"
	}
	b := make([]byte, 0, 12*len(reqs))
	for i, r := range reqs {
		if i > 0 {
			b = append(b, ',')
		}
		us := int64(0)
		switch {
		case r.Hold > 0:
			us = max(r.Hold.Microseconds(), 1)
		case r.leases():
			us = leaseHold(r.Zone) // a grant: held until it is returned
		case cluster:
			us = holdMaxDefault
		}
		b = strconv.AppendInt(b, us, 10)
	}
	return string(b)
}

// recorded reports whether r's charge is recorded for its settlement in keys of its own
// (decide.lua): a fixed window or sliding window counter zone with a Hold, or in a Redis Cluster
// decision of zones in several hash slots (crossSlot), which releases what it charged when a slot
// denies, or a fixed window's lease grant (Request.ask), returned by settle.lua. A count has no
// holds: the record is what ties a settlement to its charge, so that it changes the count only
// while the charge is in it (see settle.lua).
func recorded(r Request, crossSlot bool) bool {
	return (r.Hold > 0 || crossSlot || r.leases()) && r.Zone.Algorithm.recorded()
}

// recordKey returns the Redis key in which the decision of nonce records the charge of a fixed
// window or sliding window counter zone whose state key is stateKey, until it is settled:
// `<state key>:<nonce>`, in the state key's hash slot.
func recordKey(stateKey, nonce string) string { return stateKey + ":" + nonce }

// genKey returns the Redis key of the generation of a window counter's count whose state key is
// stateKey: `<state key>:gen`, in its hash slot. A record holds the generation it was made in;
// Reset deletes the key with the state, so that a settlement after a reset finds its charge is
// no longer in the count (see decide.lua).
func genKey(stateKey string) string { return stateKey + ":gen" }

// Held is what a Decision's zones with a Hold need to be settled after the response, once, with
// Limiter.Settle (or given up with Limiter.Drop).
type Held struct {
	// parts are, per decide.lua call that took the holds (one, or one per hash slot on Redis
	// Cluster), its keys, nonce and zone arguments.
	parts []heldPart
	sent  time.Time // when the decision was sent, by the Limiter's clock
	// sample is the request's latency for its adaptive concurrency zones (Sample): "<µs>,<failed
	// 0|1>"; "" for none.
	sample string
}

// lateMargin is how much sooner than its Hold a settlement counts as late (its hold may have
// been committed): the decision's clock and Redis's may differ a little, and a settlement may
// wait in the batcher's queue.
const lateMargin = time.Second

// heldPart is one decide.lua call's held zones.
type heldPart struct {
	keys  []string // the zones' state keys, then their record keys and controllers' hashes, in zone order
	nonce any
	zones []any           // 4 per zone: algorithm, quota, rate, cost, as in force at the decision
	idx   []int           // per zone, its index in the requests given to Decide
	call  bool            // a zone needs a call even to keep its charge: a token bucket's hold, a record
	hold  []time.Duration // per zone, its Hold
	most  []int64         // per zone, the most it may be charged: its MaxCostOrQuota
	// queues, per zone, is the zone when it Queues (its freed slot goes to its next waiter),
	// else nil; nil when none does.
	queues []*Zone
}

// newHeld returns the Held of the zones with a Hold among those decided by one decide.lua call
// with keys and args that admitted its request, zones its reply (per zone of the call); idx maps
// the call's zones to the requests given to Decide (nil: the same). A shadow zone that would have
// denied the request was not charged, so it holds nothing to settle. A zone with Overrides is
// settled with the numbers that decided it (overrideReply.settleZone), and its charge bounded by
// the max cost in force. nil when no zone holds one.
func newHeld(reqs []Request, keys []string, args []any, idx []int, zones []zoneReply) *Held {
	var p heldPart
	for j := range argZones(args) {
		i := j
		if idx != nil {
			i = idx[j]
		}
		if reqs[i].Hold <= 0 || reqs[i].Zone.Shadow && !zones[j].allowed {
			continue
		}
		p.keys = append(p.keys, keys[j])
		za := zoneArgsOf(args, j)
		most := reqs[i].Zone.MaxCostOrQuota()
		switch {
		case reqs[i].ask > 0:
			za = grantZone(za, int64(zones[j].granted)) // its hold is the grant
		case reqs[i].Zone.Overrides:
			za = zones[j].ov.settleZone(za)
			if !reqs[i].Zone.Algorithm.HoldsSlots() {
				most = cmp.Or(zones[j].ov.maxCost, most)
			}
		}
		p.zones = append(p.zones, za...)
		p.idx = append(p.idx, i)
		p.hold = append(p.hold, reqs[i].Hold)
		p.most = append(p.most, most)
		p.call = p.call || algorithmOfTag(argTag(za[0])).keptByCall()
		if reqs[i].Zone.Queues() {
			p.queues = append(p.queues, make([]*Zone, len(p.idx)-1-len(p.queues))...)
			p.queues = append(p.queues, reqs[i].Zone)
		}
	}
	if len(p.keys) == 0 {
		return nil
	}
	nonce := args[1].(string)
	for j, i := range p.idx { // the held zones' records and controllers, in order
		if recorded(reqs[i], false) {
			p.keys = append(p.keys, recordKey(p.keys[j], nonce), genKey(p.keys[j]))
		}
		if reqs[i].Zone.Algorithm.Adapts() {
			p.keys = append(p.keys, controlKey(p.keys[j]))
		}
	}
	p.nonce = nonce
	return &Held{parts: []heldPart{p}}
}

// merge returns h with other's parts added; either may be nil.
func (h *Held) merge(other *Held) *Held {
	switch {
	case h == nil:
		return other
	case other == nil:
		return h
	}
	h.parts = append(h.parts, other.parts...)
	return h
}

// ErrNotHeld is returned by Settle, wrapped, for the zones whose hold (or record) it did not
// find: settled already, or counted as charged for being older than its Hold, or gone with its
// state (an admin reset, an expiry).
var ErrNotHeld = errors.New("no hold to settle")

// Settle settles the held zones of a Decision (d.Held) once the response is known: amounts[i]
// is what to charge the zone of the i-th Request given to Decide, clamped to [0, the zone's
// MaxCostOrQuota].
//   - A token bucket is charged amounts[i] in place of its reservation: 0 gives it all back;
//     more than was reserved may leave the bucket in debt (at most one capacity), which later
//     requests wait out.
//   - A fixed window or sliding window counter likewise, in the count of the window it was
//     charged in, while that window is the current one; after it, nothing: the zone is then
//     reported not settled, and that is no error.
//   - A sliding window keeps its entries when amounts[i] > 0 and gives them back when it is 0.
//   - A concurrency zone's slot is given back whatever amounts[i] says, and is no longer
//     refreshed (Refresh).
//
// It returns, per request index, whether the zone was settled now. A zone whose hold (or record)
// was not found (settled already, counted as charged for being older than its Hold, or gone with
// its state) is charged what its hold counted as, nothing more, nothing less, and err then wraps
// ErrNotHeld unless Redis failed; except a token bucket settled late (its Hold, less a second,
// has passed since the decision was sent): its hold may have been counted as its cost, so the
// difference (amounts[i] − cost) is applied to the bucket all the same, and it counts as
// settled. A second Settle in time finds no hold. A Settle is never retried: on a Redis error
// the hold counts as charged once its Hold has passed. A zone given back some of its charge
// forgets this Limiter's cached denials of its client (see Forget): they were decided without
// that capacity.
func (l *Limiter) Settle(ctx context.Context, h *Held, amounts []int64) ([]bool, error) {
	if h == nil {
		return nil, nil
	}
	l.untrack(h) // a concurrency slot is being given back: no more refreshes
	n := 0
	for _, p := range h.parts {
		for _, i := range p.idx {
			n = max(n, i+1)
		}
	}
	settled := make([]bool, n)
	var now any = "" // the Redis server clock
	if l.now != nil {
		now = l.now().UnixMicro()
	}
	elapsed := l.clock().Sub(h.sent)
	calls := make([]*call, 0, len(h.parts))
	parts := make([]heldPart, 0, len(h.parts))
	for _, p := range h.parts {
		release := false
		for j, i := range p.idx {
			release = release || amount(amounts, i, p.most[j]) == 0
		}
		if !p.call && !release {
			for _, i := range p.idx {
				settled[i] = true // a sliding window's entries are its charge already
			}
			continue
		}
		calls = append(calls, &call{keys: p.keys, args: p.amountArgs(now, amounts, elapsed, h.sample)})
		parts = append(parts, p)
	}
	// One settle.lua call (one per hash slot on Redis Cluster, all under way at once); none when
	// every zone is a sliding window keeping its charge.
	switch len(calls) {
	case 0:
		return settled, nil
	case 1:
		// On the decisions' Batcher when there is one: under load it shares their round trip.
		c := calls[0]
		if batch := l.batcherFor(ctx, c.keys[0]); batch != nil {
			c.reply, c.err = batch.runSettle(ctx, c.keys, c.args)
		} else {
			c.reply, c.err = runScript(ctx, l.rdb, settleScript, c.keys, c.args)
		}
	default:
		evalEach(ctx, l.rdb, settleScript, calls)
	}
	var errs []error
	var missing []string
	for k, c := range calls {
		p := parts[k]
		states, err := decodeSettled(c.reply, c.err, len(p.idx))
		if err != nil {
			errs = append(errs, err)
			l.loseHeld(parts[k : k+1]) // its slots: given back by Refresh
			continue
		}
		for j, i := range p.idx {
			switch states[j] {
			case settledNow:
				settled[i] = true
				if cost, _ := p.zones[4*j+3].(int64); amount(amounts, i, p.most[j]) < cost {
					l.forgetKey(p.keys[j]) // capacity given back: a cached denial is stale
				}
			case notHeld:
				missing = append(missing, p.keys[j])
			}
		}
		l.promoteFreed(ctx, p)
	}
	if len(errs) > 0 {
		return settled, errors.Join(errs...)
	}
	if len(missing) > 0 {
		return settled, fmt.Errorf("%w: %s", ErrNotHeld, strings.Join(missing, ", "))
	}
	return settled, nil
}

// amountArgs returns settle.lua's ARGV settling p with amounts (per request index, see Settle)
// elapsed after the decision was sent: now, its nonce, "amount", its zones' arguments (as in
// force at the decision), then each zone's amount, clamped to its most, "L" after it when the
// zone's Hold (less lateMargin) has passed, and for an adaptive concurrency zone given a sample
// (Held.Sample: "<latency µs>,<failed>"), ";<sample>,<elapsed µs>" last.
func (p *heldPart) amountArgs(now any, amounts []int64, elapsed time.Duration, sample string) []any {
	args := make([]any, 0, 3+len(p.zones)+len(p.idx))
	args = append(args, now, p.nonce, "amount")
	args = append(args, p.zones...)
	for j, i := range p.idx {
		a := amount(amounts, i, p.most[j])
		late := elapsed+lateMargin >= p.hold[j]
		adapts := sample != "" && algorithmOfTag(argTag(p.zones[4*j])).Adapts()
		if !late && !adapts {
			args = append(args, a)
			continue
		}
		s := strconv.FormatInt(a, 10)
		if late {
			s += "L"
		}
		if adapts {
			s += ";" + sample + "," + strconv.FormatInt(elapsed.Microseconds(), 10)
		}
		args = append(args, s)
	}
	return args
}

// amount is amounts[i] clamped to [0, most]; 0 past its end.
func amount(amounts []int64, i int, most int64) int64 {
	if i >= len(amounts) {
		return 0
	}
	return min(max(amounts[i], 0), most)
}

// What settle.lua did for a zone.
const (
	notHeld    = 0 // no hold, entries or record found: settled already, expired or reset
	settledNow = 1
	windowOver = 2 // its record was found, but the window it was charged in has ended
)

// decodeSettled checks and decodes settle.lua's reply for n zones: an array of n integers, each
// notHeld, settledNow or windowOver.
func decodeSettled(reply any, err error, n int) ([]int64, error) {
	if errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("%w: got a nil reply, want an array", ErrBadResponse)
	}
	if err != nil {
		return nil, fmt.Errorf("redis settle script: %w", err)
	}
	arr, ok := reply.([]any)
	if !ok || len(arr) != n {
		return nil, fmt.Errorf("%w: settle got %T of %d values, want %d", ErrBadResponse, reply, len(arr), n)
	}
	out := make([]int64, n)
	for i, v := range arr {
		x, ok := v.(int64)
		if !ok || x < notHeld || x > windowOver {
			return nil, fmt.Errorf("%w: settle value %d is %v, want 0, 1 or 2", ErrBadResponse, i, v)
		}
		out[i] = x
	}
	return out, nil
}
