package limiter_test

import (
	"context"
	"math"
	"strconv"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// used is a token bucket's u as Redis holds it.
func used(t *testing.T, srv *redistest.Server, key string) float64 {
	t.Helper()
	s, _ := srv.Do("HGET", key, "u").(string)
	u, err := strconv.ParseFloat(s, 64)
	if err != nil {
		t.Fatalf("%s: u = %q", key, s)
	}
	return u
}

// TestSettleLateAppliesTheDifference: a late settlement cannot dodge its charge. A
// reservation of 500 whose response takes longer than its hold (1 s), while another request of
// the client commits the hold as its cost, is settled to the 5000 reported all the same: the
// bucket is charged 5000 for it, as when the response is quick. Settled to less than the cost,
// the difference is given back.
func TestSettleLateAppliesTheDifference(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := tb("llm", 100000, 100000.0/86400)
	for _, tc := range []struct {
		client   string
		reported int64
		want     float64 // used once settled: the slow response's amount and the other request's 1
	}{{"slow", 5000, 5001}, {"short", 100, 101}} {
		slow := allow(t, l, limiter.Request{Zone: z, Key: tc.client, Cost: 500, Hold: time.Second})
		clk.Advance(2 * time.Second)
		allow(t, l, limiter.Request{Zone: z, Key: tc.client, Cost: 1}) // finds the hold past its time: commits it as 500
		key := "rl:{" + tc.client + "}:llm:tb"
		if u := used(t, srv, key); u < 500 || srv.Do("HGET", key, "h") != nil {
			t.Fatalf("%s: used %v with h %v before the settlement, want the hold committed", tc.client, u, srv.Do("HGET", key, "h"))
		}
		got, err := settle(t, l, slow, tc.reported)
		if err != nil || !got[0] {
			t.Fatalf("%s: late settle: %v, %v; want settled", tc.client, got, err)
		}
		// No refill drains a hold, and the commit and the settlement are at the same time: exact.
		if u := used(t, srv, key); math.Abs(u-tc.want) > 0.001 {
			t.Fatalf("%s: used %v after the late settle, want %v", tc.client, u, tc.want)
		}
	}
}

// TestSettleCapsTheAmount: a response cannot report an unbounded charge. An amount above the
// zone's max_cost (default: its capacity) is charged as max_cost, and a bucket's debt is at most
// one capacity whatever the number of responses settled: 2^63 − 1 tokens reported on a bucket of
// 1000 tokens refilled in an hour leave it 2000 used, its key's TTL at most two hours.
func TestSettleCapsTheAmount(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	capped := &limiter.Zone{Name: "capped", Algorithm: limiter.TokenBucket, Capacity: 1000, RefillRate: 1000.0 / 3600, MaxCost: 300}
	d := allow(t, l, limiter.Request{Zone: capped, Key: "a", Cost: 100, Hold: time.Minute})
	if _, err := settle(t, l, d, math.MaxInt64); err != nil {
		t.Fatal(err)
	}
	if u := used(t, srv, "rl:{a}:capped:tb"); u < 299.99 || u > 300 {
		t.Fatalf("max_cost 300: used %v after a report of 2^63 − 1, want 300", u)
	}

	z := tb("llm", 1000, 1000.0/3600)
	var held []limiter.Decision
	for range 10 {
		held = append(held, allow(t, l, limiter.Request{Zone: z, Key: "b", Cost: 100, Hold: time.Minute}))
	}
	for i, d := range held {
		if got, err := settle(t, l, d, math.MaxInt64); err != nil || !got[0] {
			t.Fatalf("settle %d: %v, %v", i+1, got, err)
		}
		hs, _ := srv.Do("HGET", "rl:{b}:llm:tb", "h").(string)
		h, _ := strconv.ParseFloat(hs, 64) // absent: 0
		if u := used(t, srv, "rl:{b}:llm:tb"); u+h > 2000 {
			t.Fatalf("settle %d: used %v and held %v, want at most 2000 together", i+1, u, h)
		}
	}
	if u := used(t, srv, "rl:{b}:llm:tb"); u < 1999.9 || u > 2000 {
		t.Fatalf("used %v after 10 reports of 2^63 − 1, want 2000 (one capacity of debt)", u)
	}
	if ttl := srv.Do("PTTL", "rl:{b}:llm:tb").(int64); ttl > 2*3600*1000 || ttl < 2*3600*1000-5000 {
		t.Fatalf("TTL %d ms, want two windows (7,200,000 ms)", ttl)
	}
}

// TestKeyTTLWithinTheZonesWindows checks docs/security.md's bound on every key's TTL with
// responses charged after them, for every algorithm: reports of 2^63 − 1 on 20 charges held
// for their responses at once leave no key (state or record) living longer than two of the
// zone's windows (a fixed window's, a second past its end) plus, while charges are pending, the
// hold time and a second.
func TestKeyTTLWithinTheZonesWindows(t *testing.T) {
	t.Parallel()
	const window, hold = time.Hour, 10 * time.Minute
	for _, z := range []*limiter.Zone{
		tb("b", 1000, 1000.0/3600),
		sw("b", 1000, window),
		{Name: "b", Algorithm: limiter.FixedWindow, Limit: 1000, Window: window},
		sc("b", 1000, window),
	} {
		t.Run(z.Algorithm.String(), func(t *testing.T) {
			srv := redistest.Start(t)
			l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
			check := func(step string, bound time.Duration) {
				t.Helper()
				keys, _ := srv.Do("KEYS", "rl:*").([]any)
				if len(keys) == 0 {
					t.Fatalf("%s: no keys", step)
				}
				for _, k := range keys {
					if ttl := srv.Do("PTTL", k).(int64); ttl < 0 || time.Duration(ttl)*time.Millisecond > bound {
						t.Fatalf("%s: key %v has a TTL of %d ms, want at most %v", step, k, ttl, bound)
					}
				}
			}
			var held []limiter.Decision
			for range 20 {
				d := allow(t, l, limiter.Request{Zone: z, Key: "c", Cost: 10, Hold: hold})
				if !d.Allowed {
					t.Fatalf("denied: %+v", d)
				}
				held = append(held, d)
			}
			for i, d := range held {
				check("pending "+strconv.Itoa(i), 2*window+hold+time.Second)
				if _, err := l.Settle(context.Background(), d.Held, []int64{math.MaxInt64}); err != nil {
					t.Fatal(err)
				}
			}
			check("all settled", 2*window+time.Second)
		})
	}
}
