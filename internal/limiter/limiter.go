package limiter

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrBadResponse is wrapped by the error of a call (Decide, Settle, State, Refresh) whose reply
// from Redis has the wrong shape or type; errors.Is(err, ErrBadResponse) tells it from a Redis or
// network error.
var ErrBadResponse = errors.New("bad response from redis")

// ErrMigrating is wrapped by the error of a script call that Redis Cluster refused with TRYAGAIN
// (its keys split between two nodes by a slot migration: a multi-key call cannot run until the
// migration has moved them all) and that failed before it ran: its deadline ended while it was
// sent again, or it was refused every time it was sent. The node answered: the failure is its
// hash slot's, not the node's.
var ErrMigrating = errors.New("redis cluster slot migrating (TRYAGAIN)")

// Client is what a Limiter needs of a go-redis client: single commands (a script call),
// pipelines, and the plain commands of State and Reset. *redis.Client (standalone, or
// Sentinel's failover client), *redis.ClusterClient and redis.UniversalClient have it.
type Client interface {
	Processor
	Pipeliner
	Commander
}

var (
	_ Client = (*redis.Client)(nil)
	_ Client = (*redis.ClusterClient)(nil)
	_ Client = (redis.UniversalClient)(nil)
)

// Request is one zone's part of a request's decision. Its fields are ordered so that NoWait and
// ask share one word of padding; keep them so.
type Request struct {
	// Zone is the zone's parameters; Zone.Validate must have returned nil.
	Zone *Zone
	// Key is the resolved client key, as the client sent it: the Limiter sanitises it (see
	// ClientKey).
	Key string
	// Cost is the tokens (token bucket) or slots (sliding window) the request takes; >= 1. A cost
	// above the zone's MaxCost can never be admitted (Decision.Unsatisfiable).
	Cost int64
	// Result is this zone's own outcome, written by the decision that reads the request (Decide,
	// Local.Allow): the caller's slice element is filled in, so that every zone's figures (the
	// IETF RateLimit fields list them all) cost no allocation. Known is false for a zone whose
	// outcome that decision does not know: a zone of a Redis Cluster slot that failed, or one no
	// cached denial covers when the deny cache answers.
	Result Result
	// NoWait decides the request as if its zone had no MaxWait: admitted now or denied, never
	// held. The handler sets it when it already holds as many requests as it may. A denial
	// decided so is not remembered in the deny cache: with room to wait, the answer may differ.
	NoWait bool
	// ask, when > 0, asks decide.lua for a grant of about that many tokens for a lease zone's
	// hot client (allowLeased), or of up to that many for a zone with UpTo (SetUpTo).
	ask int32
	// Hold, when > 0, makes the zone's charge a hold that Limiter.Settle settles after the
	// response (Decision.Held); a hold not settled within Hold counts as charged. 0 charges now.
	// A concurrency zone needs it as its slot's hold time (see Refresh); Decide fails without it.
	Hold time.Duration
	// Tag is the caller's, carried with the request and never read by the Limiter: the handler's
	// index of the request's zone.
	Tag int
	// Class is the request's priority class in a zone that Queues (0 the highest; one beyond
	// the zone's Classes is its last): the order in which waiters get freed slots.
	Class int
	// Tenant is the request's tenant in a zone with FairTenants, as the client sent it (the
	// Limiter sanitises it, as Key): its waiters take turns with other tenants' in the queue.
	Tenant string
	// claim is the id of a Waiter whose reserved slot the request takes (Claim); "" for none.
	claim string
}

// SetUpTo gives r, whose zone has UpTo, an upper bound of its charge: units (at most 2^31 − 1).
// The zone then charges all it holds, at least r.Cost and at most units (Result.Granted). A
// bound at or below r.Cost, or a zone without UpTo, changes nothing.
func (r *Request) SetUpTo(units int64) {
	if r.Zone.UpTo && units > r.Cost {
		r.ask = int32(min(units, math.MaxInt32))
	}
}

