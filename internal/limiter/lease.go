package limiter

import (
	"context"
	"hash/maphash"
	"math"
	"strconv"
	"sync"
	"time"
)

// Lease is a token bucket or fixed window zone's leasing: its hot clients' tokens (window slots)
// are taken from Redis in grants of at most Max before they are spent, and spent in process
// until the grant is spent or TTL has passed (a fixed window's, at the latest when its window
// ends); then what was spent is charged and the rest given back. Redis has charged every unit
// an instance admits before it admits it, so leasing never admits more than the exact decision
// would; what it costs is capacity stranded in other instances' grants: see docs/decisions.md
// ("Leases").
type Lease struct {
	// Max is the most tokens one grant takes (>= 1).
	Max int64
	// TTL is a grant's lifetime (MinLeaseTTL to MaxLeaseTTL): its unused tokens go back to
	// Redis when it ends, and an instance that never returns them (it crashed) has them counted
	// as spent TTL + leaseReturnMargin after the grant.
	TTL time.Duration
}

// Bounds of a Lease.
const (
	MinLeaseTTL = 10 * time.Millisecond
	MaxLeaseTTL = time.Minute
)

const (
	// leaseKeys bounds the (zone, client) pairs holding a grant at once per Limiter: beyond it,
	// requests are decided exactly, as without a lease.
	leaseKeys = 16384
	// rateSlots is the size of the table that observes each client's request rate (rateSlot):
	// clients hashed to one slot share it, the last one seen taking it over.
	rateSlots = 8192
	// leaseReturnMargin is how much longer than its TTL a grant's hold lives in Redis, so that
	// its return (a sweep away, one round trip) finds it: a return that comes later finds the
	// hold committed as wholly spent, which strands its unused tokens until they refill.
	leaseReturnMargin = time.Second
	// leaseSweep is how often ended grants are collected and returned.
	leaseSweep = 25 * time.Millisecond
	// leaseHeadroom is how much more than its observed rate × TTL a client is granted.
	leaseHeadroom = 1.25
	// leaseLow is the share of a grant (of its units, or of its TTL unless its window ends it
	// first) left when its successor is asked for (renew): a quarter.
	leaseLow = 4
)

// LeaseMetrics receives a Limiter's lease events (Options.LeaseMetrics), by zone name. Its
// methods must be safe for concurrent use, quick, and must not call the Limiter: most are called
// with its grant table locked.
type LeaseMetrics interface {
	// Granted is one grant of units tokens.
	Granted(zone string, units int64)
	// Local is one zone's admission decided in process, from a grant.
	Local(zone string)
	// Returned is units unspent tokens given back to Redis by a grant's settlement.
	Returned(zone string, units int64)
	// Stranded adds delta to the tokens granted to this instance and not yet spent.
	Stranded(zone string, delta int64)
}

// grant is the tokens one decide.lua call leased to this instance for one zone and client: a
// charge whose size the script chose, a token bucket's hold or a fixed window's count with a
// record (see decide.lua), which settle.lua "amount" settles when the grant is returned.
type grant struct {
	name      string        // the zone's
	keys      []string      // settle.lua's: the zone's state key (a fixed window's record and generation keys after it)
	nonce     string        // the hold's: "h:<nonce>"
	zone      []any         // settle.lua's zone arguments: algorithm, quota, rate or bounds, units
	n         zoneNumbers   // the zone's numbers: a request under others is not served from it
	units     int64         // granted
	spent     int64         // spent locally, the grant request's own cost included
	expires   time.Time     // by the Limiter's clock; a fixed window's: at the latest its window's end
	end       time.Time     // a fixed window's end, by the Limiter's clock; zero for a token bucket
	remaining int64         // Redis's whole tokens left once it had granted units
	ended     bool          // no longer spent from: returned, or to be
	pending   int           // costs spent for requests whose other zones Redis has not answered yet
	returned  bool          // taken to be returned: spent is final
	noRenew   bool          // its successor was denied, or failed: not asked again (renew)
	done      chan struct{} // closed once returned: a grant whose answer came while a reset of its client was under way (asking)
}

