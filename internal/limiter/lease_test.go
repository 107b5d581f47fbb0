package limiter_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// leaseZone is a token bucket zone of capacity tokens that refills 1 token an hour (nothing,
// over a test), leasing up to max tokens per grant for ttl.
func leaseZone(capacity, max int64, ttl time.Duration) *limiter.Zone {
	return &limiter.Zone{Name: "api", Algorithm: limiter.TokenBucket, Capacity: capacity, RefillRate: 1.0 / 3600,
		Lease: &limiter.Lease{Max: max, TTL: ttl}}
}

// decideOne is the handler's way: from a grant in hand, else Allow. It reports whether the
// request was admitted, and whether from a grant.
func decideOne(ctx context.Context, l *limiter.Limiter, z *limiter.Zone, key string) (allowed, local bool, err error) {
	reqs := []limiter.Request{{Zone: z, Key: key, Cost: 1}}
	if d, ok := l.Leased(reqs); ok {
		return d.Allowed, true, nil
	}
	d, err := l.Allow(ctx, reqs)
	return d.Allowed, false, err
}

// asksAnswered waits until l has no grant asked and unanswered, such as a successor asked in
// the background (a grant renewed before it runs out): then its lease figures stand still.
func asksAnswered(t *testing.T, l *limiter.Limiter) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for l.LeaseAsks() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d grants asked and still unanswered", l.LeaseAsks())
		}
		time.Sleep(time.Millisecond)
	}
}

// burst sends n concurrent requests of key to each limiter, and returns how many were admitted.
func burst(t *testing.T, ls []*limiter.Limiter, z *limiter.Zone, key string, n int) int64 {
	t.Helper()
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for _, l := range ls {
		for range n {
			wg.Go(func() {
				ok, _, err := decideOne(context.Background(), l, z, key)
				if err != nil {
					t.Errorf("decision: %v", err)
				}
				if ok {
					admitted.Add(1)
				}
			})
		}
	}
	wg.Wait()
	return admitted.Load()
}

// bucketSettled waits until the client's bucket holds no hold (every grant returned, or
// committed), and returns its whole tokens left.
func bucketSettled(t *testing.T, srv *redistest.Server, z *limiter.Zone, key string) int64 {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if srv.Do("HEXISTS", limiter.StateKey("rl:", z, key), "h").(int64) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the bucket still has holds: %v", srv.Do("HGETALL", limiter.StateKey("rl:", z, key)))
		}
		time.Sleep(20 * time.Millisecond)
	}
	st, err := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"}).State(context.Background(), z, key)
	if err != nil {
		t.Fatal(err)
	}
	return st.Remaining
}

// warmUp sends n requests of key to each limiter one at a time (so that each sees the client's
// rate and holds a grant), and returns how many were admitted.
func warmUp(t *testing.T, ls []*limiter.Limiter, z *limiter.Zone, key string, n int) int64 {
	t.Helper()
	admitted := int64(0)
	for _, l := range ls {
		for range n {
			ok, _, err := decideOne(context.Background(), l, z, key)
			if err != nil {
				t.Fatal(err)
			}
			if ok {
				admitted++
			}
		}
	}
	return admitted
}

// burstsToTheLimit runs bursts of one client against ls until its limit is reached: a warm-up
// (warm requests per instance, one at a time) that gives each instance a grant, a burst of 400
// concurrent requests per instance that admits no more than limit, and, once its grants have
// ended and been returned (every unit not admitted back in Redis: left), the next bursts, until
// exactly limit have been admitted in all. After a warm-up, some must come from grants (a cold
// burst's requests mostly arrive before its first grant).
func burstsToTheLimit(t *testing.T, ls []*limiter.Limiter, z *limiter.Zone, limit int64, counts *leaseCounts, warm int, left func() int64) {
	t.Helper()
	total := warmUp(t, ls, z, "alice", warm)
	for i := 1; total < limit && i <= 2; i++ { // a second burst admits what the first's grants stranded
		n := burst(t, ls, z, "alice", 400)
		total += n
		if total > limit {
			t.Fatalf("burst %d: %d admitted in all, more than the limit of %d", i, total, limit)
		}
		l := left()
		t.Logf("burst %d: %d admitted, %d left once its grants were returned", i, n, l)
		if total+l != limit {
			t.Fatalf("after burst %d: %d admitted and %d left in Redis, want %d in all", i, total, l, limit)
		}
		// What a burst leaves was stranded in grants when the last requests were denied: at most
		// one grant of max per instance.
		if most := int64(len(ls)) * z.Lease.Max; l > most {
			t.Fatalf("after burst %d: %d left, more than the %d the instances' grants can hold", i, l, most)
		}
	}
	counts.mu.Lock()
	defer counts.mu.Unlock()
	if total != limit || (warm > 0 && counts.local.Load() == 0) {
		t.Fatalf("admitted %d in all (%d from grants %v), want exactly %d, some from grants after a warm-up", total, counts.local.Load(), counts.grants, limit)
	}
	t.Logf("%d admitted from grants; grants %v", counts.local.Load(), counts.grants)
}

