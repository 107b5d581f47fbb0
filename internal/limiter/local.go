package limiter

import (
	"math"
	"sync"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
	"golang.org/x/time/rate"
)

// DefaultLocalKeys is the default bound of the clients a Local tracks per zone.
const DefaultLocalKeys = 65536

// Local decides requests in process, for `fail_mode local`: while Redis is unavailable each
// instance enforces every zone on its own, so the global limit becomes a per-instance one.
// A concurrency zone is a semaphore of Limit per client, an adaptive concurrency zone's of its
// MinLimit (Release gives its slot back). Every
// other zone is a token bucket (golang.org/x/time/rate): a token bucket zone with its own
// capacity and refill rate, a window zone (sliding window log or counter, fixed window) as a
// bucket of Limit tokens refilled at Limit per window (a period's nominal length): it admits the
// same steady rate; its bursts, and a fixed window's reset, differ. A token bucket zone's MaxWait
// shapes as in Redis: the bucket goes into debt and Decision.Delay says how long to hold the
// request.
//
// Each zone keeps at most maxKeys client buckets of its own, least recently used evicted: an
// evicted client starts again with a full bucket, and clients of one zone never evict another
// zone's. A client without a bucket has a full one, so a bucket is stored only when a request
// is admitted (and charged) in every zone: a denied request stores nothing, and a flood of
// denied requests with fresh keys evicts no one. Local is safe for concurrent use.
type Local struct {
	mu      sync.Mutex // makes a multi-zone decision all-or-nothing
	last    time.Time  // the latest time decided at, under mu
	maxKeys int
	zones   map[localZone]*lru.Cache[string, *rate.Limiter] // under mu
	slots   map[localZone]map[string]int64                  // concurrency zones: requests in flight per client, under mu
}

// localZone names a zone's buckets in a Local.
type localZone struct{ name, algorithm string }

// NewLocal returns a Local keeping at most maxKeys buckets per zone (DefaultLocalKeys when <= 0).
func NewLocal(maxKeys int) *Local {
	if maxKeys <= 0 {
		maxKeys = DefaultLocalKeys
	}
	return &Local{maxKeys: maxKeys, zones: make(map[localZone]*lru.Cache[string, *rate.Limiter])}
}

