package limiter_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestWrongPasswordIsARedisError: when Redis refuses the client's password, Allow returns
// Redis's WRONGPASS error, with decisions sent one by one and in a pipeline, never a
// bad response (go-redis leaves a pipeline's commands unset when AUTH fails).
func TestWrongPasswordIsARedisError(t *testing.T) {
	t.Parallel()
	srv := redistest.StartWithPassword(t, "right")
	for _, pipelined := range []bool{false, true} {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr, Password: "wrong", ContextTimeoutEnabled: true})
		t.Cleanup(func() { _ = c.Close() })
		opts := limiter.Options{KeyPrefix: "rl:"}
		if pipelined {
			opts.Batcher = limiter.NewBatcher(c, 2)
			t.Cleanup(opts.Batcher.Close)
		}
		l := limiter.New(c, opts)
		_, err := l.Allow(context.Background(), []limiter.Request{{Zone: tb("z", 1, 1), Key: "k", Cost: 1}})
		if err == nil || errors.Is(err, limiter.ErrBadResponse) || !strings.Contains(err.Error(), "WRONGPASS") {
			t.Fatalf("pipelined %t: Allow with a wrong password: err = %v, want Redis's WRONGPASS", pipelined, err)
		}
	}
}
