package limiter_test

// Decision correctness: properties the limiter must keep under dropped replies, stalls and
// races. The cross-slot ones run on a one-node Redis Cluster holding every slot, so that
// "alice" and "org1" are in different slots and the hold/settle path runs.

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

func sha(s string) string { h := sha1.Sum([]byte(s)); return hex.EncodeToString(h[:]) }

// afterDecide is a go-redis hook that runs fn once, right after a decide.lua call with holds
// (a cross-slot decision) on a key containing "{alice}" has run on Redis: between alice's hold
// and its settling.
type afterDecide struct {
	fired atomic.Bool
	fn    func()
}

func (h *afterDecide) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *afterDecide) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *afterDecide) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	decide := sha(lua.Decide)
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, c := range cmds {
			// EVALSHA <sha> <numkeys> <keys...> <now> <nonce> <hold> ...
			a := c.Args()
			if len(a) < 4 || (a[1] != decide && a[1] != lua.Decide) || redis.HasErrorPrefix(c.Err(), "NOSCRIPT") {
				continue
			}
			n, _ := strconv.Atoi(fmt.Sprint(a[2]))
			if len(a) > 3+n+2 && strings.Contains(fmt.Sprint(a[3:3+n]), "{alice}") && fmt.Sprint(a[3+n+2]) == "1" &&
				h.fired.CompareAndSwap(false, true) {
				h.fn()
			}
		}
		return err
	}
}

// oneNodeCluster starts a Redis Cluster of one node and returns a cluster client of it with the
// module's retry setting (none).
func oneNodeCluster(t *testing.T) *redis.ClusterClient {
	c := redistest.StartCluster(t, 1)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: -1})
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

func mustAllow(t *testing.T, l *limiter.Limiter, reqs ...limiter.Request) limiter.Decision {
	t.Helper()
	d, err := l.Allow(context.Background(), reqs)
	if err != nil {
		t.Fatalf("Allow: %v", err)
	}
	return d
}

// TestClusterReleaseIsExact: a request charged in one slot and denied in another leaves the
// first slot's bucket exactly as it would be had the request never come, even when the bucket
// would have refilled to its capacity in between, and another request took tokens meanwhile.
func TestClusterReleaseIsExact(t *testing.T) {
	t.Parallel()
	for _, redisClock := range []bool{false, true} {
		t.Run("redis clock "+strconv.FormatBool(redisClock), func(t *testing.T) {
			ccX, ccY := oneNodeCluster(t), (*redis.ClusterClient)(nil)
			ccY = redis.NewClusterClient(&redis.ClusterOptions{Addrs: ccX.Options().Addrs, MaxRetries: -1})
			t.Cleanup(func() { _ = ccY.Close() })
			clk := newClock()
			opts := limiter.Options{KeyPrefix: "rl:", Cluster: true, Now: clk.Now}
			a := tb("a", 10, 1) // 10 tokens, 1/s
			if redisClock {
				opts.Now, a = nil, tb("a", 10, 1000) // 1000/s: 3ms refill the bucket 3 tokens
			}
			X, Y := limiter.New(ccX, opts), limiter.New(ccY, opts)
			b := sw("b", 1, time.Hour)
			user, org := "alice", "org1" // different hash slots
			mustAllow(t, Y, limiter.Request{Zone: b, Key: org, Cost: 1})
			var afterR2 limiter.State
			ccX.AddHook(&afterDecide{fn: func() {
				if redisClock {
					time.Sleep(3 * time.Millisecond)
				} else {
					clk.Advance(3 * time.Second)
				}
				if d := mustAllow(t, Y, limiter.Request{Zone: a, Key: user, Cost: 2}); !d.Allowed {
					t.Errorf("R2 (cost 2) between R1's hold and its release: %+v, want allowed", d)
				}
				afterR2, _ = Y.State(context.Background(), a, user)
			}})
			if d := mustAllow(t, X, limiter.Request{Zone: a, Key: user, Cost: 5}, limiter.Request{Zone: b, Key: org, Cost: 1}); d.Allowed {
				t.Fatalf("R1: %+v, want denied by zone b", d)
			}
			st, err := Y.State(context.Background(), a, user)
			if err != nil {
				t.Fatal(err)
			}
			// Had R1 never come, the bucket held afterR2's tokens and R1's 5 held ones after R2,
			// refilled (and capped) since.
			want := min(10, afterR2.Tokens+5+st.Now.Sub(afterR2.Now).Seconds()*a.RefillRate)
			if math.Abs(st.Tokens-want) > 0.01 {
				t.Fatalf("zone a after the release: %.3f tokens, want %.3f (after R2: %.3f with R1's 5 held)", st.Tokens, want, afterR2.Tokens)
			}
			if !redisClock {
				admitted := 0
				for range 20 {
					if mustAllow(t, Y, limiter.Request{Zone: a, Key: user, Cost: 1}).Allowed {
						admitted++
					}
				}
				if admitted != 8 {
					t.Fatalf("%d cost-1 requests admitted after the release, want 8", admitted)
				}
			}
		})
	}
}