// left is what the client has, by this grant's estimate: Redis's remaining at grant time, less
// what this instance spent of it since.
func (g *grant) left(quota int64) int64 { return min(quota, max(0, g.remaining+g.units-g.spent)) }

// rateSlot counts a client's units over consecutive TTL-long periods, so that a grant can be
// sized to the rate observed on this instance.
type rateSlot struct {
	h         uint64 // the client's hash; another's takes the slot over from zero
	start     int64  // the current period's start, ns by the Limiter's clock
	prev, cur int64  // units of the previous and the current period
}

// asking is a grant asked for a client and not answered yet.
type asking struct {
	// dropped is set by a reset of the client meanwhile (drop): whether Redis made the grant
	// before the reset deleted its hold or after, it is returned, not kept.
	dropped bool
	done    chan struct{} // closed once the answer is kept, or returned when dropped
}

// markAsking marks k as asking for a grant. t.mu is held.
func (t *leaseTable) markAsking(k zoneClient) { t.asking[k] = &asking{done: make(chan struct{})} }

// answered takes k's mark of asking off and returns it (nil: none). t.mu is held.
func (t *leaseTable) answered(k zoneClient) *asking {
	a := t.asking[k]
	delete(t.asking, k)
	return a
}

// leaseTable holds one Limiter's grants, per (zone, client), and the rates of the clients of
// its lease zones. Only a client sending at least two requests' worth per TTL ever has a
// grant, so the table holds the hot clients; it is bounded by leaseKeys.
type leaseTable struct {
	mu      sync.Mutex
	m       map[zoneClient]*grant
	next    map[zoneClient]*grant  // a grant's successor, asked before it ran out (renew), not yet spent from
	asking  map[zoneClient]*asking // a grant asked and not answered: one at a time per client
	rates   []rateSlot
	seed    maphash.Seed
	ended   []*grant // ended, to be returned by the sweeper
	closed  bool     // ReturnLeases ran: no more grants, no local decisions
	metrics LeaseMetrics
	sweep   sync.Once
	stop    chan struct{}
}

func newLeaseTable(m LeaseMetrics) *leaseTable {
	return &leaseTable{
		m: make(map[zoneClient]*grant), next: make(map[zoneClient]*grant), asking: make(map[zoneClient]*asking),
		rates: make([]rateSlot, rateSlots), seed: maphash.MakeSeed(), metrics: m, stop: make(chan struct{}),
	}
}

// observe counts r's cost at now in its client's rate slot and returns the units the client
// sends per TTL: the larger of the previous period's and the current one's. t.mu is held.
func (t *leaseTable) observe(k zoneClient, r *Request, now time.Time) int64 {
	h := maphash.Comparable(t.seed, k)
	s := &t.rates[h%rateSlots]
	ns, ttl := now.UnixNano(), int64(r.Zone.Lease.TTL)
	if s.h != h {
		*s = rateSlot{h: h, start: ns}
	}
	if el := ns - s.start; el >= ttl {
		if el < 2*ttl {
			s.prev = s.cur
		} else {
			s.prev = 0
		}
		s.cur, s.start = 0, s.start+el/ttl*ttl
	}
	s.cur += r.Cost
	return max(s.prev, s.cur)
}

// ask returns how many tokens to ask a grant of for r, whose client sends perTTL units per TTL
// here: about leaseHeadroom × that, between r's cost and the zone's Max (and 2^31 − 1); 0 (no
// grant: decided exactly) when that is less than two requests' worth.
func ask(r *Request, perTTL int64) int32 {
	want := leaseHeadroom * float64(perTTL)
	most := min(r.Zone.Lease.Max, math.MaxInt32)
	if want < 2*float64(r.Cost) || most < 2*r.Cost {
		return 0
	}
	return int32(min(int64(want), most))
}

