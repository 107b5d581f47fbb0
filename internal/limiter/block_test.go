package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// blocked decides one request of cost 1 of key in z and fails unless the block refused it
// (Decision.Blocked) with a Retry-After of exactly retry.
func blocked(t *testing.T, step string, l *limiter.Limiter, z *limiter.Zone, key string, retry time.Duration) {
	t.Helper()
	reqs := []limiter.Request{{Zone: z, Key: key, Cost: 1}}
	d := allow(t, l, reqs...)
	if d.Allowed || !d.Blocked || d.RetryAfter != retry || d.Remaining != 0 || !reqs[0].Result.Blocked {
		t.Fatalf("%s: %+v (result %+v), want refused by the block, retry after %v", step, d, reqs[0].Result, retry)
	}
}

// TestBlockEveryAlgorithm: in each algorithm that takes a block, the denial that goes over the
// limit starts the block in the same call, and after the zone has room again (refilled, the
// window past) the client is still refused, with Retry-After the block's remaining time, until
// the block ends; then the algorithm decides again.
func TestBlockEveryAlgorithm(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	for _, z := range []*limiter.Zone{
		{Name: "tb", Algorithm: limiter.TokenBucket, Capacity: 2, RefillRate: 2},
		{Name: "sw", Algorithm: limiter.SlidingWindow, Limit: 2, Window: time.Second},
		{Name: "fw", Algorithm: limiter.FixedWindow, Limit: 2, Window: time.Second},
		{Name: "sc", Algorithm: limiter.SlidingWindowCounter, Limit: 2, Window: time.Second},
	} {
		t.Run(z.Name, func(t *testing.T) {
			clk := newClock()
			l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
			z.Block = 10 * time.Second
			for i := range 2 {
				if d := allow(t, l, limiter.Request{Zone: z, Key: "mallory", Cost: 1}); !d.Allowed || d.Blocked {
					t.Fatalf("request %d: %+v, want admitted", i+1, d)
				}
			}
			reqs := []limiter.Request{{Zone: z, Key: "mallory", Cost: 1}}
			d := allow(t, l, reqs...)
			if d.Allowed || d.Blocked || d.RetryAfter != 10*time.Second || !reqs[0].Result.BlockStarted || reqs[0].Result.Next != 10*time.Second {
				t.Fatalf("over the limit: %+v (result %+v), want denied, a block of 10s started", d, reqs[0].Result)
			}
			clk.Advance(3 * time.Second) // the zone has room again
			blocked(t, "3s later", l, z, "mallory", 7*time.Second)
			if d := allow(t, l, limiter.Request{Zone: z, Key: "trent", Cost: 1}); !d.Allowed {
				t.Fatalf("another client: %+v, want admitted", d)
			}
			clk.Advance(7*time.Second - time.Microsecond)
			blocked(t, "1µs before the end", l, z, "mallory", time.Microsecond)
			clk.Advance(time.Microsecond)
			if d := allow(t, l, limiter.Request{Zone: z, Key: "mallory", Cost: 1}); !d.Allowed {
				t.Fatalf("after the block: %+v, want admitted", d)
			}
		})
	}
}

// TestBlockChargesNoZone: a request refused by one zone's block charges none of its other
// zones (all-or-nothing), and the denial that starts a block charges none either.
func TestBlockChargesNoZone(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	login := &limiter.Zone{Name: "login", Algorithm: limiter.SlidingWindow, Limit: 1, Window: time.Minute, Block: time.Hour}
	api := tb("api", 100, 1)
	both := func() []limiter.Request {
		return []limiter.Request{{Zone: api, Key: "mallory", Cost: 1}, {Zone: login, Key: "mallory", Cost: 1}}
	}
	if d := allow(t, l, both()...); !d.Allowed {
		t.Fatalf("first: %+v", d)
	}
	reqs := both()
	if d := allow(t, l, reqs...); d.Allowed || d.Zone != 1 || !reqs[1].Result.BlockStarted || reqs[1].Result.Next != time.Hour || d.RetryAfter != time.Hour {
		t.Fatalf("second: %+v (results %+v), want the block of login started", d, reqs)
	}
	for i := range 5 {
		reqs = both()
		d := allow(t, l, reqs...)
		if d.Allowed || !d.Blocked || d.Zone != 1 {
			t.Fatalf("blocked %d: %+v", i, d)
		}
	}
	if s := state(t, l, api, "mallory"); s.Remaining != 99 {
		t.Fatalf("api has %d left, want 99: a denied or blocked request charged it", s.Remaining)
	}
}

