package limiter_test

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// Charging the window counters after the response: the cost is counted at admission, recorded
// in a key of its own (`<state key>:<nonce>`), and settle.lua adds the difference to the count of
// the window it went into.

// windowCounters are an hour's fixed window and sliding window counter of limit, named name.
func windowCounters(name string, limit int64) []*limiter.Zone {
	return []*limiter.Zone{
		{Name: name, Algorithm: limiter.FixedWindow, Limit: limit, Window: time.Hour},
		sc(name, limit, time.Hour),
	}
}

// count is a window counter's count as Redis holds it: the fixed window's "<start>:<count>", the
// sliding window counter's c.
func count(t *testing.T, srv *redistest.Server, z *limiter.Zone, client string) int64 {
	t.Helper()
	key := limiter.StateKey("rl:", z, client)
	var v any
	if z.Algorithm == limiter.FixedWindow {
		if s, ok := srv.Do("GET", key).(string); ok {
			_, v, _ = strings.Cut(s, ":")
		}
	} else {
		v = srv.Do("HGET", key, "c")
	}
	n, err := strconv.ParseInt(fmt.Sprint(v), 10, 64)
	if err != nil {
		t.Fatalf("%s: count %v", key, v)
	}
	return n
}

// TestSettleWindowCounterChargesTheReportedAmount: limit 1000 tokens an hour, a reservation of
// 100 settled to 300 four times: the 4th puts the window's count at 1200, 200 in debt; the 5th
// is denied until the window ends (fixed window: 2800 s, the clock being 800 s into its hour), or
// until the estimate falls to 900 (sliding window counter: the hour's end, then a quarter of the
// next hour, as the 1200 counted weigh less). A second settle of the same decision changes
// nothing, and no record is left.
func TestSettleWindowCounterChargesTheReportedAmount(t *testing.T) {
	t.Parallel()
	for _, z := range windowCounters("llm", 1000) {
		t.Run(z.Algorithm.String(), func(t *testing.T) {
			srv := redistest.Start(t)
			clk := newClock() // 800 s into an hour
			l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
			req := limiter.Request{Zone: z, Key: "alice", Cost: 100, Hold: 10 * time.Minute}
			var last limiter.Decision
			for i := range 4 {
				d := allow(t, l, req)
				if !d.Allowed {
					t.Fatalf("request %d denied: %+v", i+1, d)
				}
				if n := srv.Do("DBSIZE"); n != int64(3) {
					t.Fatalf("request %d: %v keys, want the state, the charge's record and the count's generation", i+1, n)
				}
				if got, err := settle(t, l, d, 300); err != nil || len(got) != 1 || !got[0] {
					t.Fatalf("settle %d: %v, %v", i+1, got, err)
				}
				last = d
			}
			if n := count(t, srv, z, "alice"); n != 1200 {
				t.Fatalf("count after 4 × 300: %d, want 1200 (200 in debt)", n)
			}
			if n := srv.Do("DBSIZE"); n != int64(2) {
				t.Fatalf("%v keys after the settlements, want the state and its generation", n)
			}
			got, err := settle(t, l, last, 300)
			if !errors.Is(err, limiter.ErrNotHeld) || got[0] {
				t.Fatalf("second settle of the same decision: %v, %v; want ErrNotHeld", got, err)
			}
			if n := count(t, srv, z, "alice"); n != 1200 {
				t.Fatalf("count after a second settle: %d, want 1200", n)
			}
			retry := 2800 * time.Second // the fixed window's end
			if z.Algorithm == limiter.SlidingWindowCounter {
				retry += 900 * time.Second // then 1200 × (1 - x/3600 s) = 900
			}
			d := allow(t, l, req)
			if d.Allowed || d.RetryAfter != retry || d.Remaining != 0 {
				t.Fatalf("5th request: %+v, want denied with RetryAfter %v", d, retry)
			}
		})
	}
}

