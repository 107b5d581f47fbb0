package limiter_test

import (
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

// TestFastPathMatchesGeneral: decide.lua's fast path (token buckets without hold, max_wait or
// holds pending) leaves exactly the state (u, ts, t, the TTL) and gives exactly the reply that
// its general path gives, decision after decision: the same batches run through decide.lua and
// through a copy with the fast path switched off, each on keys of its own, over fresh buckets,
// drained and partly drained ones (u integral and fractional), denials, two-zone decisions
// that one zone denies, and buckets the previous script wrote last (t without its '+').
func TestFastPathMatchesGeneral(t *testing.T) {
	// Not parallel: it bounds two TTLs set in one transaction to 1ms of each other.
	const call = "local fo = n and ARGV[a + 1] == '0' and fast(out, o, n, kbase, a + 3)"
	if !strings.Contains(lua.Decide, call) {
		t.Fatal("decide.lua no longer calls fast() as this test expects")
	}
	fast := redis.NewScript(lua.Decide)
	general := redis.NewScript(strings.Replace(lua.Decide, call, "local fo = false", 1))
	// The sequence takes the fast path: a copy without the general path runs it.
	const slow = "local r = decide(nonce, hold, zones)"
	if strings.Count(lua.Decide, slow) != 1 {
		t.Fatal("decide.lua no longer calls decide() as this test expects")
	}
	fastOnly := redis.NewScript(strings.Replace(lua.Decide, slow, "error('general path taken')", 1))

	srv := redistest.Start(t)
	rdb := srv.Client()
	ctx := context.Background()
	for _, s := range []*redis.Script{fast, general} {
		if err := s.Load(ctx, rdb).Err(); err != nil {
			t.Fatal(err)
		}
	}
	keys := func(ns string) []string { return []string{ns + "{c}:a:tb", ns + "{c}:a:tb", ns + "{c}:b:tb"} }
	now := int64(1_700_000_000_000_000)
	batch := func(cost int64) []any {
		return []any{now,
			"", "0", 1, "tb", 5, 0.5, cost, "", // zone a alone
			"", "0", 2, "tb", 5, 0.5, 1, "", "tb", 3, 2.5, cost, "", // zones a and b
		}
	}
	steps := []int64{0, 0, 123_457, 1_000_001, 7, 2_000_000, 333_333, 30_000_000, 0, 1, 999_999, 4_000_000, 250_001}
	for i := range 60 {
		now += steps[i%len(steps)]
		args := batch(int64(1 + i%3))
		if i%10 == 5 {
			// The previous script writes the tokens left in t, without a '+'.
			for _, ns := range []string{"f:", "g:", "x:"} {
				if err := rdb.HSet(ctx, ns+"{c}:a:tb", "t", "2.5", "ts", now-1_000_000).Err(); err != nil {
					t.Fatal(err)
				}
			}
		}
		if i == 0 || i%10 == 5 {
			if err := fastOnly.Run(ctx, rdb, keys("x:"), args...).Err(); err != nil {
				t.Fatalf("step %d does not take the fast path: %v", i, err)
			}
		}
		cmds, err := rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
			fast.EvalSha(ctx, p, keys("f:"), args...)
			general.EvalSha(ctx, p, keys("g:"), args...)
			for _, z := range []string{"a", "b"} {
				p.HGetAll(ctx, "f:{c}:"+z+":tb")
				p.HGetAll(ctx, "g:{c}:"+z+":tb")
				p.PTTL(ctx, "f:{c}:"+z+":tb")
				p.PTTL(ctx, "g:{c}:"+z+":tb")
			}
			return nil
		})
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if f, g := cmds[0].(*redis.Cmd).Val(), cmds[1].(*redis.Cmd).Val(); !reflect.DeepEqual(f, g) {
			t.Fatalf("step %d: reply %v, general path %v", i, f, g)
		}
		for j := 2; j < len(cmds); j += 4 {
			f, g := cmds[j].(*redis.MapStringStringCmd).Val(), cmds[j+1].(*redis.MapStringStringCmd).Val()
			if !reflect.DeepEqual(f, g) {
				t.Fatalf("step %d: state %v, general path %v", i, f, g)
			}
			// Set in the same transaction, each from its own read of the clock: equal but for the
			// time between the two scripts, a millisecond on an idle machine, more on a loaded one.
			ft, gt := cmds[j+2].(*redis.DurationCmd).Val(), cmds[j+3].(*redis.DurationCmd).Val()
			if d := ft - gt; d < -20*time.Millisecond || d > 20*time.Millisecond {
				t.Fatalf("step %d: TTL %v, general path %v", i, ft, gt)
			}
		}
	}
}