// live returns k's grant when r can be served from it at now: same numbers, not ended, not
// expired, with its cost left. When k's grant cannot serve r and a successor is in hand (renew),
// the grant ends and the successor takes its place. t.mu is held.
func (t *leaseTable) live(k zoneClient, r *Request, now time.Time) *grant {
	g := t.m[k]
	if !g.serves(r, now) {
		n := t.next[k]
		if n == nil {
			return nil
		}
		if g != nil {
			t.end(k, g)
		}
		delete(t.next, k)
		t.m[k] = n
		if g = n; !g.serves(r, now) {
			return nil
		}
	}
	return g
}

// serves reports whether r can be served from g at now: same numbers, not ended, not expired,
// with its cost left.
func (g *grant) serves(r *Request, now time.Time) bool {
	return g != nil && !g.ended && now.Before(g.expires) && g.units-g.spent >= r.Cost && g.n == numbersOf(r.Zone)
}

// renew returns the size of the successor to ask for g, k's grant, which r was just served from at
// now, its client sending perTTL units per TTL here; 0: none. A grant asks for its successor when a
// quarter of its units is left, or of its TTL (unless it ends with its fixed window first), so that
// the successor is in hand before the grant runs out, and r's client's next requests wait for no
// round trip. The successor is sized as a grant (ask) less what g has left, so that the units this
// instance holds for k stay within Max. There is none near the limit (Redis had less than twice the
// ask left after granting g), where grants shrink and the last units are decided one at a time, and
// none again for a grant whose successor was denied or failed. When it returns more than 0, k is
// marked as asking. t.mu is held.
func (t *leaseTable) renew(k zoneClient, g *grant, r *Request, perTTL int64, now time.Time) int32 {
	left := g.units - g.spent
	byTTL := g.end.IsZero() || g.expires.Before(g.end) // a fixed window's grant may end with its window instead
	low := leaseLow*left <= g.units || byTTL && leaseLow*g.expires.Sub(now) <= r.Zone.Lease.TTL
	if !low || g.noRenew || t.closed || t.next[k] != nil {
		return 0
	}
	if _, ok := t.asking[k]; ok {
		return 0
	}
	a := int64(ask(r, perTTL))
	a = min(a, r.Zone.Lease.Max-left)
	if a < 2*r.Cost || g.remaining < 2*a {
		return 0
	}
	t.markAsking(k)
	return int32(a)
}

// end stops k's grant g (or g, k's successor) from being spent, and queues its return. t.mu is
// held.
func (t *leaseTable) end(k zoneClient, g *grant) {
	if t.retire(k, g) {
		t.ended = append(t.ended, g)
	}
}

// retire stops k's grant g (or g, k's successor) from being spent; false when it was already.
// t.mu is held.
func (t *leaseTable) retire(k zoneClient, g *grant) bool {
	if g.ended {
		return false
	}
	g.ended = true
	if t.m[k] == g {
		delete(t.m, k)
	}
	if t.next[k] == g {
		delete(t.next, k)
	}
	if t.metrics != nil {
		t.metrics.Stranded(k.zone, -(g.units - g.spent))
	}
	return true
}

// spend takes cost from g. t.mu is held.
func (t *leaseTable) spend(k zoneClient, g *grant, cost int64) {
	g.spent += cost
	if t.metrics != nil {
		t.metrics.Stranded(k.zone, -cost)
		t.metrics.Local(k.zone)
	}
}

// giveBack returns cost to g, spent from it for a request that another zone denied (or whose
// decision failed): one of g's pending spends. A grant ended meanwhile waits for it before it is
// returned (collect), unless it waited too long: then it keeps the cost spent. t.mu is held.
func (t *leaseTable) giveBack(k zoneClient, g *grant, cost int64) {
	g.pending--
	if g.returned {
		return
	}
	g.spent -= cost
	if t.metrics != nil && !g.ended {
		t.metrics.Stranded(k.zone, cost)
	}
}

// served is the zone reply of a request admitted from g at now: Redis's figures at grant time
// less what was spent since (an estimate), with reset and next as the zone's refill gives them
// (a token bucket), or its window's end (a fixed window).
func (g *grant) served(z *Zone, now time.Time) zoneReply {
	left := g.left(z.Quota())
	zr := zoneReply{allowed: true, remaining: left}
	switch {
	case !g.end.IsZero():
		zr.reset = max(1, g.end.Sub(now).Microseconds())
		zr.next = zr.reset
	case left < z.Capacity:
		const most = 1 << 53 // µs, as decide.lua's MAX_US
		zr.reset = int64(min(float64(z.Capacity-left)/z.RefillRate*1e6, most)) + 1
		zr.next = min(zr.reset, int64(min(1e6/z.RefillRate, most))+1)
	}
	return zr
}