// TestBlockStrikes: with a block_max, a client denied again within as long after its block
// ended as that block lasted gets twice the last block, up to block_max; one that stays out
// that long starts again at block. State reports the block and its strikes.
func TestBlockStrikes(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := &limiter.Zone{Name: "login", Algorithm: limiter.FixedWindow, Limit: 1, Window: time.Second, Block: 10 * time.Second, BlockMax: 35 * time.Second}
	offend := func(step string, want time.Duration) {
		t.Helper()
		allow(t, l, limiter.Request{Zone: z, Key: "mallory", Cost: 1}) // admitted: a new window
		reqs := []limiter.Request{{Zone: z, Key: "mallory", Cost: 1}}
		if d := allow(t, l, reqs...); d.Allowed || !reqs[0].Result.BlockStarted || reqs[0].Result.Next != want || d.RetryAfter != want {
			t.Fatalf("%s: %+v (result %+v), want a block of %v", step, d, reqs[0].Result, want)
		}
	}
	offend("first", 10*time.Second)
	if s := state(t, l, z, "mallory"); s.Block != (limiter.BlockState{Until: clk.Now().Add(10 * time.Second), Length: 10 * time.Second, Strikes: 1}) ||
		s.RetryAfter != 10*time.Second {
		t.Fatalf("state: %+v", s)
	}
	clk.Advance(19 * time.Second) // 9s after its end: a repeat
	offend("second", 20*time.Second)
	clk.Advance(21 * time.Second)
	offend("third", 35*time.Second)              // 40s, at most block_max
	clk.Advance(35*time.Second + 35*time.Second) // as long after its end as it lasted: forgotten
	if s := state(t, l, z, "mallory"); !s.Block.Until.IsZero() || s.Block.Strikes != 3 {
		t.Fatalf("after the third: %+v", s.Block)
	}
	offend("fourth", 10*time.Second)
}

// TestBlockUnsatisfiable: a cost the zone can never admit is denied without starting a block.
func TestBlockUnsatisfiable(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	z := &limiter.Zone{Name: "api", Algorithm: limiter.TokenBucket, Capacity: 5, RefillRate: 1, Block: time.Minute}
	reqs := []limiter.Request{{Zone: z, Key: "alice", Cost: 6}}
	if d := allow(t, l, reqs...); d.Allowed || !d.Unsatisfiable || reqs[0].Result.BlockStarted {
		t.Fatalf("cost 6: %+v", d)
	}
	if d := allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1}); !d.Allowed {
		t.Fatalf("cost 1 after: %+v, want admitted", d)
	}
}