// TestLeaseBurstThreeInstances: leases never admit more than the limit, and strand nothing for
// good. Three instances, one client, capacity 300, no refill to speak of, lease { max 50 ttl
// 1s }. A burst of 1,200 concurrent requests admits at most 300; once its grants have ended
// and been returned, the next bursts admit the rest: exactly 300 in all, and every unit not
// admitted is back in Redis. Cold (the burst is the client's first traffic: its grants grow
// during the burst) and warm (each instance holds a grant when the burst comes).
func TestLeaseBurstThreeInstances(t *testing.T) {
	t.Parallel()
	for _, warm := range []int{0, 10} {
		t.Run(fmt.Sprintf("warm-up %d", warm), func(t *testing.T) {
			srv := redistest.Start(t)
			z := leaseZone(300, 50, time.Second)
			counts := new(leaseCounts)
			ls := []*limiter.Limiter{fwInstance(t, srv, nil, counts), fwInstance(t, srv, nil, counts), fwInstance(t, srv, nil, counts)}
			burstsToTheLimit(t, ls, z, 300, counts, warm, func() int64 { return bucketSettled(t, srv, z, "alice") })
			if n := burst(t, ls, z, "alice", 100); n != 0 {
				t.Fatalf("a burst on an empty bucket admitted %d", n)
			}
		})
	}
}

// leaseCounts records a Limiter's lease events.
type leaseCounts struct {
	mu                        sync.Mutex
	grants                    []int64
	local, returned, stranded atomic.Int64
}

func (c *leaseCounts) Granted(_ string, units int64) {
	c.mu.Lock()
	c.grants = append(c.grants, units)
	c.mu.Unlock()
}
func (c *leaseCounts) Local(string)                   { c.local.Add(1) }
func (c *leaseCounts) Returned(_ string, units int64) { c.returned.Add(units) }
func (c *leaseCounts) Stranded(_ string, d int64)     { c.stranded.Add(d) }

// countedInstance returns a limiter that leases, decides on srv through a client of its own and
// counts its lease events; and the counts and the client.
func countedInstance(t *testing.T, srv *redistest.Server) (*limiter.Limiter, *leaseCounts, *redis.Client) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1, ContextTimeoutEnabled: true,
		ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { _ = c.Close() })
	p := limiter.NewBatcher(c, 1)
	t.Cleanup(p.Close)
	counts := new(leaseCounts)
	l := limiter.New(c, limiter.Options{KeyPrefix: "rl:", Batcher: p, Leases: true, LeaseMetrics: counts})
	t.Cleanup(func() { _ = l.ReturnLeases(context.Background()) })
	return l, counts, c
}

// drain sends requests of key to l one at a time until one is denied (or fails), and returns
// how many were admitted and how many of those from a grant.
func drain(t *testing.T, l *limiter.Limiter, z *limiter.Zone, key string) (admitted, local int) {
	t.Helper()
	for {
		ok, fromGrant, err := decideOne(context.Background(), l, z, key)
		if err != nil {
			t.Fatalf("decision: %v", err)
		}
		if !ok {
			if fromGrant {
				t.Fatal("a grant denied a request: denials are Redis's")
			}
			return admitted, local
		}
		admitted++
		if fromGrant {
			local++
		}
	}
}

