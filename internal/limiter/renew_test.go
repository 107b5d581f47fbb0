package limiter

import (
	"testing"
	"time"
)

// TestLeaseRenewWhen: a grant asks for its successor when a quarter of its units, or of a token
// bucket's TTL, is left, sized as a grant less what it has left (the units held stay within
// Max); never near the limit, never twice at once, never for a window that ends first.
func TestLeaseRenewWhen(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	tb := &Zone{Name: "api", Algorithm: TokenBucket, Capacity: 1e6, RefillRate: 1, Lease: &Lease{Max: 100, TTL: time.Second}}
	fw := &Zone{Name: "api", Algorithm: FixedWindow, Limit: 1e6, Window: time.Hour, Lease: &Lease{Max: 100, TTL: time.Second}}
	cases := []struct {
		name   string
		z      *Zone
		units  int64
		spent  int64
		life   time.Duration // left until the grant expires
		end    bool          // a fixed window's grant that ends with its window
		remain int64         // Redis's remaining at grant time
		perTTL int64
		want   int32
		failed bool // its successor was denied, or failed
	}{
		{"more than a quarter of its units and TTL left", tb, 100, 74, time.Second, false, 1e5, 400, 0, false},
		{"a quarter of its units left", tb, 100, 75, time.Second, false, 1e5, 400, 75, false},
		{"a quarter of its units left, its successor denied or failed", tb, 100, 75, time.Second, false, 1e5, 400, 0, true},
		{"sized by the client's rate", tb, 40, 30, time.Second, false, 1e5, 8, 10, false},
		{"a quarter of its TTL left", tb, 40, 0, 250 * time.Millisecond, false, 1e5, 400, 60, false},
		{"Max held already", tb, 100, 0, 250 * time.Millisecond, false, 1e5, 400, 0, false},
		{"near the limit", tb, 100, 80, time.Second, false, 100, 400, 0, false},
		{"a client too slow to lease", tb, 10, 9, time.Second, false, 1e5, 1, 0, false},
		{"a fixed window's grant, units low", fw, 100, 80, time.Second, false, 1e5, 400, 80, false},
		{"a fixed window's grant ending with its window", fw, 40, 0, 100 * time.Millisecond, true, 1e5, 400, 0, false},
		{"a fixed window's grant ending before its window", fw, 40, 0, 100 * time.Millisecond, false, 1e5, 400, 60, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tab := newLeaseTable(nil)
			r := &Request{Zone: c.z, Key: "alice", Cost: 1}
			k := zoneClientOf(*r)
			g := &grant{units: c.units, spent: c.spent, expires: now.Add(c.life), remaining: c.remain, n: numbersOf(c.z), noRenew: c.failed}
			switch {
			case c.end:
				g.end = g.expires
			case c.z.Algorithm == FixedWindow:
				g.end = now.Add(time.Hour)
			}
			tab.m[k] = g
			if got := tab.renew(k, g, r, c.perTTL, now); got != c.want {
				t.Fatalf("renew asked %d, want %d", got, c.want)
			}
			if _, asking := tab.asking[k]; asking != (c.want > 0) {
				t.Fatalf("asking %v after renew asked %d", asking, c.want)
			}
			if c.want > 0 && tab.renew(k, g, r, c.perTTL, now) != 0 {
				t.Fatal("a second successor asked while the first is under way")
			}
		})
	}
}

// TestLeaseSuccessor: a successor in hand takes its grant's place once the grant cannot serve a
// request (spent, expired): the grant ends and is queued for its return. A reset ends both and
// gives them to its caller to return, and a sweep returns a successor that expired unused.
func TestLeaseSuccessor(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	z := &Zone{Name: "api", Algorithm: TokenBucket, Capacity: 1e6, RefillRate: 1, Lease: &Lease{Max: 100, TTL: time.Second}}
	r := &Request{Zone: z, Key: "alice", Cost: 1}
	k := zoneClientOf(*r)
	newGrants := func() (*leaseTable, *grant, *grant) {
		tab := newLeaseTable(nil)
		g := &grant{units: 40, spent: 40, expires: now.Add(time.Second), n: numbersOf(z)}
		next := &grant{units: 60, expires: now.Add(time.Second), n: numbersOf(z)}
		tab.m[k], tab.next[k] = g, next
		return tab, g, next
	}

	tab, g, next := newGrants()
	if got := tab.live(k, r, now); got != next {
		t.Fatalf("live gave %p, want the successor %p: its grant is spent", got, next)
	}
	if !g.ended || len(tab.ended) != 1 || tab.ended[0] != g || tab.m[k] != next || tab.next[k] != nil {
		t.Fatalf("after the successor took over: grant ended %v, queued %v, in place %v, successor %v",
			g.ended, tab.ended, tab.m[k] == next, tab.next[k])
	}

	tab, g, next = newGrants()
	g.spent = 10
	if got := tab.live(k, r, now); got != g {
		t.Fatal("a successor took the place of a grant that can still serve")
	}
	if got := tab.live(k, r, now.Add(time.Second)); got != nil {
		t.Fatal("an expired successor served a request")
	}
	if !g.ended || tab.m[k] != next {
		t.Fatal("an expired grant was not replaced by its successor")
	}

	tab, g, next = newGrants()
	tab.markAsking(k)
	gs := tab.drop(k.zone, k.client, 0)
	if !g.ended || !next.ended || tab.m[k] != nil || tab.next[k] != nil || len(tab.ended) != 0 {
		t.Fatal("a reset left a grant or its successor in hand, or queued one for the sweeper")
	}
	if len(gs) != 2 || gs[0] != g || gs[1] != next {
		t.Fatalf("a reset gave %v to return, want the grant and its successor", gs)
	}
	if a := tab.asking[k]; a == nil || !a.dropped {
		t.Fatal("a reset left a grant asked before it to be kept, or let another be asked before its answer")
	}

	tab, g, next = newGrants()
	g.spent = 0
	next.expires = now.Add(time.Millisecond)
	delete(tab.m, k) // the grant was ended and returned
	if got := tab.collect(now.Add(time.Millisecond), false); len(got) != 1 || got[0] != next {
		t.Fatalf("a sweep returned %v, want the expired successor", got)
	}
	if tab.next[k] != nil {
		t.Fatal("a successor returned by a sweep is still in hand")
	}
}