// TestClusterReleaseTouchesOnlyItsBucket: a release reaches only the bucket it charged: not one
// recreated after a reset (or an expiry) between the hold and the release.
func TestClusterReleaseTouchesOnlyItsBucket(t *testing.T) {
	t.Parallel()
	cc := oneNodeCluster(t)
	clk := newClock()
	opts := limiter.Options{KeyPrefix: "rl:", Cluster: true, Now: clk.Now}
	X, Y := limiter.New(cc, opts), limiter.New(cc, opts)
	a, b := tb("a", 10, 0.001), sw("b", 1, time.Hour)
	user, org := "alice", "org1"
	mustAllow(t, Y, limiter.Request{Zone: b, Key: org, Cost: 1})
	cc.AddHook(&afterDecide{fn: func() {
		if _, err := Y.Reset(context.Background(), a, user); err != nil {
			t.Errorf("Reset: %v", err)
		}
		if d := mustAllow(t, Y, limiter.Request{Zone: a, Key: user, Cost: 10}); !d.Allowed {
			t.Errorf("R2 took the whole reset bucket: %+v, want allowed", d)
		}
	}})
	if d := mustAllow(t, X, limiter.Request{Zone: a, Key: user, Cost: 4}, limiter.Request{Zone: b, Key: org, Cost: 1}); d.Allowed {
		t.Fatalf("R1: %+v, want denied by zone b", d)
	}
	if d := mustAllow(t, Y, limiter.Request{Zone: a, Key: user, Cost: 4}); d.Allowed {
		t.Fatalf("R3 after R1's release: %+v, want denied: R2 took the whole bucket after the reset", d)
	}
}

// TestClusterHoldDenialNotCached: a denial caused only by another request's hold is not cached,
// so that the hold's release is seen at once.
func TestClusterHoldDenialNotCached(t *testing.T) {
	t.Parallel()
	cc := oneNodeCluster(t)
	clk := newClock()
	X := limiter.New(cc, limiter.Options{KeyPrefix: "rl:", Cluster: true, Now: clk.Now})
	Y := limiter.New(cc, limiter.Options{KeyPrefix: "rl:", Cluster: true, Now: clk.Now, DenyCacheKeys: 100, DenyCacheMaxAge: time.Hour})
	a, b := tb("a", 1, 1.0/60), sw("b", 1, time.Hour)
	user, org := "alice", "org1"
	req := []limiter.Request{{Zone: a, Key: user, Cost: 1}}
	mustAllow(t, X, limiter.Request{Zone: b, Key: org, Cost: 1})
	cc.AddHook(&afterDecide{fn: func() {
		if d := mustAllow(t, Y, req...); d.Allowed {
			t.Errorf("Y during R1's hold: %+v, want denied", d)
		}
	}})
	mustAllow(t, X, limiter.Request{Zone: a, Key: user, Cost: 1}, limiter.Request{Zone: b, Key: org, Cost: 1})
	if d, ok := Y.Denied(req); ok {
		t.Fatalf("Y's deny cache after the release: %+v, want nothing cached", d)
	}
	if d := mustAllow(t, Y, req...); !d.Allowed {
		t.Fatalf("after the release: %+v, want allowed", d)
	}
}

// twoNodeCluster starts a 2-primary Redis Cluster and returns it, a Limiter on it whose calls
// end at their context's deadline (a stalled node fails its slot alone), and a client key whose
// slot each node owns.
func twoNodeCluster(t *testing.T) (c *redistest.Cluster, l *limiter.Limiter, alice, bob string) {
	t.Helper()
	c = redistest.StartCluster(t, 2)
	perNode := clientsOn(t, c, 1)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), MaxRetries: -1, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = cc.Close() })
	return c, limiter.New(cc, limiter.Options{KeyPrefix: "rl:", Cluster: true}), perNode[0][0], perNode[1][0]
}