// TestLeaseGrantsShrinkNearTheLimit: one hot instance draining a bucket of 10 with grants of up
// to 50 is granted at most half of what Redis has left each time (one request's cost when that
// is less), admits exactly 10, and its denial comes from Redis's count (Allow, remaining 0), not
// from a grant.
func TestLeaseGrantsShrinkNearTheLimit(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	z := leaseZone(10, 50, 10*time.Second)
	l, counts, _ := countedInstance(t, srv)
	admitted, local := drain(t, l, z, "alice")
	if admitted != 10 || local == 0 {
		t.Fatalf("admitted %d (%d from grants), want exactly 10, some from grants", admitted, local)
	}
	d, err := l.Allow(context.Background(), []limiter.Request{{Zone: z, Key: "alice", Cost: 1}})
	if err != nil || d.Allowed || d.Cached || d.Remaining != 0 {
		t.Fatalf("Allow on the drained bucket: %+v, %v; want Redis's denial with 0 remaining", d, err)
	}
	left := int64(10)
	counts.mu.Lock()
	defer counts.mu.Unlock()
	for _, g := range counts.grants {
		// A grant is asked after the exact requests that showed the rate: left is at most what
		// Redis had when it granted.
		if g > max(1, left/2) {
			t.Errorf("grants %v: %d granted with at most %d left in Redis, more than half", counts.grants, g, left)
		}
		left -= g
	}
	if len(counts.grants) < 3 {
		t.Errorf("grants %v: want them to shrink over at least 3 grants", counts.grants)
	}
}

// TestLeaseDenialIsRedisCount: another instance's grant holds tokens in Redis, so a second
// instance is denied when Redis's count (grants included) has no room, and never before; once
// the grant ends, its unspent tokens are returned, and the second instance gets exactly them.
func TestLeaseDenialIsRedisCount(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	z := leaseZone(40, 8, 500*time.Millisecond)
	a, ca, _ := countedInstance(t, srv)
	b, _, _ := countedInstance(t, srv)
	for range 3 { // a hot client on a: it is granted tokens it will not spend
		if ok, _, err := decideOne(context.Background(), a, z, "alice"); !ok || err != nil {
			t.Fatalf("a: %v, %v", ok, err)
		}
	}
	asksAnswered(t, a)
	ca.mu.Lock()
	granted := append([]int64(nil), ca.grants...)
	ca.mu.Unlock()
	if len(granted) == 0 {
		t.Fatal("a hot client was granted nothing")
	}
	held := ca.stranded.Load() // a's grant, unspent
	nb, _ := drain(t, b, z, "alice")
	if int64(nb) != 40-3-held {
		t.Fatalf("b admitted %d with %d held by a's grant: want %d, Redis's count exactly", nb, held, 40-3-held)
	}
	// a's grant ends and is returned: b gets exactly what a did not spend.
	if left := bucketSettled(t, srv, z, "alice"); left != held {
		t.Fatalf("after a's grant ended, %d left in Redis, want its %d unspent tokens", left, held)
	}
	if ca.returned.Load() != held {
		t.Fatalf("returned_units %d, want %d", ca.returned.Load(), held)
	}
	nb2, _ := drain(t, b, z, "alice")
	if int64(nb2) != held {
		t.Fatalf("b admitted %d more, want the %d returned", nb2, held)
	}
}

