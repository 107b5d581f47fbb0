package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func cc(name string, limit int64) *limiter.Zone {
	return &limiter.Zone{Name: name, Algorithm: limiter.Concurrency, Limit: limit}
}

// settleAll gives back every zone of d (amounts 0), failing the test on an error.
func settleAll(t *testing.T, l *limiter.Limiter, d limiter.Decision) {
	t.Helper()
	if _, err := l.Settle(context.Background(), d.Held, nil); err != nil {
		t.Fatalf("settle: %v", err)
	}
}

// TestConcurrencyAdmitsLimitInFlight: a concurrency zone of limit 3 admits 3 requests in flight,
// denies the 4th (Retry-After 1 s, nothing remaining, next 1 µs), and admits again once one
// is settled; the denial is not cached (a slot may come back at any moment), and a denial
// takes no slot.
func TestConcurrencyAdmitsLimitInFlight(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", DenyCacheKeys: 100})
	z := cc("conc", 3)
	req := limiter.Request{Zone: z, Key: "alice", Cost: 1, Hold: time.Minute}
	var held []limiter.Decision
	for i := int64(1); i <= 3; i++ {
		d := allow(t, l, req)
		if !d.Allowed || d.Remaining != 3-i || d.Held == nil || d.Limit != 3 {
			t.Fatalf("request %d: %+v, want allowed, remaining %d, held", i, d, 3-i)
		}
		held = append(held, d)
	}
	for i := range 2 {
		d := allow(t, l, req)
		if d.Allowed || d.Cached || d.Remaining != 0 || d.RetryAfter != time.Second || d.Next != time.Microsecond || d.Held != nil {
			t.Fatalf("denial %d: %+v, want denied by Redis (not cached), remaining 0, retry after 1s, next 1µs", i, d)
		}
	}
	key := limiter.StateKey("rl:", z, "alice")
	if n := srv.Do("ZCARD", key); n != int64(3) {
		t.Fatalf("slots after the denials: %v, want 3", n)
	}
	if l.LiveSlots() != 3 {
		t.Fatalf("slots kept alive: %d, want 3", l.LiveSlots())
	}
	settleAll(t, l, held[0])
	if n := srv.Do("ZCARD", key); n != int64(2) {
		t.Fatalf("slots after a settle: %v, want 2", n)
	}
	if d := allow(t, l, req); !d.Allowed || d.Remaining != 0 {
		t.Fatalf("after a settle: %+v, want allowed", d)
	}
	if _, err := l.Settle(context.Background(), held[0].Held, nil); !errors.Is(err, limiter.ErrNotHeld) {
		t.Fatalf("a second settle: %v, want ErrNotHeld", err)
	}
	if _, err := l.Allow(context.Background(), []limiter.Request{{Zone: z, Key: "alice", Cost: 1}}); err == nil {
		t.Fatal("a request without a Hold (its hold time) was decided")
	}
}

// TestConcurrencyAllOrNothing: a request whose other zone denies takes no slot, and a request
// denied by its concurrency zone charges no other zone.
func TestConcurrencyAllOrNothing(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	zc, zt := cc("conc", 1), tb("bucket", 2, 0.001)
	reqs := func() []limiter.Request {
		return []limiter.Request{{Zone: zc, Key: "alice", Cost: 1, Hold: time.Minute}, {Zone: zt, Key: "alice", Cost: 1}}
	}
	first := allow(t, l, reqs()...)
	if !first.Allowed {
		t.Fatalf("first: %+v", first)
	}
	if d := allow(t, l, reqs()...); d.Allowed || d.Zone != 0 {
		t.Fatalf("second, one in flight: %+v, want denied by the concurrency zone", d)
	}
	if u := srv.Do("HGET", limiter.StateKey("rl:", zt, "alice"), "u"); u != "1" {
		t.Fatalf("bucket after the concurrency denial: u = %v, want 1 (not charged)", u)
	}
	settleAll(t, l, first)
	allow(t, l, limiter.Request{Zone: zt, Key: "alice", Cost: 1}) // the bucket is now empty
	if d := allow(t, l, reqs()...); d.Allowed || d.Zone != 1 {
		t.Fatalf("with the bucket empty: %+v, want denied by it", d)
	}
	if n := srv.Do("ZCARD", limiter.StateKey("rl:", zc, "alice")); n != int64(0) {
		t.Fatalf("slots after the bucket's denial: %v, want 0", n)
	}
}

