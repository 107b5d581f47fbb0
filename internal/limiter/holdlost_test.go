package limiter_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

// A budget of 10,000 tokens a day: 4,000 of them take 9.6 hours to drain.
const (
	dayCapacity = 10_000
	dayRate     = 10_000.0 / 86_400
)

// drainMS is how long (ms) tokens take to drain at dayRate, rounded up.
func drainMS(tokens float64) int64 { return int64(tokens/dayRate*1000) + 1 }

// pttl is the TTL (ms) of key on srv.
func pttl(t *testing.T, srv *redistest.Server, key string) int64 {
	t.Helper()
	ttl, ok := srv.Do("PTTL", key).(int64)
	if !ok || ttl < 0 {
		t.Fatalf("PTTL %s: %v, want a TTL", key, srv.Do("PTTL", key))
	}
	return ttl
}

// TestUnsettledHoldCountsAsChargedUntilDrained: a reservation of 4,000 of a 10,000-a-day budget
// held 1 s that is never settled (its instance died) keeps the bucket alive until the 4,000
// would have drained once charged: its TTL is at least the hold time and 4,000 tokens' drain
// time (9.6 h), not the hold time and a second, after which the charge would vanish. Past the
// hold time, a decision finds it charged.
func TestUnsettledHoldCountsAsChargedUntilDrained(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := tb("oai", dayCapacity, dayRate)
	const key = "rl:{alice}:oai:tb"
	d := allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 4000, Hold: time.Second})
	if !d.Allowed || d.Held == nil {
		t.Fatalf("reservation: %+v, want allowed and held", d)
	}
	if ttl, least := pttl(t, srv, key), drainMS(4000)+1000; ttl < least {
		t.Fatalf("TTL %d ms with 4,000 held for 1 s: want at least %d (the hold time and its drain time): "+
			"a key that expires first gives the charge back", ttl, least)
	}
	clk.Advance(2 * time.Second) // the hold is past its time: it counts as charged
	if d := allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1}); !d.Allowed || d.Remaining != 5999 {
		t.Fatalf("after the hold time: %+v, want allowed with 5,999 left (4,000 charged, 1 more, 0.2 refilled in 2 s)", d)
	}
	if ttl, least := pttl(t, srv, key), drainMS(4001)-2000; ttl < least {
		t.Fatalf("TTL %d ms once the hold is committed: want at least %d (4,001 tokens' drain time)", ttl, least)
	}
}

// TestSettleKeepsTheOtherHoldsTTL: two reservations of 2,000 held a minute; the first is
// settled to 3,000 (more than it reserved): the bucket's TTL still covers the second hold's
// minute and every token's drain time (3,000 used and 2,000 held).
func TestSettleKeepsTheOtherHoldsTTL(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := tb("oai", dayCapacity, dayRate)
	req := limiter.Request{Zone: z, Key: "bob", Cost: 2000, Hold: time.Minute}
	first, second := allow(t, l, req), allow(t, l, req)
	if !first.Allowed || !second.Allowed {
		t.Fatalf("reservations: %+v, %+v; want both allowed", first, second)
	}
	if got, err := settle(t, l, first, 3000); err != nil || !got[0] {
		t.Fatalf("settle: %v, %v", got, err)
	}
	if ttl, least := pttl(t, srv, "rl:{bob}:oai:tb"), drainMS(5000)+60_000; ttl < least {
		t.Fatalf("TTL %d ms after a settle beside a hold of a minute: want at least %d", ttl, least)
	}
}

// TestQueueGrantNeverClaimedOutlivesItsDrain: queue.lua reserves 4,000 tokens of a 10,000-a-day
// bucket for a waiter that never claims them (its instance died): the reservation counts as
// charged after its claim time (2 s here), so the bucket lives at least that and its drain time.
func TestQueueGrantNeverClaimedOutlivesItsDrain(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	const k = "rl:{carol}:oai:tb"
	rate := strconv.FormatFloat(dayRate, 'g', 17, 64)
	reply, err := srv.Client().Eval(context.Background(), lua.Queue,
		[]string{k, k + ":ql", k + ":qm", k + ":q1"},
		"", "enter", "10000,"+rate, 2_000_000, "rl:queue:", "0", 60_000_000, 0, "inst.1:4000.1", "").Slice()
	if err != nil || len(reply) < 1 || reply[0] != int64(1) {
		t.Fatalf("enter: %v, %v; want granted at once", reply, err)
	}
	if ttl, least := pttl(t, srv, k), drainMS(4000)+2000; ttl < least {
		t.Fatalf("TTL %d ms with a grant of 4,000 for 2 s: want at least %d (the claim time and its drain time)", ttl, least)
	}
}