// TestLeaseRenewedBeforeItRunsOut: a hot client's grant asks for its successor before it runs
// out, so that once the client has a grant, every one of its requests is admitted in process,
// none waiting for Redis; the units this instance holds for it (the grant's left and the
// successor's) never exceed max; and Redis has charged exactly what was admitted once they are
// returned.
func TestLeaseRenewedBeforeItRunsOut(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	z := leaseZone(100000, 20, 10*time.Second)
	l, counts, _ := countedInstance(t, srv)
	admitted, exact := 0, 0
	for range 300 {
		ok, fromGrant, err := decideOne(context.Background(), l, z, "alice")
		if !ok || err != nil {
			t.Fatalf("request %d: %v, %v", admitted+1, ok, err)
		}
		admitted++
		if !fromGrant {
			if counts.local.Load() > 0 {
				t.Fatalf("request %d was decided in Redis after %d from grants: its grant ran out before its successor came", admitted, counts.local.Load())
			}
			exact++
		}
		asksAnswered(t, l) // the successor asked, if any, is in hand before the next request
		if held := counts.stranded.Load(); held > z.Lease.Max {
			t.Fatalf("after request %d: %d units held, more than max %d", admitted, held, z.Lease.Max)
		}
	}
	counts.mu.Lock()
	grants := len(counts.grants)
	counts.mu.Unlock()
	if exact > 3 || grants < 300/20 {
		t.Fatalf("%d requests decided in Redis and %d grants, want the first few and at least 15", exact, grants)
	}
	if err := l.ReturnLeases(context.Background()); err != nil {
		t.Fatal(err)
	}
	if left := bucketSettled(t, srv, z, "alice"); left != 100000-int64(admitted) {
		t.Fatalf("%d left in Redis after %d admitted and the grants returned, want %d", left, admitted, 100000-admitted)
	}
}

// TestLeaseRenewalFailsOnce: with Redis stopped, a grant whose successor's call failed asks for
// none again while it lasts: its client's requests are still admitted from it, with no call
// each past the handler's circuit breaker.
func TestLeaseRenewalFailsOnce(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	z := leaseZone(100000, 40, 10*time.Second)
	l, counts, _ := countedInstance(t, srv)
	for i := 0; counts.stranded.Load() < 30; i++ { // a grant of about 40 in hand
		if ok, _, err := decideOne(context.Background(), l, z, "alice"); !ok || err != nil || i > 200 {
			t.Fatalf("request %d: %v, %v (%d in hand)", i, ok, err, counts.stranded.Load())
		}
		asksAnswered(t, l)
	}
	srv.Pause()
	defer srv.Resume()
	spend := func() {
		t.Helper()
		if ok, fromGrant, err := decideOne(context.Background(), l, z, "alice"); !ok || !fromGrant || err != nil {
			t.Fatalf("with Redis stopped: admitted %v from a grant %v, %v", ok, fromGrant, err)
		}
	}
	for i := 0; l.LeaseAsks() == 0; i++ {
		if i > 60 {
			t.Fatal("no successor asked while a grant of at most 40 was spent")
		}
		spend()
	}
	asksAnswered(t, l) // the call fails at its timeout
	for counts.stranded.Load() > 0 {
		spend()
		if n := l.LeaseAsks(); n != 0 {
			t.Fatalf("a grant whose successor failed asked for one again (%d under way)", n)
		}
	}
}

// TestLeaseReturnLeases: retiring a Limiter (a reload's Cleanup) gives its grants' unspent
// tokens back to Redis at once, not after their TTL.
func TestLeaseReturnLeases(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	z := leaseZone(100, 50, time.Minute)
	a, ca, _ := countedInstance(t, srv)
	for range 5 {
		if ok, _, err := decideOne(context.Background(), a, z, "alice"); !ok || err != nil {
			t.Fatalf("a: %v, %v", ok, err)
		}
	}
	asksAnswered(t, a)
	if ca.stranded.Load() == 0 {
		t.Fatal("no grant in hand")
	}
	if err := a.ReturnLeases(context.Background()); err != nil {
		t.Fatal(err)
	}
	key := limiter.StateKey("rl:", z, "alice")
	if h := srv.Do("HGET", key, "h"); h != nil {
		t.Fatalf("holds left after ReturnLeases: %v", srv.Do("HGETALL", key))
	}
	st, err := a.State(context.Background(), z, "alice")
	if err != nil || st.Remaining != 95 {
		t.Fatalf("after ReturnLeases: %d left (%v), want 95: only the 5 admitted spent", st.Remaining, err)
	}
	if ok, fromGrant, err := decideOne(context.Background(), a, z, "alice"); !ok || fromGrant || err != nil {
		t.Fatalf("a retired Limiter: %v from a grant %v, %v; want decided in Redis", ok, fromGrant, err)
	}
}