// TestConcurrencyHoldAndRefresh, on a settable clock: a slot not refreshed is free its hold time
// after it was taken (an instance that died); a slot refreshed by Refresh every third of its
// hold time is kept for 10 hold times and more, freed at once by its settlement, and never taken again
// by a refresh; a refresh that comes after a slot's deadline does not revive it.
func TestConcurrencyHoldAndRefresh(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	ctx := context.Background()
	hold := 9 * time.Second
	z := cc("conc", 1)
	req := limiter.Request{Zone: z, Key: "alice", Cost: 1, Hold: hold}
	key := limiter.StateKey("rl:", z, "alice")

	dead := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now}) // never refreshes nor settles
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	if d := allow(t, dead, req); !d.Allowed {
		t.Fatalf("dead instance's request: %+v", d)
	}
	clk.Advance(hold - time.Microsecond)
	if d := allow(t, l, req); d.Allowed {
		t.Fatalf("just before the dead slot's deadline: %+v, want denied", d)
	}
	clk.Advance(time.Microsecond)
	live := allow(t, l, req)
	if !live.Allowed {
		t.Fatalf("at the dead slot's deadline: %+v, want allowed", live)
	}
	if pttl := srv.Do("PTTL", key).(int64); pttl < hold.Milliseconds() || pttl > hold.Milliseconds()+1000 {
		t.Fatalf("key TTL %dms, want the hold time and a second at most", pttl)
	}
	if n, err := l.Refresh(ctx); n != 0 || err != nil {
		t.Fatalf("refresh before a third of the hold time: %d, %v; want nothing due", n, err)
	}
	for i := range 30 { // 30 × 3s = 10 hold times
		clk.Advance(hold / 3)
		if n, err := l.Refresh(ctx); n != 1 || err != nil {
			t.Fatalf("refresh %d: moved %d, %v; want 1", i, n, err)
		}
		if d := allow(t, dead, req); d.Allowed {
			t.Fatalf("after %v: %+v, want the refreshed slot still taken", time.Duration(i+1)*hold/3, d)
		}
	}
	settleAll(t, l, live)
	if n, err := l.Refresh(ctx); n != 0 || err != nil || l.LiveSlots() != 0 {
		t.Fatalf("refresh after the settle: %d, %v, %d tracked; want nothing", n, err, l.LiveSlots())
	}
	if n := srv.Do("EXISTS", key); n != int64(0) && srv.Do("ZCARD", key) != int64(0) {
		t.Fatalf("slots after the settle: %v", srv.Do("ZRANGE", key, 0, -1))
	}

	// A refresh that comes late (the instance lost Redis for a whole hold time) takes nothing back.
	late := allow(t, l, req)
	clk.Advance(hold)
	other := allow(t, dead, req) // the slot was free: another request took it
	if !late.Allowed || !other.Allowed {
		t.Fatalf("late: %+v, other: %+v", late, other)
	}
	if n, err := l.Refresh(ctx); n != 0 || err != nil {
		t.Fatalf("late refresh: moved %d, %v; want 0", n, err)
	}
	if n := srv.Do("ZCARD", key); n != int64(1) {
		t.Fatalf("slots after the late refresh: %v, want 1 (the other request's)", n)
	}
}

// TestConcurrencyMemoryBound: a client's key never holds more than limit slots, however many
// requests its instances abandon, and its size (MEMORY USAGE) with every slot taken, for limit
// 5 and 100, is logged for docs/decisions.md.
func TestConcurrencyMemoryBound(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	for _, limit := range []int64{5, 100} {
		z := cc("conc"+strconv.FormatInt(limit, 10), limit)
		key := limiter.StateKey("rl:", z, "alice")
		for round := range 5 {
			l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now}) // an instance that dies
			for range 2 * limit {
				allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1, Hold: 10 * time.Minute})
				if n := srv.Do("ZCARD", key).(int64); n > limit {
					t.Fatalf("limit %d, round %d: %d slots stored", limit, round, n)
				}
			}
			if n := srv.Do("ZCARD", key).(int64); n != limit {
				t.Fatalf("limit %d, round %d: %d slots, want %d", limit, round, n, limit)
			}
			clk.Advance(10 * time.Minute)
		}
		clk.Advance(-10 * time.Minute)
		mem := srv.Do("MEMORY", "USAGE", key, "SAMPLES", "0").(int64)
		t.Logf("limit %d: %d slots in flight, MEMORY USAGE %d bytes (%s)", limit, limit, mem, srv.Do("OBJECT", "ENCODING", key))
		if mem > 200*limit+200 {
			t.Errorf("limit %d: %d bytes, more than 200 a slot", limit, mem)
		}
	}
}

