package limiter

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Top clients: a zone with Top counts each client's denials and admitted cost in bounded sorted
// sets, written by decide.lua in the same call as the decision. Each sorted set holds one time
// bucket (TopWindow long, aligned to the Unix epoch) of one kind (TopDenied or TopUsed) and
// keeps at most Top members with the Space-Saving rule: a new client arriving at a full set
// takes the place of the member with the lowest count and starts from that count. A count is
// therefore never below the client's true count in the bucket, and above it by at most the
// bucket's total divided by Top; the count it started from is its error, kept beside the set
// (topErrorKey), so that ReadTop tells which part of a count is certainly the client's. On Redis Cluster the sets are per hash slot (a script call
// writes only keys of its client's slot), and ReadTop merges them.

// Bounds of Zone.Top and Zone.TopWindow.
const (
	MaxTop       = 10000 // entries per sorted set
	MinTopWindow = time.Second
	MaxTopWindow = 24 * time.Hour
)

// TopBy is what a zone's top counts.
type TopBy int

const (
	// TopDenied counts the requests the zone denied (a shadow zone: would have denied).
	TopDenied TopBy = iota
	// TopUsed counts the units (cost, or a lease's grant) the zone charged.
	TopUsed
)

// tag is the segment of the keys of b: "d" or "u".
func (b TopBy) tag() string {
	if b == TopUsed {
		return "u"
	}
	return "d"
}

// validateTop checks Top and TopWindow.
func (z *Zone) validateTop() *FieldError {
	switch {
	case z.Top == 0 && z.TopWindow == 0:
		return nil
	case z.Top == 0:
		return z.fieldError("top_window", "top_window needs top: the number of clients a top keeps")
	case z.Top < 1 || z.Top > MaxTop:
		return z.fieldError("top", "top %d must be between 1 and %d entries", z.Top, MaxTop)
	case z.TopWindow < MinTopWindow || z.TopWindow > MaxTopWindow:
		return z.fieldError("top_window", "top_window %v must be between %v and %v", z.TopWindow, MinTopWindow, MaxTopWindow)
	case z.Lease != nil:
		return z.fieldError("top", "top excludes lease: a grant admits requests in process, where the script that counts them does not run")
	}
	return nil
}

// topBucket is the number of the time bucket of z's top that holds t.
func topBucket(z *Zone, t time.Time) int64 {
	w, us := z.TopWindow.Microseconds(), t.UnixMicro()
	return (us - ((us%w)+w)%w) / w
}

// topHashTag is the hash tag of the top keys written in one call with state key stateKey: on
// Redis Cluster a tag of the state key's slot (slotTags), else "top", one set per zone.
func (l *Limiter) topHashTag(stateKey string) string {
	if !l.cluster {
		return "top"
	}
	return slotTags()[hashSlot(stateKey)]
}

// topKey is the key of z's top of kind b in bucket under hash tag tag:
// `<prefix>{<tag>}:<zone>:top:<d|u>:<bucket>`.
func topKey(prefix, tag, zone string, b TopBy, bucket int64) string {
	return prefix + "{" + tag + "}:" + zone + ":top:" + b.tag() + ":" + strconv.FormatInt(bucket, 10)
}

// topKeys returns the denied and used keys of r's zone for the call sent at ref whose state key
// is stateKey, and their error keys (topErrorKey).
func (l *Limiter) topKeys(r *Request, stateKey string, ref time.Time) (denied, used, deniedErr, usedErr string) {
	tag, b := l.topHashTag(stateKey), topBucket(r.Zone, ref)
	denied, used = topKey(l.prefix, tag, r.Zone.Name, TopDenied, b), topKey(l.prefix, tag, r.Zone.Name, TopUsed, b)
	return denied, used, topErrorKey(denied), topErrorKey(used)
}

// topErrorKey is the key of the errors of the top set key: a hash, per member that took the place
// of another, the count it started from. `<top key>:e`, in the set's hash slot.
func topErrorKey(key string) string { return key + ":e" }

// slotTags returns, per Redis Cluster hash slot, the shortest tag "t<n>" that hashes to it.
var slotTags = sync.OnceValue(func() []string {
	tags := make([]string, slots)
	for n, left := 0, slots; left > 0; n++ {
		t := "t" + strconv.Itoa(n)
		if s := crc16(t) % slots; tags[s] == "" {
			tags[s], left = t, left-1
		}
	}
	return tags
})

// TopEntry is a client's count in a zone's top.
type TopEntry struct {
	// Client is the client part of the Redis keys (ClientKey's result; see ShownKey).
	Client string
	// Count is its denials or units in the current and previous buckets: never below its true
	// count, and above it by at most Error.
	Count int64
	// Error is how much of Count may not be the client's (Space-Saving's bound): the counts it
	// started from when it took the place of another client in a full set, and, for a bucket's
	// full set it is missing from, that set's lowest count (what it may have had there before it
	// lost its place, counted in Count too). 0: Count is exact.
	Error int64
}