// maxWait is how long r may be held: its zone's MaxWait (a token bucket without a queue
// only), unless NoWait.
func (r Request) maxWait() time.Duration {
	if r.NoWait || !r.Zone.Algorithm.shapes() || r.Zone.Queues() {
		return 0 // a zone with a queue holds no request: its waiters wait in the queue
	}
	return r.Zone.MaxWait
}

// Result is one zone's outcome in a request's decision.
type Result struct {
	// Known is true when the decision knows this zone's outcome; the other fields are then set.
	Known bool
	// Allowed is true when this zone alone would admit the request.
	Allowed bool
	// Blocked is true when the zone's block (Zone.Block) refused the request: the client was in
	// the zone's penalty box already, and the zone's algorithm did not run. Remaining is then 0,
	// and Next and Reset the block's remaining time.
	Blocked bool
	// BlockStarted is true when this request's denial by the zone started the zone's block
	// (Zone.Block, doubled for a repeat offender up to Zone.BlockMax): Remaining is then 0, and
	// Next the block's length (Reset at least that). Beside Known and Allowed, so that a Result
	// (in every Request) is no larger for the blocks.
	BlockStarted bool
	// NearLimit is true when the zone has a NearLimit and this request, admitted, took the
	// client from below it to at or past it: one request per crossing, whichever instance
	// decided it.
	NearLimit bool
	// Granted is the units a zone with UpTo charged a request given a bound (Request.SetUpTo),
	// when it admitted it: its Cost to its bound; 0 otherwise.
	Granted int32
	// Remaining is the zone's whole tokens or window slots left: after this request when the
	// request was admitted, else as they are (a denied request charged no zone).
	Remaining int64
	// Next is how long until the zone has at least one more whole token or window slot than
	// Remaining; 0 when it is full. A concurrency zone cannot tell (a slot comes back when a
	// request ends): 1µs while any of the client's slots is taken, 0 when none is; Reset alike.
	Next time.Duration
	// Reset is how long until the zone is back to its full quota. For a zone that would have
	// admitted a request that another zone denied, and is not full, it is an upper bound: the
	// time as if the zone had been charged.
	Reset time.Duration
	// Learnt, of an adaptive concurrency zone, is its controller as the decision read it: the
	// limit in force (also the Zone's Limit in the Request) and the latencies it learnt from.
	Learnt Learnt
}

// Decision is the outcome of one request across its zones.
type Decision struct {
	// Allowed is true when every zone admitted the request; each zone was then charged. When
	// false, no zone was charged.
	Allowed bool
	// Blocked is true when the deciding zone's block refused the request (Result.Blocked): the
	// client was in its penalty box already; RetryAfter is the block's remaining time.
	Blocked bool
	// Delay, when Allowed, is how long the caller must hold the request before it proceeds: the
	// longest of its zones' delays. A token bucket zone with MaxWait admits a request it cannot
	// serve now by reserving its tokens (debt), and delays it until the bucket would have held
	// them. 0 without MaxWait, and when every zone admitted the request now.
	Delay time.Duration
	// Zone is the index in the requests passed to Decide of the deciding zone: when denied, the
	// denying zone that takes longest to admit; when allowed, the zone with the longest delay,
	// else the zone with the least remaining share of its quota (the first of equals).
	Zone int
	// Limit is the deciding zone's quota: capacity (tokens) or limit (requests per window).
	Limit int64
	// Remaining is the deciding zone's whole tokens or window slots left, after this request when
	// it was allowed.
	Remaining int64
	// RetryAfter is how long until the deciding zone would admit the request when denied (with
	// MaxWait: admit it and hold it for up to MaxWait then): 0 when allowed, and 0 when
	// Unsatisfiable.
	RetryAfter time.Duration
	// Reset is how long until the deciding zone is back to its full quota (its debt paid, when a
	// MaxWait let it owe tokens).
	Reset time.Duration
	// Next is how long until the deciding zone has at least one more whole token or window slot
	// than Remaining: the `t` of the IETF RateLimit header. 0 when the zone is full.
	Next time.Duration
	// Unsatisfiable is true when the request's cost exceeds the deciding zone's quota: it is
	// denied and waiting can never cure it.
	Unsatisfiable bool
	// Cached is true when the denial came from the deny cache, with no Redis call.
	Cached bool
	// Err is the error of a Redis Cluster hash slot that failed while the decision stands: on a
	// denial, another slot denied the request; on any decision, the slot held shadow zones only,
	// which are left out (their Results not Known). Decide returns no error then, and Err is
	// there to be counted and logged.
	Err error
	// Held, when the request was allowed and a zone's Request had a Hold, is what Settle needs
	// to settle those zones; nil otherwise.
	Held *Held
}