// TestConcurrencyCluster: on Redis Cluster, a request whose concurrency zone and token bucket
// zone are in different hash slots takes its slot (not a 5 s hold: its hold_max), which Settle
// gives back; a denial by the other slot releases the slot at once; Refresh moves on the slots
// of clients on different nodes.
func TestConcurrencyCluster(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	perNode := clientsOn(t, c, 1)
	alice, bob := perNode[0][0], perNode[1][0]
	zc, zt := cc("conc", 2), tb("plain", 2, 0.0001)
	l := clusterLimiter(t, c, limiter.Options{})
	reqs := []limiter.Request{{Zone: zc, Key: alice, Cost: 1, Hold: time.Hour}, {Zone: zt, Key: bob, Cost: 1}}
	d := allow(t, l, reqs...)
	if !d.Allowed || d.Held == nil {
		t.Fatalf("first request: %+v, want allowed with its slot held", d)
	}
	key := limiter.StateKey("rl:", zc, alice)
	score, err := c.Client().ZRangeWithScores(context.Background(), key, 0, -1).Result()
	if err != nil || len(score) != 1 || time.Until(time.UnixMicro(int64(score[0].Score))) < 50*time.Minute {
		t.Fatalf("slot after admission: %v %v, want one slot with an hour's deadline", score, err)
	}
	settleAll(t, l, d)
	if n := c.Client().ZCard(context.Background(), key).Val(); n != 0 {
		t.Fatalf("slots after settle: %d", n)
	}
	allow(t, l, reqs...) // takes a slot, empties the bucket
	if n := c.Client().ZCard(context.Background(), key).Val(); n != 1 {
		t.Fatalf("slots: %d, want 1", n)
	}
	if d := allow(t, l, reqs...); d.Allowed || d.Zone != 1 {
		t.Fatalf("with the bucket empty: %+v, want denied by it", d)
	}
	if n := c.Client().ZCard(context.Background(), key).Val(); n != 1 {
		t.Fatalf("slots after the other slot's denial: %d, want 1 (the denied request's released)", n)
	}
	if n, err := l.Refresh(context.Background()); err != nil || n != 0 {
		t.Fatalf("refresh: %d %v", n, err)
	}

	// One refresh moves the slots of clients on two nodes on, in one pipeline.
	clk := &clock{t: time.Now()}
	lc := clusterLimiter(t, c, limiter.Options{Now: clk.Now})
	z2 := cc("conc2", 1)
	for _, k := range []string{alice, bob} {
		if d := allow(t, lc, limiter.Request{Zone: z2, Key: k, Cost: 1, Hold: 3 * time.Second}); !d.Allowed {
			t.Fatalf("%s: %+v", k, d)
		}
	}
	clk.Advance(time.Second)
	if n, err := lc.Refresh(context.Background()); err != nil || n != 2 {
		t.Fatalf("refresh across nodes: moved %d, %v; want 2", n, err)
	}
	for _, k := range []string{alice, bob} {
		s := c.Client().ZRangeWithScores(context.Background(), limiter.StateKey("rl:", z2, k), 0, -1).Val()
		if len(s) != 1 || int64(s[0].Score) != clk.Now().Add(3*time.Second).UnixMicro() {
			t.Fatalf("%s's slot after the refresh: %v, want its deadline at now + 3s", k, s)
		}
	}
}

// TestLocalConcurrency: fail_mode local's in-process semaphore: limit requests in flight per
// client, per instance; Release gives a slot back; other clients are counted apart; a map of
// maxKeys clients in flight denies a new client rather than grow.
func TestLocalConcurrency(t *testing.T) {
	loc := limiter.NewLocal(2)
	z := cc("conc", 2)
	now := time.Now()
	req := func(k string) []limiter.Request {
		return []limiter.Request{{Zone: z, Key: k, Cost: 1, Hold: time.Minute}}
	}
	for i := range 2 {
		if d := loc.Allow(req("alice"), now); !d.Allowed || d.Remaining != int64(1-i) {
			t.Fatalf("alice %d: %+v", i, d)
		}
	}
	if d := loc.Allow(req("alice"), now); d.Allowed || d.RetryAfter != time.Second {
		t.Fatalf("alice 3: %+v, want denied, retry after 1s", d)
	}
	loc.Release(req("alice"))
	if d := loc.Allow(req("alice"), now); !d.Allowed {
		t.Fatalf("alice after a release: %+v", d)
	}
	if d := loc.Allow(req("bob"), now); !d.Allowed {
		t.Fatalf("bob: %+v", d)
	}
	if d := loc.Allow(req("carol"), now); d.Allowed {
		t.Fatalf("carol, 2 clients in flight of at most 2: %+v, want denied", d)
	}
	loc.Release(req("bob"))
	if d := loc.Allow(req("carol"), now); !d.Allowed {
		t.Fatalf("carol after bob's release: %+v", d)
	}
}

// TestConcurrencyZoneValidate: a concurrency zone takes a limit and nothing of time or cost but
// a max_wait (its queue), whose priority classes' shares add up to at most 100%.
func TestConcurrencyZoneValidate(t *testing.T) {
	for _, tc := range []struct {
		z    limiter.Zone
		want string
	}{
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 5}, ""},
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency}, "limit is required for algorithm concurrency"},
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 5, Window: time.Second}, "no window"},
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 5, MaxWait: time.Second}, ""},
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 5, MaxWait: time.Second, Classes: []int{0, 200}}, ""},
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 5, MaxWait: time.Second, Classes: []int{900, 200}}, "add up to 110%"},
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 5, MaxWait: time.Second, Classes: make([]int, 9)}, "at most 8"},
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 5, Classes: []int{0, 200}}, "need a queue"},
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 5, MaxWait: time.Second, Overrides: true}, "overrides do not apply"},
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 5, MaxWait: 2 * time.Minute}, "1m"},
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 5, MaxCost: 2}, "one slot"},
	} {
		err := tc.z.Validate()
		if got := fmt.Sprint(err); (tc.want == "") != (err == nil) || tc.want != "" && !strings.Contains(got, tc.want) {
			t.Errorf("%+v: %v, want %q", tc.z, err, tc.want)
		}
	}
}
