package ratelimitredis

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// blockSites is a site of three routes /i1/, /i2/, /i3/, each with its own rate_limit_redis
// handler (its own Limiter and deny cache: three instances) on the Redis at addrs, with a login
// zone of 2 requests a second per X-Client and a 1h penalty box, and an org zone of 100 per
// X-Org (another client key: another hash slot on Redis Cluster).
func blockSites(addrs string) string {
	var b strings.Builder
	for i := 1; i <= 3; i++ {
		fmt.Fprintf(&b, `
	route /i%d/* {
		rate_limit_redis {
			redis {
				address %s
			}
			timeout 5s
			zone login {
				key {http.request.header.X-Client}
				algorithm sliding_window
				limit 2
				window 1s
				block 1h
				block_max 24h
			}
			zone org {
				match header X-Org *
				key {http.request.header.X-Org}
				capacity 100
				refill_rate 1/1h
			}
		}
		respond "ok"
	}`, i, addrs)
	}
	return b.String()
}

// retryAfterNear fails unless r is a 429 whose Retry-After (s) is in (want - 60, want], as are
// X-RateLimit-Reset, and whose X-RateLimit-Remaining is 0: a block's remaining time.
func retryAfterNear(t *testing.T, step string, r caddytest.Response, want int) {
	t.Helper()
	ra, _ := strconv.Atoi(r.Header.Get("Retry-After"))
	reset, _ := strconv.Atoi(r.Header.Get("X-RateLimit-Reset"))
	if r.Status != 429 || ra <= want-60 || ra > want || reset <= want-60 || reset > want || r.Header.Get("X-RateLimit-Remaining") != "0" {
		t.Fatalf("%s: %d %v, want 429 with Retry-After and X-RateLimit-Reset just under %d, X-RateLimit-Remaining 0", step, r.Status, r.Header, want)
	}
}