// leased admits reqs from this instance's grants, with no Redis call, when every zone of reqs
// leases (Zone.Lease) and has a live grant for the request's client with its cost left; each
// zone's Result and the Decision's figures are the grant's estimate (Redis's remaining at grant
// time, less what this instance spent since). Otherwise it changes nothing and returns false.
// A grant in hand is spent until it ends, Redis available or not. When observe, the request
// counts in its client's observed rate (the size of its next grants); allow's second look at
// the grants leaves it out, its plan having counted the request already.
func (l *Limiter) leased(reqs []Request, observe bool) (Decision, bool) {
	t := l.leases
	if t == nil || len(reqs) == 0 {
		return Decision{}, false
	}
	for i := range reqs {
		r := &reqs[i]
		if r.Zone.Lease == nil || unsatisfiable(*r) || r.Hold > 0 || r.maxWait() > 0 {
			return Decision{}, false
		}
	}
	now := l.clock()
	var kbuf [4]zoneClient
	var gbuf [4]*grant
	ks, gs := kbuf[:0], gbuf[:0]
	t.mu.Lock()
	for i := range reqs {
		k := zoneClientOf(reqs[i])
		g := t.live(k, &reqs[i], now)
		if g == nil || t.closed {
			t.mu.Unlock()
			return Decision{}, false
		}
		ks, gs = append(ks, k), append(gs, g)
	}
	var zbuf [4]zoneReply
	zones := zbuf[:0]
	var renewals []Request
	for i, g := range gs {
		t.spend(ks[i], g, reqs[i].Cost)
		zones = append(zones, g.served(reqs[i].Zone, now))
		if observe {
			if a := t.renew(ks[i], g, &reqs[i], t.observe(ks[i], &reqs[i], now), now); a > 0 {
				renewals = append(renewals, reqs[i])
				renewals[len(renewals)-1].ask = a
			}
		}
	}
	t.mu.Unlock()
	for _, r := range renewals {
		go l.renewGrant(r)
	}
	return pick(reqs, true, zones), true
}

// renewGrant asks Redis, in the background, for the successor of the grant of r's zone and
// client (renew: r.ask units), and keeps it for when the grant runs out (leaseTable.next). Its
// round trip is bounded by Options.CallTimeout (and the zone's TTL, the successor's lifetime).
// A denial or an error leaves no successor: the client's requests then ask for a grant as
// without one. A successor answered after ReturnLeases, or during a reset of the client, is
// returned at once.
func (l *Limiter) renewGrant(r Request) {
	t := l.leases
	k := zoneClientOf(r)
	sent := l.clock()
	ctx := withDeadline(context.Background(), time.Now().Add(min(l.callTime, r.Zone.Lease.TTL)))
	sub := []Request{r}
	keys := stateKeys(l.prefix, sub)
	ckeys, args := l.encodeDecision(sub, keys, false, sent)
	allowed, zones, err := l.allowOne(ctx, sub, ckeys, args, nil)
	t.mu.Lock()
	a := t.answered(k)
	if err != nil || !allowed {
		if g := t.m[k]; g != nil {
			// Not again for this grant: near the limit, or Redis failing (a call per request
			// while the grant lasts, past the handler's circuit breaker).
			g.noRenew = true
		}
		t.mu.Unlock()
		close(a.done)
		return
	}
	g := newGrant(k.zone, &sub[0], keys[0], args, 0, zones[0], sent)
	g.spent = 0 // no request was served from it
	if t.metrics != nil {
		t.metrics.Granted(k.zone, g.units)
	}
	if !t.closed && !a.dropped {
		t.next[k] = g
		if t.metrics != nil {
			t.metrics.Stranded(k.zone, g.units)
		}
		t.mu.Unlock()
		close(a.done)
		return
	}
	// Granted while the Limiter was being retired (its sweeper is gone), or while a reset of
	// the client was under way: returned at once.
	g.ended, g.done = true, a.done
	t.mu.Unlock()
	l.returnWithin([]*grant{g})
}