// Guaranteed is the part of e's count that is certainly the client's: Count less Error.
func (e TopEntry) Guaranteed() int64 { return e.Count - e.Error }

// ReadTop returns the n clients (1 or more) with the highest counts of kind by in z's top, over
// the bucket holding the scripts' time (Redis TIME, or the Limiter's clock) and the one before,
// highest count first (ties by client), each with its error (TopEntry); and the start of the
// earlier bucket. It reads the two buckets' sets and their errors: one each, or on Redis Cluster
// one each per hash slot (65,536 reads, pipelined to the primaries that own them). It writes
// nothing.
func (l *Limiter) ReadTop(ctx context.Context, z *Zone, by TopBy, n int) (top []TopEntry, since time.Time, err error) {
	if z.Top <= 0 || n < 1 {
		return nil, time.Time{}, fmt.Errorf("zone %s: no top to read, or n %d < 1", z.Name, n)
	}
	now, err := l.scriptTime(ctx)
	if err != nil {
		return nil, time.Time{}, err
	}
	b := topBucket(z, now)
	tags := []string{"top"}
	if l.cluster {
		tags = slotTags()
	}
	type read struct {
		set  *redis.ZSliceCmd
		errs *redis.MapStringStringCmd
	}
	reads := make([]read, 0, 2*len(tags))
	p := l.rdb.Pipeline()
	for _, tag := range tags {
		for _, k := range []int64{b - 1, b} {
			key := topKey(l.prefix, tag, z.Name, by, k)
			reads = append(reads, read{p.ZRangeWithScores(ctx, key, 0, -1), p.HGetAll(ctx, topErrorKey(key))})
		}
	}
	if _, err := p.Exec(ctx); !replyError(err) {
		return nil, time.Time{}, fmt.Errorf("redis ZRANGE and HGETALL of %d top keys: %w", 2*len(reads), err)
	}
	var out []TopEntry
	for i := 0; i < len(reads); i += 2 { // one tag's two buckets: its clients are in no other tag's
		sets := make([]topSet, 2)
		for j := range sets {
			sets[j] = readTopSet(reads[i+j].set.Val(), reads[i+j].errs.Val(), z.Top)
		}
		out = append(out, mergeTop(sets)...)
	}
	return topN(out, n), time.UnixMicro((b - 1) * z.TopWindow.Microseconds()), nil
}

// topSet is one top set as read: per client its count and error, and the error of a client it
// does not hold (its lowest count when it is full, else 0: it never dropped anyone).
type topSet struct {
	counts, errs map[string]int64
	missing      int64
}

// readTopSet returns the top set of members (ascending, as ZRANGE gives them) and errors (its
// error hash) of a zone whose sets hold entries members.
func readTopSet(members []redis.Z, errs map[string]string, entries int) topSet {
	s := topSet{counts: make(map[string]int64, len(members)), errs: make(map[string]int64)}
	for _, e := range members {
		if m, ok := e.Member.(string); ok && e.Score > 0 {
			s.counts[m] = int64(e.Score)
			if v, err := strconv.ParseFloat(errs[m], 64); err == nil && v > 0 {
				s.errs[m] = min(int64(v), s.counts[m])
			}
		}
	}
	if len(members) >= entries && len(members) > 0 {
		s.missing = int64(members[0].Score)
	}
	return s
}

// mergeTop sums the counts and errors of each client of sets (the buckets of one hash slot's
// top); a set missing the client adds its missing error to both, so that the count stays an
// upper bound and the guaranteed count a lower one.
func mergeTop(sets []topSet) []TopEntry {
	seen := make(map[string]bool)
	var out []TopEntry
	for _, s := range sets {
		for c := range s.counts {
			if seen[c] {
				continue
			}
			seen[c] = true
			e := TopEntry{Client: c}
			for _, t := range sets {
				if k, ok := t.counts[c]; ok {
					e.Count += k
					e.Error += t.errs[c]
				} else { // it may have had up to the set's lowest count there
					e.Count += t.missing
					e.Error += t.missing
				}
			}
			out = append(out, e)
		}
	}
	return out
}

// topN returns the n entries of top with the highest counts, highest first, ties by client.
func topN(top []TopEntry, n int) []TopEntry {
	slices.SortFunc(top, func(a, b TopEntry) int {
		return cmp.Or(cmp.Compare(b.Count, a.Count), strings.Compare(a.Client, b.Client))
	})
	return top[:min(n, len(top))]
}