// TestLeaseResetDropsGrants: an admin reset on one instance makes the others drop their grants
// of the key (the reset broadcast): the client then gets the capacity once, never a grant from
// before the reset on top of it.
func TestLeaseResetDropsGrants(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	z := leaseZone(30, 10, time.Minute)
	a, ca, ac := countedInstance(t, srv)
	b, _, _ := countedInstance(t, srv)
	rl := limiter.NewResetListener(ac)
	t.Cleanup(func() { _ = rl.Close() })
	rl.Add(a)
	for range 4 {
		if ok, _, err := decideOne(context.Background(), a, z, "alice"); !ok || err != nil {
			t.Fatalf("a: %v, %v", ok, err)
		}
	}
	asksAnswered(t, a)
	if ca.stranded.Load() == 0 {
		t.Fatal("no grant in hand")
	}
	// The subscription is made in the background: reset until a hears it.
	deadline := time.Now().Add(5 * time.Second)
	for ca.stranded.Load() != 0 {
		if _, err := b.Reset(context.Background(), z, "alice"); err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatal("a kept its grant after the reset")
		}
		time.Sleep(20 * time.Millisecond)
	}
	na, _ := drain(t, a, z, "alice")
	nb, _ := drain(t, b, z, "alice")
	if na+nb > 30 {
		t.Fatalf("after the reset a admitted %d and b %d: more than the capacity of 30", na, nb)
	}
	if left := bucketSettled(t, srv, z, "alice"); int64(na+nb)+left != 30 {
		t.Fatalf("after the reset: %d admitted, %d left: want 30 in all", na+nb, left)
	}
}

// TestLeaseRedisStalled: while Redis is stopped (SIGSTOP), a grant in hand is spent until it
// ends, and not beyond: then the decision fails (and the handler's fail_mode applies). After
// a restart that lost Redis's state, the client is admitted at most the capacity plus the grant
// in hand (the bound of a state loss: N × max per key).
func TestLeaseRedisStalled(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	z := leaseZone(1000, 20, 2*time.Second)
	a, ca, _ := countedInstance(t, srv)
	spent := 0
	for ca.stranded.Load() < 10 {
		if ok, _, err := decideOne(context.Background(), a, z, "alice"); !ok || err != nil {
			t.Fatalf("a: %v, %v", ok, err)
		}
		if spent++; spent > 100 {
			t.Fatal("no grant with 10 tokens left")
		}
	}
	asksAnswered(t, a)
	inHand := ca.stranded.Load()
	srv.Pause()
	local, failed := int64(0), false
	for !failed {
		ok, fromGrant, err := decideOne(context.Background(), a, z, "alice")
		switch {
		case err != nil:
			failed = true
		case !ok || !fromGrant:
			t.Fatalf("with Redis stopped: admitted %v from a grant %v", ok, fromGrant)
		default:
			local++
		}
	}
	srv.Resume()
	if local != inHand {
		t.Fatalf("with Redis stopped, %d admitted from the grant, want its %d tokens, then failures", local, inHand)
	}
	// A grant of more than it will spend: stopped, it is spent until its TTL ends, not beyond.
	deadline := time.Now().Add(10 * time.Second)
	for ca.stranded.Load() < 10 {
		if ok, _, err := decideOne(context.Background(), a, z, "alice"); err == nil && !ok {
			t.Fatal("denied")
		}
		if time.Now().After(deadline) {
			t.Fatal("no new grant after Redis resumed")
		}
	}
	asksAnswered(t, a)
	srv.Pause()
	if ok, fromGrant, err := decideOne(context.Background(), a, z, "alice"); !ok || !fromGrant || err != nil {
		t.Fatalf("with Redis stopped and a grant in hand: %v from the grant %v, %v", ok, fromGrant, err)
	}
	time.Sleep(z.Lease.TTL) // the grant's end
	if ok, fromGrant, err := decideOne(context.Background(), a, z, "alice"); ok || fromGrant || err == nil {
		t.Fatalf("with Redis stopped and the grant's TTL over: %v from the grant %v, %v; want the failure", ok, fromGrant, err)
	}
	srv.Resume()
	// A restart loses the state while a new grant is in hand.
	for ca.stranded.Load() < 10 {
		if ok, _, err := decideOne(context.Background(), a, z, "alice"); err == nil && !ok {
			t.Fatal("denied")
		}
		if time.Now().After(deadline) {
			t.Fatal("no new grant after Redis resumed")
		}
	}
	asksAnswered(t, a)
	inHand = ca.stranded.Load()
	srv.Restart()
	after := int64(0)
	for time.Now().Before(deadline.Add(10 * time.Second)) {
		ok, _, err := decideOne(context.Background(), a, z, "alice")
		if err != nil {
			continue // the restart broke the pool's connections: go-redis dials again
		}
		if !ok {
			break
		}
		after++
	}
	if after > 1000+inHand {
		t.Fatalf("after a restart that lost the state, %d admitted: more than the capacity and the %d in hand", after, inHand)
	}
	if after < 1000 {
		t.Fatalf("after the restart, %d admitted, want the capacity of 1000 at least", after)
	}
}