// TestClusterDenialStandsAgainstSlotError: when one slot's node fails and another slot denies,
// the request is denied (not failed), and the error is reported in Decision.Err.
func TestClusterDenialStandsAgainstSlotError(t *testing.T) {
	t.Parallel()
	c, l, alice, bob := twoNodeCluster(t)
	za, zb := tb("a", 10, 1), sw("b", 1, time.Hour)
	mustAllow(t, l, limiter.Request{Zone: zb, Key: bob, Cost: 1}) // bob's slot now denies
	mustAllow(t, l, limiter.Request{Zone: za, Key: alice, Cost: 1})
	c.Nodes[0].Pause() // alice's node stalls
	defer c.Nodes[0].Resume()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	d, err := l.Allow(ctx, []limiter.Request{{Zone: za, Key: alice, Cost: 1}, {Zone: zb, Key: bob, Cost: 1}})
	if err != nil || d.Allowed || d.Zone != 1 || d.Err == nil {
		t.Fatalf("got %+v, %v; want denied by zone b with the other slot's error in Err", d, err)
	}
}

// TestClusterShadowSlotFailureLeftOut: when the node of a slot that holds only a shadow zone
// fails, the shadow zone is left out (not Known, its error in Decision.Err) and the enforced
// zone in a healthy slot decides and is charged, exactly; a shadow zone never refuses a request.
func TestClusterShadowSlotFailureLeftOut(t *testing.T) {
	c, l, alice, bob := twoNodeCluster(t)
	enforced, shadow := tb("e", 3, 1.0/3600), tb("s", 100, 1.0/3600)
	shadow.Shadow = true
	mustAllow(t, l, limiter.Request{Zone: shadow, Key: bob, Cost: 1})
	c.Nodes[1].Pause() // the shadow zone's node stalls
	defer c.Nodes[1].Resume()
	for i := range 4 {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		reqs := []limiter.Request{{Zone: enforced, Key: alice, Cost: 1}, {Zone: shadow, Key: bob, Cost: 1}}
		d, err := l.Allow(ctx, reqs)
		cancel()
		if err != nil || d.Allowed != (i < 3) || d.Zone != 0 || d.Err == nil || reqs[1].Result.Known {
			t.Fatalf("request %d: %+v (shadow zone %+v), %v; want decided by zone e alone (admitted: %v), the shadow slot's error in Err",
				i+1, d, reqs[1].Result, err, i < 3)
		}
	}
	st, err := l.State(context.Background(), enforced, alice)
	if err != nil || st.Remaining != 0 {
		t.Fatalf("zone e: %+v, %v; want its 3 tokens charged by the 3 admitted requests", st, err)
	}
}

// TestLocalTimeNeverGoesBack: fail_mode local's limiter never credits a refill twice when
// requests reach it out of time order.
func TestLocalTimeNeverGoesBack(t *testing.T) {
	l := limiter.NewLocal(0)
	z := tb("a", 10, 1)
	t0 := time.Unix(1_700_000_000, 0)
	r := func(c int64) []limiter.Request { return []limiter.Request{{Zone: z, Key: "carol", Cost: c}} }
	l.Allow(r(10), t0)
	admitted := 0
	for _, at := range []time.Duration{2 * time.Second, time.Second, 2 * time.Second, 2 * time.Second} {
		if l.Allow(r(1), t0.Add(at)).Allowed {
			admitted++
		}
	}
	if admitted != 2 {
		t.Fatalf("admitted %d cost-1 requests by t0+2s from an empty 1/s bucket, want 2", admitted)
	}
}

// TestBucketTTLNotEarly: a token bucket's key never expires before its used tokens have drained
// (Redis clock, many parameter sets).
func TestBucketTTLNotEarly(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client()
	ctx := context.Background()
	l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:"})
	for i := 0; i < 1000; i++ {
		zi := i % 35
		rate := []float64{0.5, 3, 77.7, 1000, 123456.789}[zi%5]
		z := tb("ttl"+strconv.Itoa(zi), int64(1+zi*3), rate)
		key := "k" + strconv.Itoa(i%13)
		mustAllow(t, l, limiter.Request{Zone: z, Key: key, Cost: 1 + int64(i%3)})
		k := limiter.StateKey("rl:", z, key)
		v, _ := rdb.HMGet(ctx, k, "u", "ts").Result()
		when, _ := rdb.Do(ctx, "PEXPIRETIME", k).Int64()
		if v[0] == nil || when < 0 {
			continue
		}
		used, _ := strconv.ParseFloat(v[0].(string), 64)
		ts, _ := strconv.ParseFloat(v[1].(string), 64)
		drained := ts + used/rate*1e6 // µs
		if gone := float64(when+1) * 1000; gone < drained {
			t.Fatalf("%s expires %.0fµs before its %.3f used tokens have drained", k, drained-gone, used)
		}
	}
}