// TestWindowCounterCountStatus: count_status on the window counters: a charge given back (settled
// to 0) leaves the count as it was, so 10 of them all pass; 3 kept fill the limit, and the 4th is
// denied until the window moves. A pending charge's record lives as long as its hold.
func TestWindowCounterCountStatus(t *testing.T) {
	t.Parallel()
	for _, z := range windowCounters("login", 3) {
		t.Run(z.Algorithm.String(), func(t *testing.T) {
			srv := redistest.Start(t)
			clk := newClock() // 800 s into an hour
			l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
			req := limiter.Request{Zone: z, Key: "bob", Cost: 1, Hold: time.Minute}
			state := limiter.StateKey("rl:", z, "bob")
			for i := range 10 {
				sent := time.Now()
				d := allow(t, l, req)
				if !d.Allowed || d.Remaining != 2 {
					t.Fatalf("request %d: %+v, want allowed with 2 left", i+1, d)
				}
				if i == 0 {
					recs, _ := srv.Do("KEYS", state+":*").([]any)
					if len(recs) != 2 {
						t.Fatalf("records %v, want one and the count's generation", recs)
					}
					for _, k := range recs {
						// A minute, less the time since the decision was sent, up to PTTL's answer
						// (Redis counts a TTL on its own clock, and PTTL reads it a round trip
						// later); not the 5 s of a hold without a hold time.
						ttl := srv.Do("PTTL", k).(int64)
						least := (time.Minute - time.Since(sent)).Milliseconds() - 1
						if ttl < least || ttl > 60_000 {
							t.Fatalf("%s: TTL %dms, want the hold's minute (at least %d ms)", k, ttl, least)
						}
					}
				}
				if got, err := settle(t, l, d, 0); err != nil || !got[0] {
					t.Fatalf("give back %d: %v, %v", i+1, got, err)
				}
			}
			if n := count(t, srv, z, "bob"); n != 0 {
				t.Fatalf("count after 10 given back: %d, want 0", n)
			}
			for i := range 3 {
				if got, err := settle(t, l, allow(t, l, req), 1); err != nil || !got[0] {
					t.Fatalf("keep %d: %v, %v", i+1, got, err)
				}
			}
			retry := 2800 * time.Second
			if z.Algorithm == limiter.SlidingWindowCounter {
				retry += 1200 * time.Second // 3 × (1 - x/3600 s) = 2
			}
			if d := allow(t, l, req); d.Allowed || d.RetryAfter < retry || d.RetryAfter > retry+time.Microsecond {
				t.Fatalf("4th kept: %+v, want denied for %v (rounded up to the µs)", d, retry)
			}
		})
	}
}

// TestWindowCounterSettleAfterTheWindow: a charge made in the last millisecond of a window and
// settled in the next is neither given back nor charged: the next window's count (and the
// previous count a sliding window counter weighs) is left alone, the record is deleted, and
// Settle reports the zone not settled, with no error.
func TestWindowCounterSettleAfterTheWindow(t *testing.T) {
	t.Parallel()
	for _, z := range windowCounters("llm", 1000) {
		t.Run(z.Algorithm.String(), func(t *testing.T) {
			srv := redistest.Start(t)
			clk := newClock()
			l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
			clk.Advance(2800*time.Second - time.Millisecond)
			late := allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 100, Hold: time.Minute})
			clk.Advance(2 * time.Millisecond)
			allow(t, l, limiter.Request{Zone: z, Key: "k", Cost: 1})
			if got, err := settle(t, l, late, 0); err != nil || got[0] {
				t.Fatalf("settle after the window: %v, %v; want not settled, and no error", got, err)
			}
			if got, err := settle(t, l, late, 300); !errors.Is(err, limiter.ErrNotHeld) || got[0] {
				t.Fatalf("second settle: %v, %v; want ErrNotHeld", got, err)
			}
			if n := count(t, srv, z, "k"); n != 1 {
				t.Fatalf("the next window's count: %d, want 1", n)
			}
			if z.Algorithm == limiter.SlidingWindowCounter {
				if p := srv.Do("HGET", limiter.StateKey("rl:", z, "k"), "p"); p != "100" {
					t.Fatalf("the previous window's count: %v, want 100", p)
				}
			}
			if n := srv.Do("DBSIZE"); n != int64(2) {
				t.Fatalf("%v keys, want the state and its generation", n)
			}
		})
	}
}