// Allow decides reqs at time now with the semantics of Limiter.Decide in Redis (all-or-nothing; the
// deciding zone chosen the same way, each zone's Result filled in), in process and without error.
func (l *Local) Allow(reqs []Request, now time.Time) Decision {
	if len(reqs) == 0 {
		return Decision{Allowed: true, Zone: -1}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	// Requests reach the lock out of time order; x/time/rate moves its clock back for an earlier
	// time and would then credit the same refill twice. Time never goes back here.
	if now.Before(l.last) {
		now = l.last
	}
	l.last = now
	buckets := make([]*rate.Limiter, len(reqs))
	fresh := make([]bool, len(reqs)) // buckets[i] is new, not stored yet
	zones := make([]zoneReply, len(reqs))
	allowed := true
	for i, r := range reqs {
		if r.Zone.Algorithm.HoldsSlots() {
			zones[i] = l.slotReply(r)
			allowed = allowed && (zones[i].allowed || r.Zone.Shadow)
			continue
		}
		b, isNew := l.bucket(r, now)
		buckets[i], fresh[i] = b, isNew
		tokens := b.TokensAt(now)
		perSec := float64(b.Limit())
		z := zoneReply{allowed: tokens >= float64(r.Cost)}
		if !z.allowed {
			// As decide.lua: within the zone's max wait, admitted in debt with that delay; else
			// denied until it would be admitted with a hold of the max wait.
			wait, maxWait := micros((float64(r.Cost)-tokens)/perSec), r.maxWait().Microseconds()
			z.retryAfter = wait
			if !unsatisfiable(r) {
				z.allowed = wait <= maxWait
				if !z.allowed {
					z.retryAfter = wait - maxWait
				}
			}
			allowed = allowed && (z.allowed || r.Zone.Shadow) // a shadow zone never denies
		}
		zones[i] = z
	}
	for i, r := range reqs {
		if r.Zone.Algorithm.HoldsSlots() {
			if allowed && zones[i].allowed {
				l.slots[localZone{r.Zone.Name, r.Zone.Algorithm.tag()}][ClientKey(r.Key)]++
			}
			continue
		}
		tokens := buckets[i].TokensAt(now)
		if allowed && zones[i].allowed {
			// Cannot fail (checked above, under l.mu): the cost is at most the burst. Unlike
			// AllowN, ReserveN takes the bucket below zero: the debt of a held request.
			buckets[i].ReserveN(now, int(r.Cost))
			if fresh[i] {
				l.zones[localZone{r.Zone.Name, r.Zone.Algorithm.tag()}].Add(ClientKey(r.Key), buckets[i])
			}
		}
		if zones[i].allowed {
			// As decide.lua reports a zone that admits: after the request, charged or not (pick
			// gives an uncharged zone its cost back).
			tokens -= float64(r.Cost)
		}
		whole := math.Floor(max(tokens, 0))
		zones[i].remaining = int64(whole)
		zones[i].reset = micros((float64(r.Zone.Quota()) - tokens) / float64(buckets[i].Limit()))
		if whole < float64(r.Zone.Quota()) {
			zones[i].next = micros((whole + 1 - tokens) / float64(buckets[i].Limit()))
		}
	}
	return pick(reqs, allowed, zones)
}

// slotReply decides r in its concurrency zone as decide.lua does, on this instance's requests in
// flight: admitted iff fewer than the limit are; a denial's retry after is 1 s, its reset and next
// 1 µs (a slot may come back at any moment). At most maxKeys clients of a zone are in flight at
// once: a request of another client is denied while they are (the map stays bounded).
func (l *Local) slotReply(r Request) zoneReply {
	zk := localZone{r.Zone.Name, r.Zone.Algorithm.tag()}
	if l.slots == nil {
		l.slots = make(map[localZone]map[string]int64)
	}
	m := l.slots[zk]
	if m == nil {
		m = make(map[string]int64)
		l.slots[zk] = m
	}
	n, ok := m[ClientKey(r.Key)]
	limit := r.Zone.Limit
	if a := r.Zone.Adaptive; a != nil {
		limit = a.MinLimit // adaptive concurrency: what it learnt is in Redis; its floor here
	}
	if n+r.Cost <= limit && (ok || len(m) < l.maxKeys) {
		return zoneReply{allowed: true, remaining: limit - n - r.Cost, reset: 1, next: 1}
	}
	z := zoneReply{remaining: max(0, limit-n), retryAfter: 1_000_000}
	if n > 0 {
		z.reset, z.next = 1, 1
	}
	return z
}

// Release gives back the concurrency slots that reqs took when Allow admitted them: once each
// request's response is complete. Zones of other algorithms are left alone.
func (l *Local) Release(reqs []Request) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range reqs {
		if !r.Zone.Algorithm.HoldsSlots() {
			continue
		}
		m := l.slots[localZone{r.Zone.Name, r.Zone.Algorithm.tag()}]
		k := ClientKey(r.Key)
		if m[k] <= 1 {
			delete(m, k)
		} else {
			m[k]--
		}
	}
}

// bucket returns the bucket of r's zone and client, or a full one, not stored (isNew), when
// there is none: Allow stores it only when it admits the request. A bucket follows the numbers
// of the request at hand: when a zone's numbers come from placeholders and this request's
// differ from the last one's (the client moved to another plan), the bucket keeps its tokens, at
// most the new capacity, and refills at the new rate from now on. (Redis's buckets store what is
// used, so there a raised capacity gives the difference at once; in process, while Redis fails,
// it comes with the refill.)
func (l *Local) bucket(r Request, now time.Time) (b *rate.Limiter, isNew bool) {
	perSec := r.Zone.RefillRate
	if r.Zone.Algorithm.windowed() {
		perSec = float64(r.Zone.Limit) / r.Zone.PolicyWindow().Seconds()
	}
	burst := int(r.Zone.Quota())
	zk := localZone{r.Zone.Name, r.Zone.Algorithm.tag()}
	c := l.zones[zk]
	if c == nil {
		c, _ = lru.New[string, *rate.Limiter](l.maxKeys) // errors only for a size <= 0
		l.zones[zk] = c
	}
	if b, ok := c.Get(ClientKey(r.Key)); ok {
		if b.Limit() != rate.Limit(perSec) {
			b.SetLimitAt(now, rate.Limit(perSec))
		}
		if b.Burst() != burst {
			b.SetBurstAt(now, burst)
		}
		return b, false
	}
	return rate.NewLimiter(rate.Limit(perSec), burst), true // starts full
}

// micros converts seconds to whole microseconds, rounded up and never negative.
func micros(s float64) int64 {
	if !(s > 0) {
		return 0
	}
	return int64(math.Ceil(s * 1e6))
}