// TestDenialLengthensTTL: after a reload slows the refill or lengthens the window, a denial
// lengthens the key's TTL to what the parameters in force need, so the state never vanishes
// early.
func TestDenialLengthensTTL(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	mustAllow(t, l, limiter.Request{Zone: tb("api", 100, 100), Key: "frank", Cost: 100}) // TTL 1s
	if d := mustAllow(t, l, limiter.Request{Zone: tb("api", 100, 1), Key: "frank", Cost: 50}); d.Allowed {
		t.Fatalf("cost 50 right after the bucket was drained: %+v, want denied", d)
	}
	if pttl := srv.Do("PTTL", "rl:{frank}:api:tb").(int64); pttl < 99_000 {
		t.Fatalf("token bucket PTTL after the denial at 1/s: %dms, want about the 100s its 100 used tokens take to drain", pttl)
	}
	login := sw("login", 2, time.Second)
	mustAllow(t, l, limiter.Request{Zone: login, Key: "frank", Cost: 1})
	mustAllow(t, l, limiter.Request{Zone: login, Key: "frank", Cost: 1}) // TTL 1s
	if d := mustAllow(t, l, limiter.Request{Zone: sw("login", 2, time.Hour), Key: "frank", Cost: 1}); d.Allowed {
		t.Fatalf("third request under the 1h window: %+v, want denied", d)
	}
	if pttl := srv.Do("PTTL", "rl:{frank}:login:sw").(int64); pttl < 3599_000 {
		t.Fatalf("sliding window PTTL after the denial under 1h: %dms, want about 1h", pttl)
	}
}

// TestRetryAfterNeverShort: a request retried exactly its Retry-After later is admitted, for
// large costs and awkward rates where float rounding could make the wait 1µs short.
func TestRetryAfterNeverShort(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	for i, c := range []struct {
		capacity int64
		rate     float64
	}{{1 << 50, 3.7e7}, {1 << 45, 1e9 / 3}, {999_999_999_937, 123_456.789}, {1 << 52, 7.3e8}, {10, 1.0 / 3}} {
		z := tb("big"+strconv.Itoa(i), c.capacity, c.rate)
		req := limiter.Request{Zone: z, Key: "k", Cost: c.capacity}
		mustAllow(t, l, req)
		d := mustAllow(t, l, req)
		if d.Allowed {
			t.Fatalf("%+v: second full-capacity request admitted", c)
		}
		clk.Advance(d.RetryAfter)
		if d := mustAllow(t, l, req); !d.Allowed {
			t.Fatalf("%+v: denied again exactly Retry-After later: %+v", c, d)
		}
	}
}

//go:embed testdata/decide_v1.lua
var decideV1 string

// TestPreviousEncodingOverlap: during a rolling upgrade, instances running the previous script
// (which stored the tokens left) and this one (which stores what is used) share buckets: each
// reads the other's writes, and together they admit exactly the capacity.
func TestPreviousEncodingOverlap(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client()
	clk := newClock()
	l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	old := redis.NewScript(decideV1)
	z := tb("api", 10, 0.001)
	key := limiter.StateKey("rl:", z, "alice")
	oldAllow := func(cost int64) bool {
		v, err := old.Run(context.Background(), rdb, []string{key}, clk.Now().UnixMicro(), "old", "tb", 10, 0.001, cost).Slice()
		if err != nil {
			t.Fatalf("previous script: %v", err)
		}
		return v[0].(int64) == 1
	}
	admitted := int64(0)
	for i := 0; i < 30; i++ {
		if i%2 == 0 {
			if oldAllow(1) {
				admitted++
			}
		} else if mustAllow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1}).Allowed {
			admitted++
		}
	}
	if admitted != 10 {
		t.Fatalf("the two versions admitted %d requests together, want the capacity 10", admitted)
	}
}