// leasePlan is how allowLeased decides each zone of a request: from a grant in hand (local), by
// asking Redis for a grant (asks), or exactly in Redis.
type leasePlan struct {
	local []*grant    // per zone: the grant its cost was taken from; nil: Redis decides it
	zones []zoneReply // per zone decided locally: its reply, as the grant estimates it
	asks  []int32     // per zone: the grant asked, > 0; 0: none
	n     int         // zones decided locally
	renew []Request   // zones decided locally whose grant's successor to ask for (Request.ask)
}

// plan takes from the grants in hand the costs of reqs' lease zones that have one, and, when
// grants may be asked (mayAsk), chooses the zones that ask for one: those whose client is hot
// enough (ask) and has no grant asked already, while the table has room. A plan with neither
// (a rare client's) has nil slices: nothing allocated. t.mu is taken.
func (t *leaseTable) plan(reqs []Request, now time.Time, mayAsk bool) leasePlan {
	var p leasePlan
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range reqs {
		r := &reqs[i]
		if r.Zone.Lease == nil || t.closed || unsatisfiable(*r) || r.Hold > 0 || r.maxWait() > 0 {
			continue
		}
		k := zoneClientOf(*r)
		perTTL := t.observe(k, r, now)
		if g := t.live(k, r, now); g != nil {
			t.spend(k, g, r.Cost)
			p.make(len(reqs))
			p.local[i], p.zones[i], p.n = g, g.served(r.Zone, now), p.n+1
			if a := t.renew(k, g, r, perTTL, now); a > 0 {
				p.renew = append(p.renew, *r)
				p.renew[len(p.renew)-1].ask = a
			}
			continue
		}
		if _, ok := t.asking[k]; ok || !mayAsk || len(t.m)+len(t.asking) >= leaseKeys {
			continue
		}
		if a := ask(r, perTTL); a > 0 {
			if g := t.m[k]; g != nil {
				t.end(k, g) // too little left, expired or of other numbers: returned
			}
			t.markAsking(k)
			p.make(len(reqs))
			p.asks[i] = a
		}
	}
	if p.n > 0 && p.n < len(reqs) {
		// The request's other zones go to Redis: the costs taken here are pending until it
		// answers (undo, or kept), and their grants are not returned meanwhile (collect).
		for _, g := range p.local {
			if g != nil {
				g.pending++
			}
		}
	}
	return p
}

// make gives p its slices for n zones, once.
func (p *leasePlan) make(n int) {
	if p.local == nil {
		p.local, p.zones, p.asks = make([]*grant, n), make([]zoneReply, n), make([]int32, n)
	}
}

// allowLeased is allow for a request with a lease zone: the zones with a grant in hand are
// charged from it (plan), the others are decided by Redis, those of hot clients asking for a
// grant (decide.lua grants it as a hold, charged at once); when Redis denies or fails, the
// costs taken from grants are given back, so the decision stays all-or-nothing. On Redis
// Cluster, a request whose zones are in several hash slots asks for no grant.
func (l *Limiter) allowLeased(ctx context.Context, reqs []Request) (Decision, error) {
	sent := l.clock()
	keys := stateKeys(l.prefix, reqs)
	p := l.leases.plan(reqs, sent, l.slotGroups(keys) == nil && len(reqs) <= maxBatch)
	for _, r := range p.renew {
		go l.renewGrant(r)
	}
	if p.local == nil {
		return l.allowExact(ctx, reqs, sent, keys) // no grant in hand nor asked: as without lease
	}
	if p.n == len(reqs) {
		return pick(reqs, true, p.zones), nil
	}
	sub, skeys, idx := make([]Request, 0, len(reqs)-p.n), make([]string, 0, len(reqs)-p.n), make([]int, 0, len(reqs)-p.n)
	for i := range reqs {
		if p.local[i] == nil {
			r := reqs[i]
			if r.Zone.Lease != nil {
				r.ask = p.asks[i] // a zone with UpTo keeps its bound
			}
			sub, skeys, idx = append(sub, r), append(skeys, keys[i]), append(idx, i)
		}
	}
	allowed, zs, held, slotErr, err := l.decideLeased(ctx, reqs, sub, skeys, idx, p, sent)
	if err != nil || !allowed {
		l.leases.undo(reqs, p)
	} else {
		l.leases.kept(p)
	}
	if err != nil {
		return Decision{}, err
	}
	if !allowed {
		l.remember(sub, zs, sent)
	}
	for j, i := range idx {
		p.zones[i] = zs[j]
	}
	d := pick(reqs, allowed, p.zones)
	d.Err, d.Held = slotErr, held
	return d, nil
}

