package limiter

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// The release of a window counter's charge by a Redis Cluster decision across hash slots (one
// slot admitted, another denied) changes the count only while the charge is in it: not after an
// admin reset, not a second time, not in the next window. The charge is taken and released here
// as allowSlots takes and releases one slot's part, with the clock placed by the test; on a
// standalone server and on a Redis Cluster.

// testClock is a clock the test moves.
type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *testClock) Now() time.Time  { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *testClock) Set(t time.Time) { c.mu.Lock(); c.t = t; c.mu.Unlock() }

// releaseTopologies runs f on a standalone server and on a 3-primary Redis Cluster, each with a
// Limiter on a clock of its own, and a function that reads a window counter's count.
func releaseTopologies(t *testing.T, f func(t *testing.T, l *Limiter, clk *testClock, count func(*Zone, string) int64)) {
	for _, topo := range []string{"standalone", "cluster"} {
		t.Run(topo, func(t *testing.T) {
			clk := &testClock{t: time.Unix(1_700_000_000, 0)}
			opts := Options{KeyPrefix: "rl:", Now: clk.Now}
			var rdb Client
			var do func(args ...any) any
			if topo == "standalone" {
				srv := redistest.Start(t)
				rdb, do = srv.Client(), srv.Do
			} else {
				c := redistest.StartCluster(t, 3)
				rdb, opts.Cluster = c.Client(), true
				do = func(args ...any) any {
					return c.NodeOf(hashSlot(args[1].(string))).Do(args...)
				}
			}
			l := New(rdb, opts)
			count := func(z *Zone, client string) int64 {
				key := StateKey("rl:", z, client)
				var v any
				if z.Algorithm == FixedWindow {
					if s, ok := do("GET", key).(string); ok {
						_, v, _ = strings.Cut(s, ":")
					}
				} else {
					v = do("HGET", key, "c")
				}
				if v == nil {
					return 0
				}
				n, err := strconv.ParseInt(fmt.Sprint(v), 10, 64)
				if err != nil {
					t.Fatalf("%s: count %v", key, v)
				}
				return n
			}
			f(t, l, clk, count)
		})
	}
}

// windowCounterZones are a fixed window and a sliding window counter of a minute, limit limit.
func windowCounterZones(limit int64) []*Zone {
	return []*Zone{
		{Name: "q", Algorithm: FixedWindow, Limit: limit, Window: time.Minute},
		{Name: "q", Algorithm: SlidingWindowCounter, Limit: limit, Window: time.Minute},
	}
}

// crossSlotCharge charges rq as one hash slot's part of a decision whose zones are in several
// slots (allowSlots), at the limiter's clock, and returns that slot's call, for l.settle.
func crossSlotCharge(t *testing.T, l *Limiter, rq Request) *call {
	t.Helper()
	reqs := []Request{rq}
	keys := []string{StateKey(l.prefix, rq.Zone, rq.Key)}
	ckeys, args := l.encodeDecision(reqs, keys, true, l.now())
	c := &call{keys: ckeys, args: args}
	evalEach(context.Background(), l.rdb, decideScript, []*call{c})
	if ok, _, err := decodeResult(c.reply, c.err, reqs); err != nil || !ok {
		t.Fatalf("the cross-slot charge: %v, %v", ok, err)
	}
	return c
}

// admitted is how many of n requests of cost 1 for client in z Allow admits.
func admitted(t *testing.T, l *Limiter, z *Zone, client string, n int) int {
	t.Helper()
	k := 0
	for range n {
		d, err := l.Allow(context.Background(), []Request{{Zone: z, Key: client, Cost: 1}})
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed {
			k++
		}
	}
	return k
}

// TestCrossSlotReleaseAfterReset: limit 10; a request's charge of 4 is counted, the client is
// reset (admin API), the next request takes all 10 of the fresh window, then the first request's
// release arrives: the count stays 10, and a request of cost 4 is denied (it was admitted, 14 for
// a limit of 10).
func TestCrossSlotReleaseAfterReset(t *testing.T) {
	t.Parallel()
	releaseTopologies(t, func(t *testing.T, l *Limiter, clk *testClock, count func(*Zone, string) int64) {
		for _, z := range windowCounterZones(10) {
			t.Run(z.Algorithm.String(), func(t *testing.T) {
				ctx := context.Background()
				c := crossSlotCharge(t, l, Request{Zone: z, Key: "erin", Cost: 4})
				if _, err := l.Reset(ctx, z, "erin"); err != nil {
					t.Fatal(err)
				}
				if d, err := l.Allow(ctx, []Request{{Zone: z, Key: "erin", Cost: 10}}); err != nil || !d.Allowed {
					t.Fatalf("after the reset, cost 10: %+v, %v; want admitted", d, err)
				}
				l.settle(ctx, []*call{c}, false)
				if n := count(z, "erin"); n != 10 {
					t.Fatalf("count after the release: %d, want 10 (the released charge was reset away)", n)
				}
				if d, err := l.Allow(ctx, []Request{{Zone: z, Key: "erin", Cost: 4}}); err != nil || d.Allowed {
					t.Fatalf("cost 4 with the window full: %+v, %v; want denied", d, err)
				}
			})
		}
	})
}

