package limiter

import (
	"testing"
	"time"
)

// TestLeasedObservesOnce: a request served from a grant counts once in its client's observed
// rate (what sizes its next grants): Leased counts it; the grant Allow spends for a request Redis
// denied (allowLeased's plan counted it already) does not count it again.
func TestLeasedObservesOnce(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	l := New(nil, Options{Leases: true, Now: func() time.Time { return now }})
	z := &Zone{Name: "api", Algorithm: TokenBucket, Capacity: 1000, RefillRate: 1, Lease: &Lease{Max: 100, TTL: time.Second}}
	reqs := []Request{{Zone: z, Key: "alice", Cost: 3}}
	k := zoneClientOf(reqs[0])
	l.leases.m[k] = &grant{name: z.Name, n: numbersOf(z), units: 100, expires: now.Add(time.Second), remaining: 500}
	observed := func() int64 {
		l.leases.mu.Lock()
		defer l.leases.mu.Unlock()
		return l.leases.observe(k, &Request{Zone: z, Key: "alice", Cost: 0}, now) // adds nothing
	}
	if _, ok := l.Leased(reqs); !ok {
		t.Fatal("Leased did not serve the request from its client's grant")
	}
	if got := observed(); got != 3 {
		t.Fatalf("after Leased: observed %d units, want 3 (the request's cost)", got)
	}
	if _, ok := l.leased(reqs, false); !ok {
		t.Fatal("leased did not serve the request from its client's grant")
	}
	if got := observed(); got != 3 {
		t.Fatalf("after a denied request served from a grant: observed %d units, want still 3", got)
	}
	if g := l.leases.m[k]; g.spent != 6 {
		t.Fatalf("the grant's spent is %d, want 6: both requests took their cost from it", g.spent)
	}
}
