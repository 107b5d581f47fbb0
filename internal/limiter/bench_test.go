package limiter

import (
	"strings"
	"testing"
	"time"
)

// The hot path's pieces, for allocs/op: go test -bench . -benchmem ./limiter/

func BenchmarkStateKeyVerbatim(b *testing.B) {
	z := &Zone{Name: "api", Algorithm: TokenBucket}
	for b.Loop() {
		_ = StateKey("rl:", z, "203.0.113.77")
	}
}

func BenchmarkStateKeyDigest(b *testing.B) {
	z := &Zone{Name: "api", Algorithm: TokenBucket}
	key := strings.Repeat("k", 200)
	for b.Loop() {
		_ = StateKey("rl:", z, key)
	}
}

func benchReqs(n int) []Request {
	reqs := make([]Request, n)
	for i := range reqs {
		reqs[i] = Request{Zone: &Zone{Name: "z", Algorithm: TokenBucket, Capacity: 100, RefillRate: 10}, Key: "203.0.113.77", Cost: 1}
	}
	reqs[n-1].Zone = &Zone{Name: "w", Algorithm: SlidingWindow, Limit: 5, Window: time.Minute}
	return reqs
}

func BenchmarkScriptArgs1Zone(b *testing.B) {
	l := New(nil, Options{KeyPrefix: "rl:"})
	reqs := benchReqs(1)
	for b.Loop() {
		_ = l.scriptArgs(reqs, false, time.Now())
	}
}

func BenchmarkScriptArgs3Zones(b *testing.B) {
	l := New(nil, Options{KeyPrefix: "rl:"})
	reqs := benchReqs(3)
	for b.Loop() {
		_ = l.scriptArgs(reqs, false, time.Now())
	}
}

func BenchmarkDecodeReply3Zones(b *testing.B) {
	reqs := benchReqs(3)
	reply := []any{int64(1), int64(1), int64(99), int64(0), int64(100000), int64(100000), int64(1), int64(98), int64(0), int64(200000), int64(100000),
		int64(1), int64(4), int64(0), int64(60000000), int64(12000000)}
	for b.Loop() {
		allowed, zones, err := decodeReply(reply, reqs, nil)
		if err != nil {
			b.Fatal(err)
		}
		_ = pick(reqs, allowed, zones)
	}
}

func BenchmarkDenyCacheHit(b *testing.B) {
	dc := newDenyCache(100, time.Second)
	reqs := benchReqs(1)
	now := time.Now()
	dc.record(reqs, []zoneReply{{retryAfter: 3_600_000_000, reset: 3_600_000_000, next: 3_600_000_000}}, now)
	for b.Loop() {
		if _, ok := dc.check(reqs, now); !ok {
			b.Fatal("miss")
		}
	}
}

// BenchmarkLeasePlanMixed: the in-process part of a request of a lease zone with a grant in hand
// and a concurrency zone decided in Redis: plan (its cost taken from the grant, pending until
// Redis answers), then kept (Redis admitted it). The rest is allowLeased's Redis round trip.
func BenchmarkLeasePlanMixed(b *testing.B) {
	t := newLeaseTable(nil)
	z := &Zone{Name: "a", Algorithm: TokenBucket, Capacity: 1 << 40, RefillRate: 1, Lease: &Lease{Max: 1 << 30, TTL: time.Hour}}
	reqs := []Request{{Zone: z, Key: "alice", Cost: 1}, {Zone: &Zone{Name: "c", Algorithm: Concurrency, Limit: 5}, Key: "alice", Cost: 1, Hold: time.Minute}}
	now := time.Now()
	t.m[zoneClientOf(reqs[0])] = &grant{units: 1 << 40, expires: now.Add(time.Hour), n: numbersOf(z), noRenew: true}
	for b.Loop() {
		p := t.plan(reqs, now, false)
		if p.n != 1 {
			b.Fatal("not taken from the grant")
		}
		t.kept(p)
	}
}

func BenchmarkEncodeDecision3Zones(b *testing.B) {
	l := New(nil, Options{KeyPrefix: "rl:"})
	reqs := benchReqs(3)
	state := stateKeys(l.prefix, reqs)
	b.ReportAllocs()
	for b.Loop() {
		_, _ = l.encodeDecision(reqs, state, false, time.Now())
	}
}
