package limiter

import (
	"time"

	lru "github.com/hashicorp/golang-lru/v2"
)

// DefaultDenyCacheKeys is the default bound of the (zone, client) denials a Limiter remembers.
const DefaultDenyCacheKeys = 65536

// denial is a remembered denial of one zone for one client: until `until`, the zone cannot
// admit a request of at least `cost`.
type denial struct {
	cost      int64
	until     time.Time // when the zone could first admit cost again
	resetAt   time.Time // when the zone is full again
	remaining int64     // whole tokens or slots left when it was denied
}

// denyCache remembers recent denials so that a client over its limit is denied again with no
// Redis call. Every entry is conservative: other instances can only consume from a zone, never
// give back, so a zone that cannot admit `cost` before `until` for the state it was denied in
// cannot admit it sooner for any later state. The cache is bounded (least recently used
// evicted) and safe for concurrent use.
type denyCache struct {
	c *lru.Cache[denyKey, denial]
}

// denyKey is a zone and a client, as ClientKey gives it (a verbatim key costs no allocation).
type denyKey struct {
	zone   *Zone
	client string
}

func newDenyCache(size int) *denyCache {
	if size <= 0 {
		size = DefaultDenyCacheKeys
	}
	c, _ := lru.New[denyKey, denial](size) // errors only for a size <= 0
	return &denyCache{c: c}
}

// check returns the Decision for reqs if a remembered denial covers one of them at now: the
// covering zone that admits last decides. Expired entries found on the way are removed.
func (dc *denyCache) check(reqs []Request, now time.Time) (Decision, bool) {
	var d Decision
	found := false
	for i, r := range reqs {
		k := denyKey{r.Zone, ClientKey(r.Key)}
		e, ok := dc.c.Get(k)
		if !ok {
			continue
		}
		if !now.Before(e.until) {
			dc.c.Remove(k)
			continue
		}
		if reqs[i].Cost < e.cost {
			continue // a smaller request may fit: ask Redis
		}
		if retry := e.until.Sub(now); !found || retry > d.RetryAfter {
			d = Decision{
				Zone: i, Limit: reqs[i].Zone.Quota(), Remaining: e.remaining,
				RetryAfter: retry, Reset: max(e.resetAt.Sub(now), retry), Cached: true,
			}
			found = true
		}
	}
	return d, found
}

// record remembers the denial of every zone that denied (zones from the reply at now), unless
// its cost exceeds the zone's quota (it can never pass; nothing to wait for).
func (dc *denyCache) record(reqs []Request, zones []zoneReply, now time.Time) {
	for i, z := range zones {
		if z.allowed || unsatisfiable(reqs[i]) || z.retryAfter <= 0 {
			continue
		}
		dc.c.Add(denyKey{reqs[i].Zone, ClientKey(reqs[i].Key)}, denial{
			cost:      reqs[i].Cost,
			until:     now.Add(time.Duration(z.retryAfter) * time.Microsecond),
			resetAt:   now.Add(time.Duration(z.reset) * time.Microsecond),
			remaining: z.remaining,
		})
	}
}