// Options configure a Limiter.
type Options struct {
	// KeyPrefix is prepended to every Redis key. It must not contain '{' or '}'.
	KeyPrefix string
	// Now, when set, is the clock the scripts use (`clock local`); when nil they read the Redis
	// server's TIME, so that instances with skewed clocks agree. The Go side uses it too, unless
	// Clock is set.
	Now func() time.Time
	// Clock, when set, is the Go side's clock: the deny cache's ages, lease grants, holds and
	// lost slots. It changes nothing the scripts compute. Default: Now, else time.Now.
	Clock func() time.Time
	// DenyCacheKeys, when > 0, enables the deny cache: the recent denials of up to that many
	// (zone, client) pairs are remembered (up to 4 costs or sets of numbers per pair), and Decide
	// denies the requests they cover again, with no Redis call, while they can give Redis's
	// answer, for at most DenyCacheMaxAge.
	DenyCacheKeys int
	// DenyCacheMaxAge bounds how long a remembered denial is trusted after its call was sent:
	// how long a reset, a raised limit or a Cluster release that reaches no instance's cache can
	// leave a client denied. Default (when <= 0): DefaultDenyCacheMaxAge.
	DenyCacheMaxAge time.Duration
	// Gate, when set, guards each decision Decide sends to Redis (the handler's circuit
	// breakers): it is asked first, with the decision's requests. Its error is Decide's, and
	// Redis is not called; otherwise Decide calls release once with the call's outcome: nil, or
	// the call's error.
	Gate func(ctx context.Context, reqs []Request) (release func(error), err error)
	// Timeout, when > 0, bounds each decision Decide sends to Redis, from when it asks Gate: the
	// decision then fails with context.DeadlineExceeded (ctx's own deadline applies when it is
	// earlier). 0: ctx alone bounds it.
	Timeout time.Duration
	// ObserveCall, when set, is given how long each decision Decide sent to Redis took, from
	// asking Gate to the reply, answered or not.
	ObserveCall func(time.Duration)
	// Batcher, when set, carries the decisions to Redis (concurrent ones share round trips and
	// script calls) instead of one round trip each through the client given to New. It must send
	// to the same Redis.
	Batcher *Batcher
	// Cluster is true when the client is a Redis Cluster client: the zones of a request whose
	// keys fall in different hash slots (different client keys) are then decided by one script
	// call per slot, and the slots that admitted are released when another denied (see
	// Decide).
	Cluster bool
	// Leases enables the leases of the zones that have one (Zone.Lease): without it they are
	// decided exactly. LeaseMetrics, when set, receives their events.
	Leases       bool
	LeaseMetrics LeaseMetrics
	// CallTimeout bounds the calls a Limiter makes on its own rather than for a request: a lease
	// grant's successor asked ahead, the return of ended grants, and the Redis Cluster release
	// that follows a decision one of whose hash slots failed. They share round trips with
	// decisions, whose replies wait for the latest deadline of their batch, so it should be no
	// longer than Timeout. 0: 100ms.
	CallTimeout time.Duration
	// Subscriber, when set (the client given to New, as a Subscriber), hears the grants of the
	// queues this Limiter's requests wait in (Enqueue) as soon as they are made. nil: a waiter
	// learns of its grant from RefreshQueues, up to QueueRefreshEvery later.
	Subscriber Subscriber
	// BatcherFor, when set, chooses the Batcher of each decision whose keys are all in one
	// hash slot, by its first key; a nil result means Batcher. On Redis Cluster it gives each
	// node a batcher of its own, so that a stalled node holds up only its own decisions (a
	// go-redis cluster pipeline waits for every node it sends to).
	BatcherFor func(ctx context.Context, key string) *Batcher
}