// TestCrossSlotReleaseTwice: limit 10; a charge of 4 and one of 6 fill the window; the first
// one's release, sent twice, takes 4 off once: count 6, then exactly 4 more requests of cost 1
// are admitted.
func TestCrossSlotReleaseTwice(t *testing.T) {
	t.Parallel()
	releaseTopologies(t, func(t *testing.T, l *Limiter, clk *testClock, count func(*Zone, string) int64) {
		for _, z := range windowCounterZones(10) {
			t.Run(z.Algorithm.String(), func(t *testing.T) {
				ctx := context.Background()
				c := crossSlotCharge(t, l, Request{Zone: z, Key: "gina", Cost: 4})
				if d, err := l.Allow(ctx, []Request{{Zone: z, Key: "gina", Cost: 6}}); err != nil || !d.Allowed {
					t.Fatalf("cost 6: %+v, %v; want admitted", d, err)
				}
				l.settle(ctx, []*call{c}, false)
				l.settle(ctx, []*call{c}, false)
				if n := count(z, "gina"); n != 6 {
					t.Fatalf("count after the release sent twice: %d, want 6", n)
				}
				if n := admitted(t, l, z, "gina", 6); n != 4 {
					t.Fatalf("%d of 6 more admitted, want 4", n)
				}
			})
		}
	})
}

// TestCrossSlotReleaseInTheNextWindow: limit 5; a charge of 3 made 1 ms before a window ends,
// released 2 ms into the next window after requests filled it (5 of them; 2 for the sliding
// window counter, whose estimate weighs the 3 of the window before): the release takes nothing
// from the next window's count, and none of 4 more requests is admitted (3 were).
func TestCrossSlotReleaseInTheNextWindow(t *testing.T) {
	t.Parallel()
	releaseTopologies(t, func(t *testing.T, l *Limiter, clk *testClock, count func(*Zone, string) int64) {
		for _, z := range windowCounterZones(5) {
			t.Run(z.Algorithm.String(), func(t *testing.T) {
				ctx := context.Background()
				_, end := z.WindowAt(clk.Now())
				if z.Algorithm == SlidingWindowCounter { // windows aligned to the epoch
					us, w := clk.Now().UnixMicro(), z.Window.Microseconds()
					end = time.UnixMicro(us - us%w + w)
				}
				clk.Set(end.Add(-time.Millisecond))
				c := crossSlotCharge(t, l, Request{Zone: z, Key: "hana", Cost: 3})
				clk.Set(end.Add(time.Millisecond))
				if n := admitted(t, l, z, "hana", 5); n != 5 && z.Algorithm == FixedWindow {
					t.Fatalf("%d of 5 admitted in the next window, want 5", n)
				}
				before := count(z, "hana")
				clk.Set(end.Add(2 * time.Millisecond))
				l.settle(ctx, []*call{c}, false)
				if n := count(z, "hana"); n != before {
					t.Fatalf("the next window's count after the release: %d, want %d (untouched)", n, before)
				}
				if n := admitted(t, l, z, "hana", 4); n != 0 {
					t.Fatalf("%d of 4 more admitted in the next window, want 0", n)
				}
			})
		}
	})
}

// TestSettleAfterReset: a count_status charge (a window counter zone with a Hold) settled after
// an admin reset changes nothing: the client reset while the response was under way is charged
// only what it asks for after the reset, and the settlement reports ErrNotHeld.
func TestSettleAfterReset(t *testing.T) {
	t.Parallel()
	releaseTopologies(t, func(t *testing.T, l *Limiter, clk *testClock, count func(*Zone, string) int64) {
		for _, z := range windowCounterZones(1000) {
			t.Run(z.Algorithm.String(), func(t *testing.T) {
				ctx := context.Background()
				d, err := l.Allow(ctx, []Request{{Zone: z, Key: "ivan", Cost: 100, Hold: time.Minute}})
				if err != nil || !d.Allowed {
					t.Fatalf("the held charge: %+v, %v", d, err)
				}
				if _, err := l.Reset(ctx, z, "ivan"); err != nil {
					t.Fatal(err)
				}
				if d, err := l.Allow(ctx, []Request{{Zone: z, Key: "ivan", Cost: 10}}); err != nil || !d.Allowed {
					t.Fatalf("after the reset: %+v, %v", d, err)
				}
				got, err := l.Settle(ctx, d.Held, []int64{300})
				if !errors.Is(err, ErrNotHeld) || got[0] {
					t.Fatalf("settle after the reset: %v, %v; want ErrNotHeld", got, err)
				}
				if n := count(z, "ivan"); n != 10 {
					t.Fatalf("count: %d, want 10 (what was asked after the reset)", n)
				}
			})
		}
	})
}