// TestBlockThreeInstances, on one Redis and on a Redis Cluster: a block started on one instance
// refuses the client on the others once its window has room again, with Retry-After the
// block's remaining time, and charges none of the request's zones; GET state shows it; an admin
// DELETE of the state lifts it on every instance; an admin PUT …/block refuses a client that
// never went over the limit on every instance, until DELETE lifts it too.
func TestBlockThreeInstances(t *testing.T) {
	for _, topo := range []string{"standalone", "cluster"} {
		t.Run(topo, func(t *testing.T) {
			var addrs string
			var stateOf func(key string) string
			if topo == "cluster" {
				c := redistest.StartCluster(t, 3)
				addrs = strings.Join(c.Addrs(), " ")
				stateOf = func(key string) string {
					slot := c.Nodes[0].Do("CLUSTER", "KEYSLOT", key).(int64)
					return fmt.Sprint(c.NodeOf(int(slot)).Do("GET", key))
				}
			} else {
				srv := redistest.Start(t)
				addrs = srv.Addr
				stateOf = func(key string) string { return fmt.Sprint(srv.Do("GET", key)) }
			}
			ac := startCaddyAdmin(t, blockSites(addrs))
			mallory := []string{"X-Client", "mallory", "X-Org", "acme"}
			ac.Get("/i1/login", mallory...).Expect(t, "1st", 200, "ok")
			ac.Get("/i2/login", mallory...).Expect(t, "2nd", 200, "ok")
			retryAfterNear(t, "3rd, over the limit: the block starts", ac.Get("/i3/login", mallory...), 3600)

			// The window has room again after 1s; the block refuses on every instance.
			redistest.WaitFor(t, 10*time.Second, "login's window to have room again", func() bool {
				st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=login&key=mallory", 200)
				return len(st) == 1 && st[0].Count != nil && *st[0].Count == 0
			})
			for _, i := range []string{"1", "2", "3"} {
				retryAfterNear(t, "blocked on /i"+i, ac.Get("/i"+i+"/login", mallory...), 3600)
			}
			st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=login&key=mallory", 200)
			now := time.Now().UnixMilli()
			if len(st) != 1 || st[0].BlockedUntilMs == nil || *st[0].BlockedUntilMs <= now+3_500_000 || *st[0].BlockedUntilMs > now+3_600_000 ||
				st[0].Strikes == nil || *st[0].Strikes != 1 || st[0].LastBlockMs == nil || *st[0].LastBlockMs != 3_600_000 ||
				st[0].RetryAfterMs <= 3_500_000 || st[0].Remaining != 0 {
				t.Fatalf("state of the blocked client: %+v", st)
			}
			// Charged in org only by the two admitted requests: a blocked or denied one charges no zone.
			org := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=org&key=acme", 200)
			if len(org) != 1 || org[0].Remaining != 98 {
				t.Fatalf("org: %+v, want 98 left", org)
			}
			if v := stateOf("rl:{mallory}:login:block"); !strings.HasSuffix(v, ":3600000000:1") {
				t.Fatalf("block key holds %q", v)
			}

			adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=login&key=mallory", 200)
			for _, i := range []string{"1", "2"} {
				ac.Get("/i"+i+"/login", mallory...).Expect(t, "after DELETE, /i"+i, 200, "ok")
			}

			eve := []string{"X-Client", "eve"}
			blk := adminJSON[[]adminapi.BlockResult](t, ac, "PUT", "/rate_limit_redis/block?zone=login&key=eve&for=30m", 200)
			if len(blk) != 1 || blk[0].RedisKey != "rl:{eve}:login:block" || !blk[0].Broadcast {
				t.Fatalf("PUT block: %+v", blk)
			}
			for _, i := range []string{"1", "2", "3"} {
				retryAfterNear(t, "eve on /i"+i, ac.Get("/i"+i+"/login", eve...), 1800)
			}
			adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=login&key=eve", 200)
			for _, i := range []string{"1", "2"} {
				ac.Get("/i"+i+"/login", eve...).Expect(t, "eve after DELETE, /i"+i, 200, "ok")
			}
			ac.expectError(t, "PUT", "/rate_limit_redis/block?zone=org&key=eve&for=1m", 400,
				"zone org has no block: give it one (block <duration>) so that its decisions read the client's block")
		})
	}
}

// TestBlockBesideLeaseHandler: a route whose requests go through a zone with a block and a
// lease zone of the same client, fail_mode closed. Once the client is hot (the lease zone asks
// for grants), its requests are still decided: exactly 20 admitted, then 429s, never a 503; and a
// bystander on another route of the same Redis is admitted.
func TestBlockBesideLeaseHandler(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`route /a {
		rate_limit_redis {
			redis {
				address %[1]s
			}
			timeout 2s
			fail_mode closed
			zone login {
				key {http.request.header.X-Key}
				algorithm sliding_window
				limit 20
				window 1h
				block 1h
			}
			zone api {
				key {http.request.header.X-Key}
				capacity 1000
				refill_rate 1/1h
				lease {
					max 20
					ttl 1m
				}
			}
		}
		respond "ok"
	}
	route /b {
		rate_limit_redis {
			redis {
				address %[1]s
			}
			timeout 2s
			fail_mode closed
			zone other {
				key {http.request.header.X-Key}
				capacity 1000
				refill_rate 1/1h
			}
		}
		respond "ok"
	}`, srv.Addr))
	want := strings.TrimSpace(strings.Repeat("200 ", 20) + strings.Repeat("429 ", 40))
	if got := cs.Statuses(60, "/a", "X-Key", "mallory"); got != want {
		t.Errorf("60 requests through the block and lease zones: %s, want %s", got, want)
	}
	if got := cs.Statuses(5, "/b", "X-Key", "bystander"); got != "200 200 200 200 200" {
		t.Fatalf("a bystander on another route: %s, want 5 × 200", got)
	}
}