// decideLeased decides sub (the zones of reqs at idx that no grant in hand served) in Redis,
// with one decide.lua call that asks for the grants of p, and records the grants made
// (install); or, across Redis Cluster hash slots (p asks none), as allowExact does. held's indexes
// are those of reqs.
func (l *Limiter) decideLeased(ctx context.Context, reqs, sub []Request, keys []string, idx []int, p leasePlan, sent time.Time) (
	allowed bool, zones []zoneReply, held *Held, slotErr, err error) {
	if groups := l.slotGroups(keys); groups != nil {
		allowed, zones, held, slotErr, err = l.allowSlots(ctx, sub, keys, groups, sent)
		if held != nil {
			held.sent = sent
			for _, part := range held.parts {
				for j, i := range part.idx {
					part.idx[j] = idx[i]
				}
			}
			l.track(held, sent)
		}
		return allowed, zones, held, slotErr, err
	}
	ckeys, args := l.encodeDecision(sub, keys, false, sent)
	allowed, zones, err = l.allowOne(ctx, sub, ckeys, args, nil)
	if err != nil {
		l.lose(sub, ckeys, args) // a concurrency zone's slot may have been taken: given back by Refresh
	}
	if err != nil || !allowed {
		return allowed, zones, nil, nil, err
	}
	if held = newHeld(reqs, ckeys, args, idx, zones); held != nil {
		held.sent = sent
		l.track(held, sent) // a concurrency zone's slot, kept alive while its request runs
	}
	if late := l.leases.install(reqs, sub, idx, p, keys, args, zones, sent); len(late) > 0 {
		go l.returnWithin(late) // granted while the Limiter was being retired (its sweeper is gone), or during a reset
	}
	if rl := l.resets.Load(); rl != nil {
		rl.listen() // a grant to drop on a reset: from now on, listen
	}
	l.startSweeper()
	return allowed, zones, held, nil, nil
}

// kept resolves the costs plan took locally as spent: Redis admitted the request. t.mu is taken.
func (t *leaseTable) kept(p leasePlan) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, g := range p.local {
		if g != nil {
			g.pending--
		}
	}
}

// undo gives back the costs plan took locally and drops its asks: the request was denied, or
// Redis failed. t.mu is taken.
func (t *leaseTable) undo(reqs []Request, p leasePlan) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, g := range p.local {
		if g != nil {
			t.giveBack(zoneClientOf(reqs[i]), g, reqs[i].Cost)
		}
		if p.asks[i] > 0 {
			close(t.answered(zoneClientOf(reqs[i])).done)
		}
	}
}

