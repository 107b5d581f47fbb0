package limiter

import (
	"strings"
	"sync"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
)

// Deny cache defaults.
const (
	// DefaultDenyCacheKeys is the default bound of the (zone, client) pairs whose denials a
	// Limiter remembers.
	DefaultDenyCacheKeys = 65536
	// DefaultDenyCacheMaxAge is how long a remembered denial is trusted at most by default.
	DefaultDenyCacheMaxAge = time.Second
)

// denial is a remembered denial of one zone for one client and one cost, as Redis decided it. Its
// times are counted from `sent`, when the decision's call was sent: Redis decided after that, so
// every time derived from it comes no later than Redis's.
type denial struct {
	trusted   time.Time // until when the entry answers for Redis: see check
	until     time.Time // when the zone could first admit the cost (sent + retry after)
	nextAt    time.Time // when the zone's next unit arrives (sent + next)
	resetAt   time.Time // when the zone is full again (sent + reset)
	remaining int64     // whole tokens or slots left when it was denied
	blocked   bool      // the zone's block refused the client, or started with this denial
}

// denyCache remembers recent denials so that a client over its limit is denied again with no
// Redis call. An entry answers for Redis, with Redis's own figures less the time elapsed, only
// while it can give the answer Redis would:
//   - for the same zone, client and cost (a smaller cost may fit; a larger one waits longer than
//     the entry knows), and the same numbers of the zone (capacity, refill rate, limit, window,
//     max cost: a zone whose numbers come from placeholders may decide each request under
//     others, and a denial under a free plan's says nothing of a paid plan's);
//   - never for a cost the zone can never admit (that answer carries no Retry-After);
//   - before the zone's next unit (token or window slot) arrives: until then Remaining has not
//     changed, after it the entry no longer knows it;
//   - before the denial's retry time, counted from when the call was sent;
//   - for at most maxAge after the call was sent.
//
// Other instances only consume from a zone, so a denial could otherwise be trusted until its
// retry time. What gives capacity back makes an entry stale: an admin reset (Limiter.Reset), a
// refund of a charge settled after the response (Limiter.Settle), a Redis Cluster release of a
// hold (settle.lua), or a reload that raised a limit (a request decided under other numbers on
// this instance is another entry: see denyEntry). A reload starts a new Limiter with an empty
// cache; a reset or a refund is forgotten here at once (a reset also, through Redis pub/sub, by
// every instance that receives it: forgetKey); anything that reaches no instance is bounded by
// maxAge: the stale entry denies for at most that long after Redis's answer.
//
// The cache holds up to its size of (zone, client) pairs, the least recently used evicted, each
// with the denials of up to maxEntriesPerClient (numbers, cost) of its own, so that forgetting a
// client's denials in a zone (a reset, a refund) is one removal. It is safe for concurrent use.
type denyCache struct {
	c      *lru.Cache[zoneClient, []denyEntry] // a slice once stored is never changed, only replaced
	maxAge time.Duration
	mu     sync.Mutex // serialises record's read-modify-write with forget
}

// maxEntriesPerClient bounds the denials remembered for one client in one zone: one per cost and
// set of numbers (a zone of literal numbers and cost has one).
const maxEntriesPerClient = 4

// denyEntry is a denial of one cost under some numbers of the zone. Not the *Zone: a zone whose
// numbers come from placeholders is a new Zone per request (the handler's per-request copy), and
// a denial decided under some numbers (a free plan's capacity) must not answer for a request
// under others (a paid plan's); a zone of literal numbers has the same numbers on every request.
type denyEntry struct {
	n    zoneNumbers
	cost int64
	denial
}

// zoneNumbers are the parameters of a zone that decide a request, as a comparable value.
type zoneNumbers struct {
	algorithm  Algorithm
	period     Period
	capacity   int64
	refillRate float64
	limit      int64
	window     time.Duration
	location   *time.Location
	maxCost    int64 // MaxCostOrQuota(): 0 and the quota are the same
}

func numbersOf(z *Zone) zoneNumbers {
	return zoneNumbers{
		algorithm: z.Algorithm, period: z.Period, capacity: z.Capacity, refillRate: z.RefillRate,
		limit: z.Limit, window: z.Window, location: z.Location, maxCost: z.MaxCostOrQuota(),
	}
}

// find returns the index in es of the entry of r's numbers and cost, or -1.
func find(es []denyEntry, r Request) int {
	n := numbersOf(r.Zone)
	for i := range es {
		if es[i].cost == r.Cost && es[i].n == n {
			return i
		}
	}
	return -1
}