// TestLeaseRareClientsNeverLease: 10,000 clients of a lease zone sending a request each (the
// allowed scenario's load) are decided exactly as without lease: one script call each, no grant.
func TestLeaseRareClientsNeverLease(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	z := leaseZone(1000, 200, 250*time.Millisecond)
	l, counts, _ := countedInstance(t, srv)
	if _, _, err := decideOne(context.Background(), l, z, "warm-up"); err != nil { // loads the script
		t.Fatal(err)
	}
	calls := srv.ScriptCalls()
	for i := range 10_000 {
		ok, fromGrant, err := decideOne(context.Background(), l, z, "client"+strconv.Itoa(i))
		if !ok || fromGrant || err != nil {
			t.Fatalf("client %d: %v from a grant %v, %v", i, ok, fromGrant, err)
		}
	}
	if n := srv.ScriptCalls() - calls; n != 10_000 {
		t.Fatalf("%d script calls for 10,000 rare clients, want one each", n)
	}
	counts.mu.Lock()
	defer counts.mu.Unlock()
	if len(counts.grants) != 0 || counts.local.Load() != 0 {
		t.Fatalf("rare clients were granted %v and admitted %d from grants", counts.grants, counts.local.Load())
	}
}

// TestLeaseOnCluster: on Redis Cluster a lease zone alone is granted and spent as on one server;
// a request of a lease zone with a grant in hand and a zone of another hash slot stays
// all-or-nothing: when the other zone denies, the unit taken from the grant is given back.
func TestLeaseOnCluster(t *testing.T) {
	t.Parallel()
	cc := oneNodeCluster(t)
	p := limiter.NewBatcher(cc, 1)
	t.Cleanup(p.Close)
	l := limiter.New(cc, limiter.Options{KeyPrefix: "rl:", Batcher: p, Cluster: true, Leases: true})
	t.Cleanup(func() { _ = l.ReturnLeases(context.Background()) })
	z := leaseZone(50, 10, 10*time.Second)
	admitted, local := drain(t, l, z, "alice")
	if admitted != 50 || local == 0 {
		t.Fatalf("one zone on a cluster: admitted %d (%d from grants), want exactly 50, some from grants", admitted, local)
	}
	org := &limiter.Zone{Name: "org", Algorithm: limiter.TokenBucket, Capacity: 3, RefillRate: 1.0 / 3600}
	z2 := leaseZone(1000, 10, 10*time.Second)
	z2.Name = "api2"
	for range 20 { // bob is hot: a grant of 10 in hand
		if ok, _, err := decideOne(context.Background(), l, z2, "bob"); !ok || err != nil {
			t.Fatalf("bob: %v, %v", ok, err)
		}
	}
	n := 0
	for ; n < 100; n++ {
		reqs := []limiter.Request{{Zone: z2, Key: "bob", Cost: 1}, {Zone: org, Key: "org1", Cost: 1}}
		d, err := l.Allow(context.Background(), reqs)
		if err != nil {
			t.Fatal(err)
		}
		if !d.Allowed {
			break
		}
	}
	if n != 3 {
		t.Fatalf("two zones: %d admitted, want the org's 3", n)
	}
	// The denied request's unit taken from bob's grant was given back: returned, bob's bucket
	// has been charged exactly the 23 admitted.
	if err := l.ReturnLeases(context.Background()); err != nil {
		t.Fatal(err)
	}
	st, err := l.State(context.Background(), z2, "bob")
	if err != nil || st.Remaining != 1000-23 {
		t.Fatalf("the lease zone has %d left (%v), want 977: charged only for the 23 admitted", st.Remaining, err)
	}
}