// TestWindowCounterPreviousScriptOverlap: during a rolling upgrade, instances still running the
// previous decide.lua (testdata/decide_v2.lua, before records) and this one share the window
// counters while charges are pending: the state keys keep their encodings, so each reads the
// other's counts. With every charge of this version given back, the previous version's
// requests alone fill the limit, exactly.
func TestWindowCounterPreviousScriptOverlap(t *testing.T) {
	t.Parallel()
	for _, z := range windowCounters("login", 5) {
		t.Run(z.Algorithm.String(), func(t *testing.T) {
			srv := redistest.Start(t)
			rdb := srv.Client()
			clk := newClock()
			l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
			old := redis.NewScript(decideV2)
			key := limiter.StateKey("rl:", z, "eve")
			oldAllow := func() bool {
				rate := any(z.Window.Microseconds())
				if z.Algorithm == limiter.FixedWindow {
					start, end := z.WindowAt(clk.Now())
					rate = fmt.Sprintf("%d,%d,%d,%d", start.Add(-time.Hour).UnixMicro(), start.UnixMicro(), end.UnixMicro(), end.Add(time.Hour).UnixMicro())
				}
				tag := map[limiter.Algorithm]string{limiter.FixedWindow: "fw", limiter.SlidingWindowCounter: "sc"}[z.Algorithm]
				v, err := old.Run(context.Background(), rdb, []string{key}, clk.Now().UnixMicro(), "old", "0", 1, tag, z.Limit, rate, 1).Slice()
				if err != nil {
					t.Fatalf("previous script: %v", err)
				}
				return v[0].(int64) == 1
			}
			kept, pending := 0, []limiter.Decision{}
			for i := range 30 {
				clk.Advance(time.Second)
				if i%2 == 0 {
					if oldAllow() {
						kept++
					}
					continue
				}
				d := allow(t, l, limiter.Request{Zone: z, Key: "eve", Cost: 1, Hold: time.Minute})
				if d.Allowed {
					pending = append(pending, d)
				}
				if len(pending) == 2 { // a charge stays pending while the previous version decides
					if _, err := settle(t, l, pending[0], 0); err != nil {
						t.Fatal(err)
					}
					pending = pending[1:]
				}
			}
			for _, d := range pending {
				if _, err := settle(t, l, d, 0); err != nil {
					t.Fatal(err)
				}
			}
			for range 5 { // the slot the last pending charge held is free again
				if oldAllow() {
					kept++
				}
			}
			if kept != 5 || count(t, srv, z, "eve") != 5 {
				t.Fatalf("the previous version kept %d, count %d: want the limit, 5", kept, count(t, srv, z, "eve"))
			}
		})
	}
}

//go:embed testdata/decide_v2.lua
var decideV2 string