func newDenyCache(size int, maxAge time.Duration) *denyCache {
	if size <= 0 {
		size = DefaultDenyCacheKeys
	}
	if maxAge <= 0 {
		maxAge = DefaultDenyCacheMaxAge
	}
	c, _ := lru.New[zoneClient, []denyEntry](size) // errors only for a size <= 0
	return &denyCache{c: c, maxAge: maxAge}
}

// check returns the Decision for reqs if a remembered denial covers one of them at now: the
// covering zone that admits last decides. A client whose only entry has expired is removed on
// the way. Each zone's Result is that of its covering denial, or not Known: a cached denial
// knows nothing of the zones it does not cover.
func (dc *denyCache) check(reqs []Request, now time.Time) (Decision, bool) {
	var d Decision
	found := false
	for i := range reqs {
		r := &reqs[i]
		r.Result = Result{}
		if unsatisfiable(*r) {
			continue // Redis answers it, with no Retry-After
		}
		k := zoneClientOf(*r)
		es, ok := dc.c.Get(k)
		if !ok {
			continue
		}
		j := find(es, *r)
		if j < 0 {
			continue
		}
		e := es[j].denial
		if !now.Before(e.trusted) {
			if len(es) == 1 {
				dc.c.Remove(k) // else replaced by a later record, or evicted
			}
			continue
		}
		retry := e.until.Sub(now)
		r.Result = Result{Known: true, Remaining: e.remaining, Next: e.nextAt.Sub(now), Reset: max(e.resetAt.Sub(now), retry), Blocked: e.blocked}
		if !found || retry > d.RetryAfter {
			d = Decision{
				Zone: i, Limit: r.Zone.Quota(), Remaining: e.remaining,
				RetryAfter: retry, Reset: r.Result.Reset, Next: r.Result.Next, Cached: true, Blocked: e.blocked,
			}
			found = true
		}
	}
	return d, found
}

// record remembers the denial of every zone that denied (zones from the reply to the call sent
// at sent), unless its cost can never be admitted (nothing to wait for), or it was decided with
// the zone's MaxWait set aside (NoWait): with room to hold it, the request may be admitted.
//
// With MaxWait, a denial's retry after is when the zone would admit the request with a hold, so
// the entry is trusted only while Redis would still deny it: never for a request it would now
// hold rather than deny.
func (dc *denyCache) record(reqs []Request, zones []zoneReply, sent time.Time) {
	for i, z := range zones {
		if z.allowed || reqs[i].Zone.Shadow || unsatisfiable(reqs[i]) || z.retryAfter <= 0 || z.next <= 1 {
			continue // next 1µs: denied by Redis Cluster holds, which may be released at any moment
		}
		if reqs[i].NoWait && reqs[i].Zone.MaxWait > 0 {
			continue
		}
		// A denial that Redis answered has a next unit to come (next > 0, next <= retry after):
		// a zone with none is full, and then only a cost above its quota is denied.
		retry, next := time.Duration(z.retryAfter)*time.Microsecond, time.Duration(z.next)*time.Microsecond
		e := denyEntry{n: numbersOf(reqs[i].Zone), cost: reqs[i].Cost, denial: denial{
			trusted:   sent.Add(min(retry, next, dc.maxAge)),
			until:     sent.Add(retry),
			nextAt:    sent.Add(next),
			resetAt:   sent.Add(time.Duration(z.reset) * time.Microsecond),
			remaining: z.remaining,
			blocked:   z.block != 0,
		}}
		k := zoneClientOf(reqs[i])
		dc.mu.Lock()
		old, _ := dc.c.Peek(k)
		es := make([]denyEntry, 1, min(len(old)+1, maxEntriesPerClient))
		es[0] = e // the newest first: when the client has too many, the oldest go
		for _, o := range old {
			if len(es) < maxEntriesPerClient && (o.cost != e.cost || o.n != e.n) {
				es = append(es, o)
			}
		}
		dc.c.Add(k, es)
		dc.mu.Unlock()
	}
}

// forget removes the entries of the zone named zone and the client key client (as ClientKey
// gives it), whatever their numbers and cost.
func (dc *denyCache) forget(zone, client string) {
	dc.mu.Lock()
	dc.c.Remove(zoneClient{zone: zone, client: client})
	dc.mu.Unlock()
}

// parseStateKey splits a state key of StateKey's form, `<prefix>{<client key>}:<zone>:<tag>`,
// into its client key (as ClientKey gives it) and zone name; ok is false for any other string.
func parseStateKey(prefix, key string) (client, zone string, ok bool) {
	rest, ok := strings.CutPrefix(key, prefix+"{")
	if !ok {
		return "", "", false
	}
	client, rest, ok = strings.Cut(rest, "}:")
	if !ok {
		return "", "", false
	}
	i := strings.LastIndexByte(rest, ':')
	if i < 0 {
		return "", "", false
	}
	return client, rest[:i], true
}