// windowClock is a clock that runs as the real one from at, for `clock local` Limiters.
func windowClock(at time.Time) func() time.Time {
	start := time.Now()
	return func() time.Time { return at.Add(time.Since(start)) }
}

// fwInstance is a Limiter on its own client and batcher, on clock now. Its grants' returns
// share the round trips of a burst's decisions: they get 2s (CallTimeout), not the default
// 100ms that a loaded test machine can exceed, so that the tests see every grant returned.
func fwInstance(t *testing.T, srv *redistest.Server, now func() time.Time, m limiter.LeaseMetrics) *limiter.Limiter {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	p := limiter.NewBatcher(c, 1)
	t.Cleanup(p.Close)
	l := limiter.New(c, limiter.Options{KeyPrefix: "rl:", Batcher: p, Leases: true, LeaseMetrics: m, Now: now, CallTimeout: 2 * time.Second})
	t.Cleanup(func() { _ = l.ReturnLeases(context.Background()) })
	return l
}

// fwLeft waits until the client's window has no grant record pending (every grant returned) and
// returns the window's slots left.
func fwLeft(t *testing.T, srv *redistest.Server, l *limiter.Limiter, z *limiter.Zone, key string) int64 {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	pattern := limiter.StateKey("rl:", z, key) + ":*.*" // records: <state key>:<nonce>
	for len(srv.Do("KEYS", pattern).([]any)) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("grant records left: %v", srv.Do("KEYS", pattern))
		}
		time.Sleep(20 * time.Millisecond)
	}
	st, err := l.State(context.Background(), z, key)
	if err != nil {
		t.Fatal(err)
	}
	return st.Remaining
}

// TestLeaseFixedWindowBurst: the three-instance bursts on a fixed window of 300 per hour, in
// the middle of the window.
func TestLeaseFixedWindowBurst(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	now := windowClock(time.Now().Truncate(time.Hour).Add(30 * time.Minute))
	z := &limiter.Zone{Name: "api", Algorithm: limiter.FixedWindow, Limit: 300, Window: time.Hour, Lease: &limiter.Lease{Max: 50, TTL: time.Second}}
	counts := new(leaseCounts)
	ls := []*limiter.Limiter{fwInstance(t, srv, now, counts), fwInstance(t, srv, now, counts), fwInstance(t, srv, now, counts)}
	burstsToTheLimit(t, ls, z, 300, counts, 10, func() int64 { return fwLeft(t, srv, ls[0], z, "alice") })
}

// TestLeaseFixedWindowGrantEndsWithItsWindow: a grant made 300ms before its window ends is not
// spent after it: the next window's requests are decided on the next window's count, which
// admits exactly its limit.
func TestLeaseFixedWindowGrantEndsWithItsWindow(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	now := windowClock(time.Now().Truncate(time.Hour).Add(time.Hour - 300*time.Millisecond))
	z := &limiter.Zone{Name: "api", Algorithm: limiter.FixedWindow, Limit: 100, Window: time.Hour, Lease: &limiter.Lease{Max: 40, TTL: time.Minute}}
	counts := new(leaseCounts)
	l := fwInstance(t, srv, now, counts)
	for range 5 {
		if ok, _, err := decideOne(context.Background(), l, z, "alice"); !ok || err != nil {
			t.Fatalf("%v, %v", ok, err)
		}
	}
	asksAnswered(t, l)
	if counts.stranded.Load() == 0 {
		t.Fatal("no grant in hand")
	}
	for !now().After(now().Truncate(time.Hour)) || now().Sub(now().Truncate(time.Hour)) > time.Minute {
		time.Sleep(10 * time.Millisecond) // the window's end
	}
	if _, fromGrant, err := decideOne(context.Background(), l, z, "alice"); fromGrant || err != nil {
		t.Fatalf("after its window's end, a request was admitted from the grant of the window before (%v)", err)
	}
	n, _ := drain(t, l, z, "alice")
	if n+1 != 100 {
		t.Fatalf("the next window admitted %d, want exactly its limit of 100", n+1)
	}
}

