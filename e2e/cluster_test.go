package e2e_test

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestEndToEndCluster runs Caddy against a 3-primary Redis Cluster given as several addresses:
// 600 concurrent requests for each of 6 clients spread over the primaries admit exactly 20 per
// client; and a request whose zones are keyed by two clients in different slots, denied by one,
// charges neither.
func TestEndToEndCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode closed
		timeout 5s
		zone user {
			key {http.request.header.X-User}
			capacity 20
			refill_rate 1/24h
		}
		zone org {
			match header X-Org *
			key {http.request.header.X-Org}
			capacity 1
			refill_rate 1/24h
		}
	}
	respond "ok"`, strings.Join(c.Addrs(), " ")))

	// Six users, two on each primary (by the slot of their hash tag).
	var users []string
	perNode := make([]int, len(c.Nodes))
	for i := 0; len(users) < 6; i++ {
		u := "user-" + strconv.Itoa(i)
		n := c.Nodes[0].Do("CLUSTER", "KEYSLOT", u).(int64) * int64(len(c.Nodes)) / 16384
		if perNode[n] < 2 {
			perNode[n]++
			users = append(users, u)
		}
	}
	lc := caddytest.NewLoadClient(cs)
	const perUser = 600
	admitted := make([]atomic.Int64, len(users))
	var failed atomic.Int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	for i := 0; i < perUser*len(users); i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(u int) {
			defer wg.Done()
			defer func() { <-sem }()
			r, err := lc.Get("/", "X-User", users[u])
			switch {
			case err != nil || (r.Status != 200 && r.Status != 429):
				failed.Add(1)
			case r.Status == 200:
				admitted[u].Add(1)
			}
		}(i % len(users))
	}
	wg.Wait()
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d requests failed", n)
	}
	for i, u := range users {
		if n := admitted[i].Load(); n != 20 {
			t.Errorf("user %s: %d of %d admitted, want exactly 20", u, n, perUser)
		}
	}

	// Cross-slot: user "cross-a" and org "cross-b" hash to different slots.
	userKey := "rl:{cross-a}:user:tb" // <key_prefix>{<client key>}:<zone>:tb (docs/decisions.md)
	if a, b := c.Nodes[0].Do("CLUSTER", "KEYSLOT", "cross-a"), c.Nodes[0].Do("CLUSTER", "KEYSLOT", "cross-b"); a == b {
		t.Fatalf("the test's keys share slot %v", a)
	}
	cs.Get("/", "X-User", "cross-a", "X-Org", "cross-b").Expect(t, "first request", 200, "ok", "X-RateLimit-Remaining", "0")
	cs.Get("/", "X-User", "cross-a", "X-Org", "cross-b").Expect(t, "org exhausted", 429, "", "X-RateLimit-Limit", "1")
	// The user zone held the second request's charge in its slot, then released it: 19 left,
	// so the next request without an org leaves 18.
	cs.Get("/", "X-User", "cross-a").Expect(t, "user alone", 200, "ok", "X-RateLimit-Remaining", "18")
	if v := c.Client().HGet(t.Context(), userKey, "t").Val(); !strings.HasPrefix(v, "+18") {
		t.Fatalf("user bucket holds %q tokens, want 18.x", v)
	}
}