// defaultCallTimeout is Options.CallTimeout's default: the handler's default decision timeout.
const defaultCallTimeout = 100 * time.Millisecond

// Limiter runs decisions on a Redis server, or on a Redis Cluster. It is safe for concurrent use.
type Limiter struct {
	rdb      Client
	prefix   string
	cluster  bool
	now      func() time.Time              // Options.Now: the scripts' clock when set
	goClock  func() time.Time              // Options.Clock, else Options.Now
	denials  *denyCache                    // nil: no deny cache
	batch    *Batcher                      // nil: a round trip per decision
	instance string                        // random per Limiter, so sliding window members of instances differ
	calls    atomic.Uint64                 // per-call part of the nonce
	resets   atomic.Pointer[ResetListener] // set by ResetListener.Add
	leases   *leaseTable                   // nil: Options.Leases off
	callTime time.Duration                 // Options.CallTimeout
	live     liveSlots                     // the concurrency slots in flight, kept alive by Refresh
	lost     lostSlots                     // concurrency slots of failed decisions and settlements, given back by Refresh
	waiters  waitersOf                     // the requests waiting in queues (queue.go)
	sub      Subscriber                    // Options.Subscriber

	gate     func(ctx context.Context, reqs []Request) (func(error), error) // Options.Gate
	timeout  time.Duration                                                  // Options.Timeout
	observe  func(time.Duration)                                            // Options.ObserveCall
	batchFor func(ctx context.Context, key string) *Batcher                 // Options.BatcherFor
}

// New returns a Limiter running its scripts through rdb.
func New(rdb Client, opts Options) *Limiter {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never returns an error
	l := &Limiter{rdb: rdb, prefix: opts.KeyPrefix, cluster: opts.Cluster, now: opts.Now, goClock: opts.Clock, instance: hex.EncodeToString(b[:]),
		callTime: cmp.Or(opts.CallTimeout, defaultCallTimeout)}
	if l.goClock == nil {
		l.goClock = opts.Now
	}
	if opts.DenyCacheKeys > 0 {
		l.denials = newDenyCache(opts.DenyCacheKeys, opts.DenyCacheMaxAge)
	}
	l.gate, l.timeout, l.observe = opts.Gate, opts.Timeout, opts.ObserveCall
	l.batch, l.batchFor, l.sub = opts.Batcher, opts.BatcherFor, opts.Subscriber
	if opts.Leases {
		l.leases = newLeaseTable(opts.LeaseMetrics)
	}
	return l
}

// clock is the Go side's time (Options.Clock).
func (l *Limiter) clock() time.Time {
	if l.goClock != nil {
		return l.goClock()
	}
	return time.Now()
}