// install records the grants Redis made for the zones of reqs that asked (p.asks): sub are the
// requests sent, idx their indexes in reqs, keys and args the decide.lua call's, zones its
// reply. It returns the grants made after ReturnLeases, to be returned at once. t.mu is taken.
func (t *leaseTable) install(reqs, sub []Request, idx []int, p leasePlan, keys []string, args []any, zones []zoneReply, sent time.Time) (late []*grant) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for j, i := range idx {
		if p.asks[i] == 0 {
			continue
		}
		k, r := zoneClientOf(reqs[i]), &sub[j]
		a := t.answered(k)
		units := int64(zones[j].granted)
		if t.metrics != nil {
			t.metrics.Granted(k.zone, units)
		}
		g := newGrant(k.zone, r, keys[j], args, j, zones[j], sent)
		// The client's figures: Redis's remaining less this request, not less the whole grant.
		zones[j].remaining = g.left(r.Zone.Quota())
		if t.closed || a.dropped { // retired, or a reset of the client under way (drop)
			g.ended, g.done = true, a.done
			late = append(late, g)
			continue
		}
		close(a.done)
		t.m[k] = g
		if t.metrics != nil {
			t.metrics.Stranded(k.zone, units-r.Cost)
		}
	}
	return late
}

// grantZone returns settle.lua's zone arguments of a grant of units, of the zone whose decide.lua
// arguments are za (zoneArgsOf): its algorithm tag, quota and rate, and units as its cost.
func grantZone(za []any, units int64) []any { return []any{za[0], za[1], za[2], units} }

// newGrant is the grant of the j-th zone of a decide.lua call with args, whose state key is key,
// sent at sent, and zr its reply (granted). A fixed window's grant ends at the latest at its
// window's end: the reply's reset, counted from when the call was sent (before Redis's now), so
// that none of it is spent in the next window, whose count does not hold it.
func newGrant(zone string, r *Request, key string, args []any, j int, zr zoneReply, sent time.Time) *grant {
	nonce := args[1].(string)
	g := &grant{
		name: zone, keys: []string{key}, nonce: nonce, units: int64(zr.granted), spent: r.Cost, n: numbersOf(r.Zone),
		zone:    grantZone(zoneArgsOf(args, j), int64(zr.granted)),
		expires: sent.Add(r.Zone.Lease.TTL), remaining: zr.remaining,
	}
	if r.Zone.Algorithm.recorded() { // the grant is recorded as any held charge, and ends with its window
		g.keys = append(g.keys, recordKey(key, nonce), genKey(key))
		g.end = sent.Add(time.Duration(zr.reset) * time.Microsecond)
		if g.end.Before(g.expires) {
			g.expires = g.end
		}
	}
	return g
}

// drop ends the grant and successor of the client (as ClientKey gives it) in the zone named
// zone, whose state was reset, and returns them to be returned to Redis: a hold the reset
// deleted gives nothing back, and one made on the new state after the delete (a grant asked
// before the reset and answered after it) gives back what it holds, so that returning is exact
// either way. A grant asked for the client and not answered yet is returned when its answer
// comes (renewGrant, install), and drop waits for that, at most wait.
func (t *leaseTable) drop(zone, client string, wait time.Duration) []*grant {
	k := zoneClient{zone: zone, client: client}
	t.mu.Lock()
	var gs []*grant
	for _, g := range []*grant{t.m[k], t.next[k]} {
		if g != nil && t.retire(k, g) {
			g.returned = true
			gs = append(gs, g)
		}
	}
	a := t.asking[k]
	if a != nil {
		a.dropped = true
	}
	t.mu.Unlock()
	if a != nil {
		tm := time.NewTimer(wait)
		defer tm.Stop()
		select {
		case <-a.done:
		case <-tm.C:
		}
	}
	return gs
}

// collect ends the grants and successors expired at now (every one when all) and takes the
// ended ones to return. A grant with pending spends is left for a later sweep, so that a cost
// given back for a request Redis denies is given back to Redis too, but for at most
// leaseReturnMargin/2 past its expiry: its return must reach Redis before its hold is counted as
// wholly spent (TTL + leaseReturnMargin after the grant). t.mu is taken.
func (t *leaseTable) collect(now time.Time, all bool) []*grant {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, m := range []map[zoneClient]*grant{t.m, t.next} {
		for k, g := range m {
			if all || !now.Before(g.expires) {
				t.end(k, g)
			}
		}
	}
	var out []*grant
	waiting := t.ended[:0]
	for _, g := range t.ended {
		if g.pending > 0 && !all && now.Before(g.expires.Add(leaseReturnMargin/2)) {
			waiting = append(waiting, g)
			continue
		}
		g.returned = true
		out = append(out, g)
	}
	clear(t.ended[len(waiting):])
	t.ended = waiting
	return out
}