// TestClusterWindowCountersAcrossSlots: on Redis Cluster, a request whose held zones are a fixed
// window and a sliding window counter in two hash slots, and a plain token bucket in a third:
// admission commits the bucket and leaves each held zone's record in its own slot; Settle
// settles each slot with its own call (charged 250 in place of 100, and given back), once; a
// denial by the bucket's slot releases the held zones through their records, exactly.
func TestClusterWindowCountersAcrossSlots(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	perNode := clientsOn(t, c, 1)
	alice, bob, carol := perNode[0][0], perNode[1][0], perNode[2][0]
	zf := &limiter.Zone{Name: "daily", Algorithm: limiter.FixedWindow, Limit: 1000, Period: limiter.Day}
	zs := sc("hourly", 1000, time.Hour)
	zb := tb("plain", 2, 2/(limiter.MaxWindow.Seconds()/2))
	l := clusterLimiter(t, c, limiter.Options{})
	reqs := []limiter.Request{
		{Zone: zf, Key: alice, Cost: 100, Hold: time.Hour},
		{Zone: zs, Key: bob, Cost: 100, Hold: time.Hour},
		{Zone: zb, Key: carol, Cost: 1},
	}
	counts := func() (int64, int64) {
		return count(t, c.Nodes[0], zf, alice), count(t, c.Nodes[1], zs, bob)
	}
	d := allow(t, l, reqs...)
	if !d.Allowed || d.Held == nil {
		t.Fatalf("first request: %+v, want allowed with holds", d)
	}
	for i, n := range []*redistest.Server{c.Nodes[0], c.Nodes[1]} {
		if keys := n.Do("DBSIZE"); keys != int64(3) {
			t.Fatalf("node %d: %v keys after admission, want the state, the record and the generation", i, keys)
		}
	}
	if h := c.Nodes[2].Do("HGET", limiter.StateKey("rl:", zb, carol), "h"); h != nil {
		t.Fatalf("plain zone after admission: h = %v, want committed", h)
	}
	if f, s := counts(); f != 100 || s != 100 {
		t.Fatalf("counts after admission: %d, %d; want 100, 100", f, s)
	}
	if got, err := l.Settle(context.Background(), d.Held, []int64{250, 0, 0}); err != nil || !got[0] || !got[1] {
		t.Fatalf("settle: %v, %v", got, err)
	}
	if got, err := l.Settle(context.Background(), d.Held, []int64{250, 0, 0}); !errors.Is(err, limiter.ErrNotHeld) || got[0] || got[1] {
		t.Fatalf("second settle: %v, %v; want ErrNotHeld", got, err)
	}
	if f, s := counts(); f != 250 || s != 0 {
		t.Fatalf("counts after settling: %d, %d; want 250, 0", f, s)
	}
	allow(t, l, reqs[2]) // the plain zone is now empty
	if d := allow(t, l, reqs...); d.Allowed || d.Zone != 2 {
		t.Fatalf("with the plain zone empty: %+v, want denied by it", d)
	}
	if f, s := counts(); f != 250 || s != 0 {
		t.Fatalf("counts after a denial: %d, %d; want 250, 0 (released)", f, s)
	}
	for i, n := range []*redistest.Server{c.Nodes[0], c.Nodes[1]} {
		if keys := n.Do("DBSIZE"); keys != int64(2) {
			t.Fatalf("node %d: %v keys after the release, want the state and its generation", i, keys)
		}
	}
}

// TestRefundForgetsCachedDenials: a charge given back after the response forgets this
// instance's cached denials of that client in that zone, whatever their cost, so the client's
// next request is decided by Redis (and admitted) instead of denied until max_age. A settlement
// that keeps the whole charge forgets nothing. (A token bucket's denials that a release could
// cure are never cached: see TestSettleReleaseAndKeep.)
func TestRefundForgetsCachedDenials(t *testing.T) {
	t.Parallel()
	for _, z := range append(windowCounters("login", 2), sw("login", 2, time.Hour)) {
		t.Run(z.Algorithm.String(), func(t *testing.T) {
			srv := redistest.Start(t)
			clk := newClock()
			l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Hour})
			req := limiter.Request{Zone: z, Key: "mallory", Cost: 1, Hold: time.Minute}
			first, second := allow(t, l, req), allow(t, l, req)
			for _, cost := range []int64{1, 2} {
				r := req
				r.Cost = cost
				allow(t, l, r) // denied by Redis, then cached
				if d := allow(t, l, r); d.Allowed || !d.Cached {
					t.Fatalf("cost %d while 2 are in flight: %+v, want a cached denial", cost, d)
				}
			}
			if _, err := settle(t, l, first, 1); err != nil {
				t.Fatal(err)
			}
			if d := allow(t, l, req); !d.Cached {
				t.Fatalf("after a settlement that kept its charge: %+v, want the cached denial", d)
			}
			if _, err := settle(t, l, second, 0); err != nil {
				t.Fatal(err)
			}
			for _, cost := range []int64{2, 1} {
				r := req
				r.Cost = cost
				if d, ok := l.Denied([]limiter.Request{r}); ok {
					t.Fatalf("cost %d after a refund: cached denial %+v, want none", cost, d)
				}
			}
			if d := allow(t, l, req); !d.Allowed {
				t.Fatalf("after the refund: %+v, want admitted by Redis", d)
			}
		})
	}
}