// Decide decides a request against the zones of reqs: it is admitted iff every zone admits it,
// and then every zone is charged its cost; otherwise no zone is charged. Each zone's own outcome
// is written into its reqs[i].Result. The first of these that applies decides:
//   - this instance's lease grants (Zone.Lease, Options.Leases), when they hold the cost of
//     every zone of the request: admitted, with no Redis call (Redis charged the grants);
//   - the deny cache (Options.DenyCacheKeys), when a remembered denial covers the request:
//     denied again with Redis's figures less the time elapsed (Decision.Cached), with no Redis
//     call; the zones it does not cover have no Result (Known false);
//   - Options.Gate, when it refuses: its error;
//   - Redis, with one script call (one per hash slot on Redis Cluster) bounded by
//     Options.Timeout; a denial is remembered in the deny cache.
//
// Grants and remembered denials answer whatever Redis's state, with no Gate to ask: they answer
// while Redis is unavailable. With no requests Decide returns an allowed Decision with Zone -1
// and no Redis call. A concurrency zone's Request needs a Hold.
//
// On Redis Cluster (Options.Cluster), zones whose keys fall in different hash slots are decided
// by one script call per slot, their charges held until every slot has answered: other requests
// may be denied by a slot's hold for a round trip before its release, never admitted too much.
// A slot's denial stands against another slot's error (Decision.Err).
//
// The error is Gate's, or wraps the Redis or network error (context.DeadlineExceeded when ctx
// or Timeout expires first), or ErrBadResponse when the reply has the wrong shape. The Decision
// is then the zero value.
func (l *Limiter) Decide(ctx context.Context, reqs []Request) (Decision, error) {
	if len(reqs) == 0 {
		return Decision{Allowed: true, Zone: -1}, nil
	}
	// Tokens granted to this instance ahead are charged in Redis already: spent with no call.
	if d, ok := l.leased(reqs, true); ok {
		return d, nil
	}
	// A remembered denial is Redis's own answer, for as long as it stays so: no call.
	if d, ok := l.denied(reqs); ok {
		return d, nil
	}
	start := time.Now()
	if l.timeout > 0 {
		// A deadline with no timer of its own: the round trip's socket deadlines bound the call
		// (see withDeadline).
		ctx = withDeadline(ctx, start.Add(l.timeout))
	}
	if l.gate == nil {
		d, err := l.allow(ctx, reqs)
		l.observeCall(start)
		return d, err
	}
	release, err := l.gate(ctx, reqs)
	if err != nil {
		return Decision{}, err
	}
	defer func() {
		if p := recover(); p != nil {
			release(fmt.Errorf("rate limit decision panicked: %v", p))
			panic(p)
		}
	}()
	d, err := l.allow(ctx, reqs)
	l.observeCall(start)
	release(err)
	return d, err
}

// observeCall gives ObserveCall how long since start a decision's Redis call took.
func (l *Limiter) observeCall(start time.Time) {
	if l.observe != nil {
		l.observe(time.Since(start))
	}
}

// denied returns the deny cache's Decision (Cached true) when a remembered denial covers the
// request, with no Redis call; false when there is none or the deny cache is off.
func (l *Limiter) denied(reqs []Request) (Decision, bool) {
	if l.denials == nil {
		return Decision{}, false
	}
	return l.denials.check(reqs, l.clock())
}

// allow decides reqs in Redis (Decide's last stage): with one script call, or, on Redis Cluster
// across hash slots, with one per slot (allowSlots: each slot's token bucket charges taken as
// holds and its window counter charges recorded, then settle.lua commits them all, or releases
// the slots that admitted when one denied or failed; a settle that fails leaves the hold, which
// counts as a charge after 5s, and the decision stands). A denial is remembered in the deny cache,
// its clock starting when the call was sent. A request with a lease zone goes to allowLeased:
// its zones with a grant in hand are charged from it, the others decided in Redis.
func (l *Limiter) allow(ctx context.Context, reqs []Request) (Decision, error) {
	if len(reqs) == 0 {
		return Decision{Allowed: true, Zone: -1}, nil
	}
	for i := range reqs {
		if reqs[i].Zone.Algorithm.HoldsSlots() && reqs[i].Hold <= 0 {
			return Decision{}, errNoHold
		}
	}
	if l.leases != nil && leasing(reqs) {
		d, err := l.allowLeased(ctx, reqs)
		if err == nil && !d.Allowed {
			// Redis had no room because grants hold it: one may have reached this instance while
			// the request was on its way (a burst sends many before the first grant is back).
			// Its units are charged in Redis already: spending them here is exact, and leaves
			// fewer stranded when the burst ends. It counts once in its client's observed rate:
			// allowLeased's plan counted it.
			if ld, ok := l.leased(reqs, false); ok {
				return ld, nil
			}
		}
		return d, err
	}
	return l.allowExact(ctx, reqs, l.clock(), nil)
}