// startSweeper starts, once, the goroutine that returns ended grants every leaseSweep.
func (l *Limiter) startSweeper() {
	t := l.leases
	t.sweep.Do(func() {
		go func() {
			tick := time.NewTicker(leaseSweep)
			defer tick.Stop()
			for {
				select {
				case <-t.stop:
					return
				case <-tick.C:
					if gs := t.collect(l.clock(), false); len(gs) > 0 {
						l.returnWithin(gs)
					}
				}
			}
		}()
	})
}

// returnGrants settles each grant with settle.lua ("amount": its spent tokens are committed,
// the rest given back), all under way at once on the decisions' pipeline, so that under load
// they ride the decisions' round trips. It returns the first error. A grant whose hold is gone
// (reset, expired, committed for being late) gives nothing back.
func (l *Limiter) returnGrants(ctx context.Context, gs []*grant) error {
	var now any = "" // the Redis server clock
	if l.now != nil {
		now = l.now().UnixMicro()
	}
	errs := make(chan error, len(gs))
	for _, g := range gs {
		go func() {
			keys := g.keys
			args := append([]any{now, g.nonce, "amount"}, g.zone...)
			args = append(args, strconv.FormatInt(g.spent, 10))
			var reply any
			var err error
			if b := l.batcherFor(ctx, g.keys[0]); b != nil {
				reply, err = b.runSettle(ctx, keys, args)
			} else {
				reply, err = runScript(ctx, l.rdb, settleScript, keys, args)
			}
			states, err := decodeSettled(reply, err, 1)
			if err == nil && states[0] == settledNow && l.leases.metrics != nil {
				l.leases.metrics.Returned(g.name, g.units-g.spent)
			}
			if g.done != nil {
				close(g.done)
			}
			errs <- err
		}()
	}
	var first error
	for range gs {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	return first
}

// returnWithin returns gs (returnGrants) within Options.CallTimeout, leaving out the error: a
// grant that fails to return counts as spent once its hold has lived TTL + 1s.
func (l *Limiter) returnWithin(gs []*grant) {
	ctx, cancel := context.WithTimeout(context.Background(), l.callTime)
	defer cancel()
	_ = l.returnGrants(ctx, gs)
}

// ReturnLeases ends every grant of this Limiter and gives their unspent tokens back to Redis
// before it returns (or ctx ends), and stops its sweeper: from then on its lease zones are
// decided exactly. Call it when the Limiter is retired (a config reload). A grant whose return
// fails counts as spent once its hold has lived TTL + 1s.
func (l *Limiter) ReturnLeases(ctx context.Context) error {
	t := l.leases
	if t == nil {
		return nil
	}
	t.mu.Lock()
	already := t.closed
	t.closed = true
	t.mu.Unlock()
	if !already {
		close(t.stop)
	}
	if gs := t.collect(l.clock(), true); len(gs) > 0 {
		return l.returnGrants(ctx, gs)
	}
	return nil
}

// batcherFor is the Batcher that carries the calls of key: BatcherFor's, else Options.Batcher
// (nil: none, a round trip per call).
func (l *Limiter) batcherFor(ctx context.Context, key string) *Batcher {
	if l.batchFor != nil {
		if b := l.batchFor(ctx, key); b != nil {
			return b
		}
	}
	return l.batch
}

// leaseHold is decide.lua's hold time of a grant for zone z (a token bucket's hold, a fixed
// window's record), in µs: TTL + leaseReturnMargin.
func leaseHold(z *Zone) int64 { return (z.Lease.TTL + leaseReturnMargin).Microseconds() }

// leases reports whether r asks for a lease's grant (its zone has a Lease), rather than for the
// bound of a zone with UpTo.
func (r *Request) leases() bool { return r.ask > 0 && !r.Zone.UpTo }

// leasing reports whether a zone of reqs leases.
func leasing(reqs []Request) bool {
	for i := range reqs {
		if reqs[i].Zone.Lease != nil {
			return true
		}
	}
	return false
}