// TestCapacityChangeTakesEffect: a token bucket stores what is used, so a raised capacity gives
// a client the difference at once and a lowered one takes it away at once.
func TestCapacityChangeTakesEffect(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	count := func(capacity int64) int {
		n := 0
		for n < 100 && mustAllow(t, l, limiter.Request{Zone: tb("api", capacity, 1.0/3600), Key: "k", Cost: 1}).Allowed {
			n++
		}
		return n
	}
	if n := count(2); n != 2 {
		t.Fatalf("capacity 2: %d admitted, want 2", n)
	}
	if n := count(12); n != 10 {
		t.Fatalf("raised to 12: %d more admitted, want 10", n)
	}
	if n := count(5); n != 0 {
		t.Fatalf("lowered to 5 with 12 used: %d admitted, want 0", n)
	}
	clk.Advance(8 * time.Hour) // 8 of the 12 used tokens drained: 4 used, 1 left under capacity 5
	if n := count(5); n != 1 {
		t.Fatalf("capacity 5 after 8 tokens drained: %d admitted, want 1", n)
	}
}

// TestResetReachesOtherInstances: two instances (Limiters on their own clients) deny a client
// from their deny caches; a reset through one reaches the other's cache through Redis pub/sub
// at once, and without the broadcast the other admits the client within its max age.
func TestResetReachesOtherInstances(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	z := sw("quota", 3, time.Hour)
	req := []limiter.Request{{Zone: z, Key: "client", Cost: 1}}
	for _, broadcast := range []bool{true, false} {
		t.Run("broadcast "+strconv.FormatBool(broadcast), func(t *testing.T) {
			srv.Do("FLUSHALL")
			maxAge := time.Hour
			if !broadcast {
				maxAge = 500 * time.Millisecond
			}
			instance := func() *limiter.Limiter {
				rdb := srv.Client()
				l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", DenyCacheKeys: 100, DenyCacheMaxAge: maxAge})
				if broadcast {
					rl := limiter.NewResetListener(rdb)
					t.Cleanup(func() { _ = rl.Close() })
					rl.Add(l)
				}
				return l
			}
			A, B := instance(), instance()
			for range 3 {
				mustAllow(t, A, req...)
			}
			for _, l := range []*limiter.Limiter{A, B} {
				allow(t, l, req...)
				if d := allow(t, l, req...); d.Allowed || !d.Cached {
					t.Fatalf("before the reset: %+v, want a cached denial", d)
				}
			}
			if broadcast { // both listen once they have cached a denial
				redistest.WaitFor(t, 5*time.Second, "two subscribers", func() bool {
					n, _ := srv.Client().PubSubNumSub(context.Background(), limiter.ResetChannel("rl:")).Result()
					return n[limiter.ResetChannel("rl:")] == 2
				})
			}
			if _, err := A.Reset(context.Background(), z, "client"); err != nil {
				t.Fatal(err)
			}
			if d := allow(t, A, req...); !d.Allowed {
				t.Fatalf("A after its reset: %+v, want allowed", d)
			}
			start := time.Now()
			limit := 5 * time.Second // the message's way through Redis
			if !broadcast {
				limit = maxAge + 200*time.Millisecond
			}
			redistest.WaitFor(t, limit, "B admits the client", func() bool {
				_, cached := B.Denied(req)
				return !cached
			})
			if d := mustAllow(t, B, req...); !d.Allowed {
				t.Fatalf("B after the reset: %+v, want allowed", d)
			}
			t.Logf("B admitted the client %v after the reset", time.Since(start).Round(time.Millisecond))
		})
	}
}

// TestOverMemoryRefusesTheWholeCall: Redis over maxmemory (noeviction) refuses every decision
// with OOM before it runs, so a flood of fresh clients cannot grow Redis past its limit.
func TestOverMemoryRefusesTheWholeCall(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	window, bucket := sw("day", 100, 24*time.Hour), tb("api", 100, 1)
	maxmemory := int64(2 << 20)
	oom := 0
	for i := 0; i < 40_000 && oom < 100; i++ {
		key := "client-" + strconv.Itoa(i)
		_, err := l.Allow(context.Background(), []limiter.Request{{Zone: window, Key: key, Cost: 1}, {Zone: bucket, Key: key, Cost: 1}})
		if redis.HasErrorPrefix(err, "OOM") {
			oom++
		} else if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	if oom == 0 {
		t.Fatal("no decision was refused with OOM")
	}
	info := srv.Do("INFO", "memory").(string)
	used := infoField(info, "used_memory")
	if used > maxmemory+maxmemory/10 {
		t.Fatalf("used_memory %d, want about maxmemory %d at most", used, maxmemory)
	}
}

func infoField(info, name string) int64 {
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, name+":"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	return math.MinInt64
}