// allowExact decides reqs in Redis with no lease grant, its call sent at sent; keys are their
// state keys (nil: computed here).
func (l *Limiter) allowExact(ctx context.Context, reqs []Request, sent time.Time, keys []string) (Decision, error) {
	if keys == nil {
		keys = stateKeys(l.prefix, reqs)
	}
	var allowed bool
	var zones []zoneReply
	var held *Held
	var err, slotErr error
	if groups := l.slotGroups(keys); groups != nil {
		allowed, zones, held, slotErr, err = l.allowSlots(ctx, reqs, keys, groups, sent)
	} else {
		ckeys, args := l.encodeDecision(reqs, keys, false, sent)
		var into [2]zoneReply // on the stack: the zones of most decisions
		allowed, zones, err = l.allowOne(ctx, reqs, ckeys, args, into[:0])
		if allowed {
			held = newHeld(reqs, ckeys, args, nil, zones)
		} else if err != nil {
			l.lose(reqs, ckeys, args) // its slot may have been taken: given back by Refresh
		}
	}
	if err != nil {
		return Decision{}, err
	}
	if !allowed {
		l.remember(reqs, zones, sent)
	}
	if held != nil {
		held.sent = sent
		l.track(held, sent)
	}
	d := pick(reqs, allowed, zones)
	d.Err, d.Held = slotErr, held
	return d, nil
}

// stateKeys returns the state key of each of reqs.
func stateKeys(prefix string, reqs []Request) []string {
	keys := make([]string, len(reqs))
	for i, r := range reqs {
		keys[i] = StateKey(prefix, r.Zone, r.Key)
	}
	return keys
}

// remember records in the deny cache, when it is on, the denial of reqs (zones from the reply
// to the call sent at sent).
func (l *Limiter) remember(reqs []Request, zones []zoneReply, sent time.Time) {
	if l.denials == nil {
		return
	}
	l.denials.record(reqs, zones, sent)
	if rl := l.resets.Load(); rl != nil {
		rl.listen() // a cached denial to forget on a reset: from now on, listen
	}
}

// allowOne decides reqs, whose keys are all in one hash slot or on one server, with one call of
// the decide script.
func (l *Limiter) allowOne(ctx context.Context, reqs []Request, keys []string, args []any, into []zoneReply) (bool, []zoneReply, error) {
	batch := l.batcherFor(ctx, keys[0])
	if batch == nil {
		reply, err := l.run(ctx, keys, args)
		return decodeResult(reply, err, reqs)
	}
	arr, err := batch.run(ctx, keys, args)
	if err != nil {
		return decodeResult(nil, err, reqs)
	}
	return decodeReply(arr, reqs, into)
}

// run is one round trip of the decide script: runScript.
func (l *Limiter) run(ctx context.Context, keys []string, args []any) (any, error) {
	return runScript(ctx, l.rdb, decideScript, keys, args)
}

// windowBounds is decide.lua's argument for a fixed window zone at ref (the instance's clock):
// "b0,b1,b2,b3", µs since the Unix epoch, where [b1, b2) is the window that holds ref and the
// others the windows before and after it. The script takes the one of the three that holds its
// own now (the Redis server's clock by default), so a clock skew of less than a window between
// the instance and Redis never puts a request in the wrong window.
func windowBounds(z *Zone, ref time.Time) string {
	start, end := z.windowAt(ref)
	prev, _ := z.windowAt(start.Add(-time.Microsecond))
	_, next := z.windowAt(end)
	b := make([]byte, 0, 68)
	for i, t := range [4]time.Time{prev, start, end, next} {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, t.UnixMicro(), 10)
	}
	return string(b)
}

