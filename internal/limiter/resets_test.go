package limiter_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestResetListenerSubscribeFailed: a listener whose first subscription fails (its Redis does
// not answer) tells SubscribeFailed, naming the channel.
func TestResetListenerSubscribeFailed(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(freeport.Must(t)), MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = down.Close() })
	rl := limiter.NewResetListener(down)
	failed := make(chan string, 1)
	rl.SubscribeFailed = func(channel string, err error) {
		if err != nil {
			failed <- channel
		}
	}
	t.Cleanup(func() { _ = rl.Close() })
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", DenyCacheKeys: 100})
	rl.Add(l)
	req := limiter.Request{Zone: tb("api", 1, 1.0/3600), Key: "alice", Cost: 1}
	allow(t, l, req)
	allow(t, l, req) // denied and cached: the listener subscribes
	select {
	case ch := <-failed:
		if ch != "rl:reset" {
			t.Fatalf("SubscribeFailed(%q), want rl:reset", ch)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("SubscribeFailed not called within 10s of a subscription to a Redis that is not there")
	}
}