// TestBlockAdmin: Block refuses a client that never went over the limit, on a Limiter of
// another instance with a deny cache, and Reset lifts the block: the next request is decided
// by the zone's algorithm. A zone without a Block cannot be blocked.
func TestBlockAdmin(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ctx := context.Background()
	a := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", DenyCacheKeys: 100})
	b := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", DenyCacheKeys: 100})
	z := &limiter.Zone{Name: "api", Algorithm: limiter.TokenBucket, Capacity: 5, RefillRate: 1, Block: time.Minute}
	if _, err := a.Block(ctx, tb("plain", 5, 1), "eve", time.Hour); !errors.Is(err, limiter.ErrNoBlock) {
		t.Fatalf("a zone without block: %v, want ErrNoBlock", err)
	}
	until, err := a.Block(ctx, z, "eve", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	reqs := []limiter.Request{{Zone: z, Key: "eve", Cost: 1}}
	d := allow(t, b, reqs...)
	if d.Allowed || !d.Blocked || d.RetryAfter <= 59*time.Minute || d.RetryAfter > time.Hour {
		t.Fatalf("after Block: %+v", d)
	}
	if d := allow(t, b, reqs...); !d.Cached || !d.Blocked {
		t.Fatalf("again: %+v, want the block from the deny cache", d)
	}
	if s := state(t, a, z, "eve"); !s.Block.Until.Equal(until) {
		t.Fatalf("state: %+v, want blocked until %v", s.Block, until)
	}
	if _, err := a.Reset(ctx, z, "eve"); err != nil {
		t.Fatal(err)
	}
	b.Forget(z, "eve") // the broadcast's part, tested through the admin API
	if d := allow(t, b, reqs...); !d.Allowed {
		t.Fatalf("after Reset: %+v, want admitted", d)
	}
}

// TestBlockZoneWithoutBlockWritesNone: a zone without a block neither reads nor writes a block
// key, even when it denies: Redis runs the same commands as before blocks existed (INFO
// commandstats: one EVALSHA, HMGET and PEXPIRE per decision, HSET per admission, no GET or
// SET), where a zone with a block adds one GET per decision and one SET per block started.
func TestBlockZoneWithoutBlockWritesNone(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	calls := func() map[string]string {
		got := map[string]string{}
		for _, line := range strings.Split(fmt.Sprint(srv.Do("INFO", "commandstats")), "\n") {
			name, rest, ok := strings.Cut(strings.TrimPrefix(line, "cmdstat_"), ":calls=")
			if ok && name != "info" && name != "hello" && name != "config|resetstat" && name != "script|load" {
				got[name], _, _ = strings.Cut(rest, ",")
			}
		}
		return got
	}
	for _, c := range []struct {
		block time.Duration
		want  string
	}{
		{0, "map[evalsha:4 hmget:4 hset:1 pexpire:4 time:4]"},
		{time.Hour, "map[evalsha:4 get:4 hmget:2 hset:1 pexpire:2 set:1 time:4]"},
	} {
		z := tb("api", 1, 1)
		z.Block = c.block
		allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1}) // loads the script
		srv.Do("DEL", limiter.StateKey("rl:", z, "alice"), limiter.BlockKey("rl:", z, "alice"))
		srv.Do("CONFIG", "RESETSTAT")
		allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1})
		for range 3 {
			if d := allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1}); d.Allowed {
				t.Fatalf("block %v: %+v, want denied", c.block, d)
			}
		}
		if got := fmt.Sprint(calls()); got != c.want {
			t.Errorf("block %v: commands %s, want %s", c.block, got, c.want)
		}
		if n := srv.Do("EXISTS", limiter.BlockKey("rl:", z, "alice")); (n == int64(1)) != (c.block > 0) {
			t.Fatalf("block %v: EXISTS block key = %v", c.block, n)
		}
	}
}

// TestBlockValidate: block is refused on concurrency and with lease, and block_max below block
// or without it, each naming the field.
func TestBlockValidate(t *testing.T) {
	for _, c := range []struct {
		z     limiter.Zone
		field string
	}{
		{limiter.Zone{Name: "c", Algorithm: limiter.Concurrency, Limit: 1, Block: time.Minute}, "block"},
		{limiter.Zone{Name: "l", Algorithm: limiter.TokenBucket, Capacity: 1, RefillRate: 1, Block: time.Minute, Lease: &limiter.Lease{Max: 2, TTL: time.Second}}, "block"},
		{limiter.Zone{Name: "m", Algorithm: limiter.TokenBucket, Capacity: 1, RefillRate: 1, Block: time.Minute, BlockMax: time.Second}, "block_max"},
		{limiter.Zone{Name: "n", Algorithm: limiter.TokenBucket, Capacity: 1, RefillRate: 1, BlockMax: time.Minute}, "block_max"},
		{limiter.Zone{Name: "s", Algorithm: limiter.TokenBucket, Capacity: 1, RefillRate: 1, Block: time.Millisecond}, "block"},
		{limiter.Zone{Name: "d", Algorithm: limiter.TokenBucket, Capacity: 1, RefillRate: 1, Block: time.Minute, Shadow: true}, "block"},
	} {
		var fe *limiter.FieldError
		if err := c.z.Validate(); !errors.As(err, &fe) || fe.Field != c.field {
			t.Errorf("zone %s: %v, want an error of field %s", c.z.Name, err, c.field)
		}
	}
}

