package limiter

import (
	"math"
	"sync"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
	"golang.org/x/time/rate"
)

// DefaultLocalKeys is the default bound of the clients a Local tracks per zone set.
const DefaultLocalKeys = 65536

// Local decides requests in process, for `fail_mode local`: while Redis is unavailable each
// instance enforces every zone on its own, so the global limit becomes a per-instance one.
// Every zone is a token bucket (golang.org/x/time/rate): a token bucket zone with its own
// capacity and refill rate, a window zone (sliding window log or counter, fixed window) as a
// bucket of Limit tokens refilled at Limit per window (a period's nominal length): it admits the
// same steady rate; its bursts, and a fixed window's reset, differ. A token bucket zone's MaxWait
// shapes as in Redis: the bucket goes into debt and Decision.Delay says how long to hold the
// request. At most maxKeys (zone, client) buckets are kept, least recently used evicted: an
// evicted client starts again with a full bucket. Local is safe for concurrent use.
type Local struct {
	mu      sync.Mutex // makes a multi-zone decision all-or-nothing
	last    time.Time  // the latest time decided at, under mu
	buckets *lru.Cache[string, *rate.Limiter]
}

// NewLocal returns a Local keeping at most maxKeys buckets (DefaultLocalKeys when <= 0).
func NewLocal(maxKeys int) *Local {
	if maxKeys <= 0 {
		maxKeys = DefaultLocalKeys
	}
	c, _ := lru.New[string, *rate.Limiter](maxKeys) // errors only for a size <= 0
	return &Local{buckets: c}
}

// Allow decides reqs at time now with the semantics of Limiter.Allow (all-or-nothing; the
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
	zones := make([]zoneReply, len(reqs))
	allowed := true
	for i, r := range reqs {
		b := l.bucket(r, now)
		buckets[i] = b
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
			allowed = allowed && z.allowed
		}
		zones[i] = z
	}
	for i, r := range reqs {
		tokens := buckets[i].TokensAt(now)
		if allowed {
			// Cannot fail (checked above, under l.mu): the cost is at most the burst. Unlike
			// AllowN, ReserveN takes the bucket below zero: the debt of a held request.
			buckets[i].ReserveN(now, int(r.Cost))
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

// bucket returns the bucket of r's zone and client, making a full one when there is none. A
// bucket follows the numbers of the request at hand: when a zone's numbers come from
// placeholders and this request's differ from the last one's (the client moved to another
// plan), the bucket keeps its tokens, at most the new capacity, and refills at the new rate
// from now on. (Redis's buckets store what is used, so there a raised capacity gives the
// difference at once; in process, while Redis fails, it comes with the refill.)
func (l *Local) bucket(r Request, now time.Time) *rate.Limiter {
	perSec := r.Zone.RefillRate
	if r.Zone.Algorithm.windowed() {
		perSec = float64(r.Zone.Limit) / r.Zone.PolicyWindow().Seconds()
	}
	burst := int(r.Zone.Quota())
	key := r.Zone.Name + "\x00" + r.Zone.Algorithm.tag() + "\x00" + ClientKey(r.Key)
	if b, ok := l.buckets.Get(key); ok {
		if b.Limit() != rate.Limit(perSec) {
			b.SetLimitAt(now, rate.Limit(perSec))
		}
		if b.Burst() != burst {
			b.SetBurstAt(now, burst)
		}
		return b
	}
	b := rate.NewLimiter(rate.Limit(perSec), burst) // starts full
	l.buckets.Add(key, b)
	return b
}

// micros converts seconds to whole microseconds, rounded up and never negative.
func micros(s float64) int64 {
	if !(s > 0) {
		return 0
	}
	return int64(math.Ceil(s * 1e6))
}