// heldCalls holds, when armed, the next script call whose arguments name a concurrency zone
// ("cc") before it is sent, until released: a decision that Redis answers late, as under load. It
// is a go-redis hook on the Limiter's client; the calls it lets through reach a real Redis.
type heldCalls struct {
	armed   atomic.Bool
	held    chan struct{} // receives when a call is held
	release chan struct{}
}

func (h *heldCalls) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *heldCalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *heldCalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if slices.Contains(cmd.Args(), any("cc")) && h.armed.CompareAndSwap(true, false) {
			h.held <- struct{}{}
			<-h.release
		}
		return next(ctx, cmd)
	}
}

// TestLeaseGivenBackAfterItsGrantEnded: a request of a lease zone and a concurrency zone takes
// its cost from the client's grant; the concurrency zone goes to Redis, whose answer comes after
// the grant has ended (its ttl passed) and is a denial. The cost is given back all the same: the
// grant's return waits for it, and the bucket is charged exactly the admitted requests.
func TestLeaseGivenBackAfterItsGrantEnded(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	gate := &heldCalls{held: make(chan struct{}), release: make(chan struct{})}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1})
	rdb.AddHook(gate)
	t.Cleanup(func() { _ = rdb.Close() })
	counts := new(leaseCounts)
	l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Leases: true, LeaseMetrics: counts, Now: clk.Now})
	t.Cleanup(func() { _ = l.ReturnLeases(context.Background()) })
	zc, zt := cc("conc", 1), leaseZone(100, 10, time.Second)
	reqs := func() []limiter.Request {
		return []limiter.Request{{Zone: zc, Key: "alice", Cost: 1, Hold: time.Minute}, {Zone: zt, Key: "alice", Cost: 1}}
	}
	admitted := int64(0)
	for counts.local.Load() == 0 { // until the bucket's cost comes from a grant
		if admitted == 20 {
			t.Fatal("20 requests and no grant spent")
		}
		d := allow(t, l, reqs()...)
		if !d.Allowed {
			t.Fatalf("request %d: %+v, want admitted", admitted+1, d)
		}
		admitted++
		settleAll(t, l, d)
	}
	inFlight := allow(t, l, reqs()...) // holds the client's one slot
	if !inFlight.Allowed {
		t.Fatalf("the request in flight: %+v, want admitted", inFlight)
	}
	admitted++
	asksAnswered(t, l)

	gate.armed.Store(true)
	denied := make(chan limiter.Decision, 1)
	go func() {
		d, err := l.Allow(context.Background(), reqs())
		if err != nil {
			t.Error(err)
		}
		denied <- d
	}()
	// Its cost is taken from the grant; its concurrency zone waits for Redis. The grant's ttl
	// passes meanwhile (by less than the 0.5s its return may wait).
	<-gate.held
	clk.Advance(1200 * time.Millisecond)
	redistest.WaitFor(t, 5*time.Second, "the grant ended (its ttl passed)", func() bool { return counts.stranded.Load() == 0 })
	close(gate.release)
	if d := <-denied; d.Allowed || d.Zone != 0 {
		t.Fatalf("with the slot taken: %+v, want denied by the concurrency zone", d)
	}
	settleAll(t, l, inFlight)
	redistest.WaitFor(t, 5*time.Second, "every grant returned", func() bool {
		return srv.Do("HEXISTS", limiter.StateKey("rl:", zt, "alice"), "h").(int64) == 0
	})
	st, err := l.State(context.Background(), zt, "alice") // on the Limiter's clock, as the bucket
	if err != nil {
		t.Fatal(err)
	}
	if admitted+st.Remaining != zt.Capacity {
		t.Fatalf("%d admitted and %d left in Redis, want %d in all: the denied request was charged", admitted, st.Remaining, zt.Capacity)
	}
}
