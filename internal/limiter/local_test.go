package limiter_test

import (
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

func TestLocalTokenBucket(t *testing.T) {
	l := limiter.NewLocal(0)
	t0 := time.Unix(1_700_000_000, 0)
	req := limiter.Request{Zone: tb("api", 3, 1), Key: "alice", Cost: 1}
	for i := int64(1); i <= 3; i++ {
		want(t, "request "+strconv.FormatInt(i, 10), l.Allow([]limiter.Request{req}, t0),
			limiter.Decision{Allowed: true, Limit: 3, Remaining: 3 - i, Reset: time.Duration(i) * time.Second, Next: time.Second})
	}
	want(t, "4th", l.Allow([]limiter.Request{req}, t0), limiter.Decision{Limit: 3, RetryAfter: time.Second, Reset: 3 * time.Second, Next: time.Second})
	want(t, "after 1s", l.Allow([]limiter.Request{req}, t0.Add(time.Second)),
		limiter.Decision{Allowed: true, Limit: 3, Remaining: 0, Reset: 3 * time.Second, Next: time.Second})
	big := limiter.Request{Zone: req.Zone, Key: "alice", Cost: 4}
	want(t, "cost above capacity", l.Allow([]limiter.Request{big}, t0.Add(time.Hour)),
		limiter.Decision{Limit: 3, Remaining: 3, Unsatisfiable: true})
}

func TestLocalSlidingWindowIsABucketOfTheSameRate(t *testing.T) {
	l := limiter.NewLocal(0)
	t0 := time.Unix(1_700_000_000, 0)
	req := limiter.Request{Zone: sw("login", 2, 10*time.Second), Key: "alice", Cost: 1}
	l.Allow([]limiter.Request{req}, t0)
	want(t, "2nd", l.Allow([]limiter.Request{req}, t0), limiter.Decision{Allowed: true, Limit: 2, Reset: 10 * time.Second, Next: 5 * time.Second})
	// 2 per 10s refills one slot every 5s.
	want(t, "3rd", l.Allow([]limiter.Request{req}, t0), limiter.Decision{Limit: 2, RetryAfter: 5 * time.Second, Reset: 10 * time.Second, Next: 5 * time.Second})
}

func TestLocalAllOrNothing(t *testing.T) {
	l := limiter.NewLocal(0)
	t0 := time.Unix(1_700_000_000, 0)
	reqs := []limiter.Request{{Zone: tb("wide", 5, 1), Key: "k", Cost: 1}, {Zone: tb("narrow", 1, 0.01), Key: "k", Cost: 1}}
	l.Allow(reqs, t0)
	for i := 0; i < 3; i++ {
		if d := l.Allow(reqs, t0); d.Allowed || d.Zone != 1 {
			t.Fatalf("denial %d: %+v, want denied by zone 1", i, d)
		}
	}
	// The denials charged "wide" nothing: 4 tokens left.
	if d := l.Allow(reqs[:1], t0); d.Remaining != 3 {
		t.Fatalf("wide after denials: %+v, want 3 remaining after this request", d)
	}
}

func TestLocalBoundedKeys(t *testing.T) {
	l := limiter.NewLocal(2)
	t0 := time.Unix(1_700_000_000, 0)
	z := tb("z", 1, 0.001)
	for _, k := range []string{"a", "b", "c"} { // "a" is evicted by "c"
		l.Allow([]limiter.Request{{Zone: z, Key: k, Cost: 1}}, t0)
	}
	if d := l.Allow([]limiter.Request{{Zone: z, Key: "c", Cost: 1}}, t0); d.Allowed {
		t.Fatal("c was admitted twice from a bucket of 1")
	}
	if d := l.Allow([]limiter.Request{{Zone: z, Key: "a", Cost: 1}}, t0); !d.Allowed {
		t.Fatal("a, evicted, should start again with a full bucket")
	}
}

// TestLocalDeniedRequestsStoreNothing: a flood of denied requests with fresh keys evicts no
// client from fail_mode local's buckets. Caddyfile.example's zones, 64 buckets per zone. Alice spends her 3 login attempts and
// carol her 5 API requests; then one address sends 1,000 requests with fresh API keys, the
// first 40 admitted, the rest denied by its ip zone. The denied requests store no bucket, in any
// zone: alice's login and carol's API bucket stay spent. Control: the same without the flood.
func TestLocalDeniedRequestsStoreNothing(t *testing.T) {
	for _, flood := range []bool{false, true} {
		l := limiter.NewLocal(64)
		t0 := time.Unix(1_700_000_000, 0)
		api, ip, login := tb("api", 5, 0.1), tb("ip", 40, 0.5), sw("login", 3, time.Minute)
		reqs := func(key, addr string, toLogin bool) []limiter.Request {
			r := []limiter.Request{{Zone: api, Key: key, Cost: 1}, {Zone: ip, Key: addr, Cost: 1}}
			if toLogin {
				r = append(r, limiter.Request{Zone: login, Key: addr, Cost: 1})
			}
			return r
		}
		for range 3 {
			l.Allow(reqs("198.51.100.66", "198.51.100.66", true), t0)
		}
		for range 5 {
			l.Allow(reqs("carol", "198.51.100.67", false), t0)
		}
		if flood {
			admitted := 0
			for i := range 1000 {
				if l.Allow(reqs("fresh-"+strconv.Itoa(i), "198.51.100.99", false), t0).Allowed {
					admitted++
				}
			}
			if admitted != 40 {
				t.Fatalf("the flood: %d admitted, want 40 (its ip zone's capacity)", admitted)
			}
		}
		if d := l.Allow(reqs("198.51.100.66", "198.51.100.66", true), t0); d.Allowed || d.Zone != 2 {
			t.Fatalf("flood %t: alice's 4th login attempt %+v, want denied by her spent login bucket", flood, d)
		}
		if d := l.Allow(reqs("carol", "198.51.100.67", false), t0); d.Allowed || d.Zone != 0 {
			t.Fatalf("flood %t: carol's 6th API request %+v, want denied by her spent api bucket", flood, d)
		}
	}
}

// TestLocalZonesEvictOnlyTheirOwn: each zone has its own bound. 1,000 admitted requests with
// fresh keys in one zone (64 buckets per zone) evict that zone's older buckets, never another
// zone's: alice's spent login bucket stays.
func TestLocalZonesEvictOnlyTheirOwn(t *testing.T) {
	l := limiter.NewLocal(64)
	t0 := time.Unix(1_700_000_000, 0)
	api, login := tb("api", 5, 0.1), sw("login", 3, time.Minute)
	for range 3 {
		l.Allow([]limiter.Request{{Zone: login, Key: "alice", Cost: 1}}, t0)
	}
	for i := range 1000 {
		if d := l.Allow([]limiter.Request{{Zone: api, Key: "fresh-" + strconv.Itoa(i), Cost: 1}}, t0); !d.Allowed {
			t.Fatalf("fresh key %d denied: %+v", i, d)
		}
	}
	if d := l.Allow([]limiter.Request{{Zone: login, Key: "alice", Cost: 1}}, t0); d.Allowed {
		t.Fatalf("alice's 4th login attempt after a flood in another zone: %+v, want denied", d)
	}
	// The api zone's own bound still holds: its first fresh key was evicted and starts full.
	if d := l.Allow([]limiter.Request{{Zone: api, Key: "fresh-0", Cost: 1}}, t0); !d.Allowed || d.Remaining != 4 {
		t.Fatalf("fresh-0, evicted from its zone: %+v, want a full bucket again (4 remaining)", d)
	}
}

func TestLocalExactUnderConcurrency(t *testing.T) {
	l := limiter.NewLocal(0)
	z := tb("z", 100, 1e-6)
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for i := 0; i < 2000; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if l.Allow([]limiter.Request{{Zone: z, Key: "shared", Cost: 1}}, time.Now()).Allowed {
				admitted.Add(1)
			}
		}()
	}
	wg.Wait()
	if admitted.Load() != 100 {
		t.Fatalf("admitted %d, want exactly 100", admitted.Load())
	}
}