// TestBlockWithOverridesAndRecords: one decision whose keys are of every kind: a fixed window
// whose charge is recorded for settlement (record and generation keys), a token bucket with
// overrides and a block (its override key, then its block key). The override's capacity (3,
// not the zone's 1) decides, the denial past it starts the block, and once the bucket has
// refilled the block still refuses, with its remaining time: each key is read as what it is.
func TestBlockWithOverridesAndRecords(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	fw := &limiter.Zone{Name: "fw", Algorithm: limiter.FixedWindow, Limit: 100, Window: time.Hour}
	api := &limiter.Zone{Name: "api", Algorithm: limiter.TokenBucket, Capacity: 1, RefillRate: 1, Overrides: true, Block: time.Hour}
	if err := l.SetOverride(context.Background(), api, "mallory", limiter.Override{Capacity: 3}, 0); err != nil {
		t.Fatal(err)
	}
	both := func() []limiter.Request {
		return []limiter.Request{{Zone: fw, Key: "mallory", Cost: 1, Hold: time.Minute}, {Zone: api, Key: "mallory", Cost: 1}}
	}
	for i := range 3 {
		if d := allow(t, l, both()...); !d.Allowed {
			t.Fatalf("request %d: %+v, want admitted (the override's capacity is 3)", i+1, d)
		}
	}
	reqs := both()
	if d := allow(t, l, reqs...); d.Allowed || !reqs[1].Result.BlockStarted {
		t.Fatalf("request 4: %+v (results %+v), want denied by api and its block started", d, reqs[1].Result)
	}
	clk.Advance(10 * time.Second) // the bucket has refilled
	reqs = both()
	if d := allow(t, l, reqs...); d.Allowed || !d.Blocked || d.RetryAfter != time.Hour-10*time.Second {
		t.Fatalf("10s later: %+v, want refused by the block, retry after %v", d, time.Hour-10*time.Second)
	}
}

// blockBesideLease decides 60 requests of one client through two zones: login, a sliding window
// of 20 an hour with a block, and api, a lease zone whose client is hot (warmed up alone, so that
// the requests ask for grants). It checks that no decision fails, that exactly 20 are admitted,
// that the 21st denial starts the block and every later one is refused by it, and that api,
// once its grants are returned, has been charged exactly the warm-up and the 20 admitted.
func blockBesideLease(t *testing.T, l *limiter.Limiter, key string) {
	t.Helper()
	ctx := context.Background()
	t.Cleanup(func() { _ = l.ReturnLeases(ctx) })
	login := &limiter.Zone{Name: "login", Algorithm: limiter.SlidingWindow, Limit: 20, Window: time.Hour, Block: time.Hour}
	api := leaseZone(1000, 10, 10*time.Second)
	const warm = 20
	for i := range warm {
		if d := allow(t, l, limiter.Request{Zone: api, Key: key, Cost: 1}); !d.Allowed {
			t.Fatalf("warm-up %d: %+v, want admitted", i+1, d)
		}
	}
	admitted := 0
	for i := range 60 {
		reqs := []limiter.Request{{Zone: login, Key: key, Cost: 1}, {Zone: api, Key: key, Cost: 1}}
		d := allow(t, l, reqs...)
		switch {
		case i < 20:
			if !d.Allowed {
				t.Fatalf("request %d: %+v, want admitted", i+1, d)
			}
			admitted++
		case i == 20:
			if d.Allowed || !reqs[0].Result.BlockStarted {
				t.Fatalf("request 21: %+v (result %+v), want denied by login, its block started", d, reqs[0].Result)
			}
		default:
			if d.Allowed || !d.Blocked {
				t.Fatalf("request %d: %+v, want refused by login's block", i+1, d)
			}
		}
	}
	if err := l.ReturnLeases(ctx); err != nil {
		t.Fatal(err)
	}
	st, err := l.State(ctx, api, key)
	if err != nil || st.Remaining != 1000-warm-int64(admitted) {
		t.Fatalf("api has %d left (%v), want %d: charged only for the warm-up and the %d admitted", st.Remaining, err, 1000-warm-admitted, admitted)
	}
}

// TestBlockBesideLease: a zone with a block and a lease zone on the same requests of one
// client, the lease client hot: decided exactly, the block starting and refusing, on one
// Redis server.
func TestBlockBesideLease(t *testing.T) {
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Leases: true})
	blockBesideLease(t, l, "mallory")
}

// TestBlockBesideLeaseOnCluster: the same on a 3-primary Redis Cluster, both zones keyed on the
// same client (one hash slot).
func TestBlockBesideLeaseOnCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	l := clusterLimiter(t, c, limiter.Options{Leases: true})
	blockBesideLease(t, l, "mallory")
}