// pick makes the Decision from each zone's outcome, choosing the deciding zone (decidingZone),
// and writes each zone's own outcome into reqs[i].Result (zoneResults).
func pick(reqs []Request, allowed bool, zones []zoneReply) Decision {
	applyOverrides(reqs, zones)
	applyLearnt(reqs, zones)
	best := decidingZone(reqs, allowed, zones)
	zoneResults(reqs, allowed, zones)
	z := zones[best]
	d := Decision{
		Allowed:   allowed,
		Blocked:   z.block == replyBlocked,
		Zone:      best,
		Limit:     reqs[best].Zone.Quota(),
		Remaining: z.remaining,
		Reset:     time.Duration(z.reset) * time.Microsecond,
		Next:      time.Duration(z.next) * time.Microsecond,
	}
	if allowed {
		d.Delay = time.Duration(z.retryAfter) * time.Microsecond
	} else if unsatisfiable(reqs[best]) {
		d.Unsatisfiable = true
	} else {
		d.RetryAfter = time.Duration(z.retryAfter) * time.Microsecond
	}
	return d
}

// decidingZone returns the index of the deciding zone: when denied, an unsatisfiable zone, else
// the denying zone that takes longest to admit; when allowed, the zone with the longest delay,
// else the one with the least remaining share of its quota (the first of equals).
//
// A shadow zone decides only a request of shadow zones alone (the first of them): its figures
// are never a response's while another zone applies.
func decidingZone(reqs []Request, allowed bool, zones []zoneReply) int {
	best := 0
	for best < len(reqs)-1 && reqs[best].Zone.Shadow {
		best++
	}
	if reqs[best].Zone.Shadow {
		best = 0
	}
	for i := best + 1; i < len(zones); i++ {
		if reqs[i].Zone.Shadow {
			continue
		}
		z, b := zones[i], zones[best]
		if allowed {
			if z.retryAfter != b.retryAfter { // the longest delay
				if z.retryAfter > b.retryAfter {
					best = i
				}
				continue
			}
			// The least remaining share: z.remaining/quota_i < b.remaining/quota_best.
			if float64(z.remaining)*float64(reqs[best].Zone.Quota()) < float64(b.remaining)*float64(reqs[i].Zone.Quota()) {
				best = i
			}
			continue
		}
		// Denied: prefer a denying zone, an unsatisfiable one first, then the longest wait.
		if b.allowed != z.allowed {
			if !z.allowed {
				best = i
			}
			continue
		}
		zu, bu := unsatisfiable(reqs[i]), unsatisfiable(reqs[best])
		if zu != bu {
			if zu {
				best = i
			}
			continue
		}
		if z.retryAfter > b.retryAfter {
			best = i
		}
	}
	return best
}

// zoneResults writes each zone's own outcome into reqs[i].Result.
func zoneResults(reqs []Request, allowed bool, zones []zoneReply) {
	for i, z := range zones {
		// A zone of a Redis Cluster slot that failed has no reply: the zero zoneReply, which no
		// reply is (an admitting zone has allowed set, a denying one a retry after > 0).
		if z == (zoneReply{}) {
			reqs[i].Result = Result{}
			continue
		}
		res := Result{
			Known: true, Allowed: z.allowed, Remaining: z.remaining,
			Next: time.Duration(z.next) * time.Microsecond, Reset: time.Duration(z.reset) * time.Microsecond,
			Blocked: z.block == replyBlocked, BlockStarted: z.block == replyBlockStarted,
			NearLimit: z.near && z.allowed && allowed, Learnt: z.learnt,
		}
		if reqs[i].Zone.UpTo && z.allowed && allowed {
			res.Granted = z.granted
		}
		if z.allowed && !allowed {
			// The reply gives the figures after the request, as if this zone had been charged;
			// it was not. Whole units are the cost more, the next unit as far (the same
			// fraction of a token, the same oldest entry), unless that makes the zone full.
			quota := reqs[i].Zone.Quota()
			res.Remaining = min(res.Remaining+max(reqs[i].Cost, int64(z.granted)), quota)
			if res.Remaining >= quota {
				res.Next, res.Reset = 0, 0
			}
		}
		reqs[i].Result = res
	}
}

// unsatisfiable reports whether r's cost is above its zone's MaxCost: it can never be admitted.
func unsatisfiable(r Request) bool { return r.Cost > r.Zone.MaxCostOrQuota() }