// TestLocalShaping: fail_mode local shapes as Redis does: capacity 10, refill 10/s, max_wait 2s,
// 31 requests at once: 10 at once, 20 held 100ms more each, the 31st denied until it would be
// held 2s; NoWait admits only what the bucket holds now.
func TestLocalShaping(t *testing.T) {
	l := limiter.NewLocal(0)
	t0 := time.Unix(1_700_000_000, 0)
	z := tb("api", 10, 10)
	z.MaxWait = 2 * time.Second
	req := limiter.Request{Zone: z, Key: "alice", Cost: 1}
	for i := int64(1); i <= 10; i++ {
		want(t, "request "+strconv.FormatInt(i, 10), l.Allow([]limiter.Request{req}, t0), limiter.Decision{
			Allowed: true, Limit: 10, Remaining: 10 - i, Reset: time.Duration(i) * 100 * time.Millisecond, Next: 100 * time.Millisecond,
		})
	}
	for k := int64(1); k <= 20; k++ {
		step := time.Duration(k) * 100 * time.Millisecond
		want(t, "held request "+strconv.FormatInt(k, 10), l.Allow([]limiter.Request{req}, t0), limiter.Decision{
			Allowed: true, Delay: step, Limit: 10, Reset: time.Second + step, Next: step + 100*time.Millisecond,
		})
	}
	want(t, "31st", l.Allow([]limiter.Request{req}, t0), limiter.Decision{Limit: 10, RetryAfter: 100 * time.Millisecond, Reset: 3 * time.Second, Next: 2100 * time.Millisecond})
	noWait := req
	noWait.NoWait = true
	want(t, "NoWait, 3s later", l.Allow([]limiter.Request{noWait}, t0.Add(3*time.Second)), limiter.Decision{
		Allowed: true, Limit: 10, Remaining: 9, Reset: 100 * time.Millisecond, Next: 100 * time.Millisecond,
	})
	for range 9 {
		l.Allow([]limiter.Request{noWait}, t0.Add(3*time.Second))
	}
	want(t, "NoWait, empty", l.Allow([]limiter.Request{noWait}, t0.Add(3*time.Second)), limiter.Decision{
		Limit: 10, RetryAfter: 100 * time.Millisecond, Reset: time.Second, Next: 100 * time.Millisecond,
	})
	big := limiter.Request{Zone: z, Key: "bob", Cost: 11}
	want(t, "cost above capacity, however long max_wait", l.Allow([]limiter.Request{big}, t0), limiter.Decision{Limit: 10, Remaining: 10, Unsatisfiable: true})
}
