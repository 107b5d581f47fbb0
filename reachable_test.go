package ratelimitredis

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestWarnIfUnreachable checks the PING sent when a client is created: one warning naming the
// address, the error and what each fail_mode does when nothing listens on the address, a stopped
// (SIGSTOP) Redis or a wrong password; none when Redis answers, even with an error of its own
// (an ACL user without +ping gets NOPERM); nothing at all once the config has unloaded.
func TestWarnIfUnreachable(t *testing.T) {
	live := redistest.Start(t)
	admin := redis.NewClient(&redis.Options{Addr: live.Addr})
	t.Cleanup(func() { _ = admin.Close() })
	if err := admin.Do(context.Background(), "ACL", "SETUSER", "noping", "on", ">pw", "~*", "+@all", "-ping").Err(); err != nil {
		t.Fatal(err)
	}
	paused := redistest.Start(t)
	paused.Pause()
	t.Cleanup(paused.Resume)
	dead := fmt.Sprintf("127.0.0.1:%d", freeport.Must(t))

	for _, c := range []struct {
		name       string
		opts       redis.Options
		modes      []string
		warn       string // a part of the warning's error; "" for no warning
		wantEffect string
	}{
		{"nothing listening", redis.Options{Addr: dead}, []string{FailOpen}, "connection refused", "open admits every request"},
		{"stopped", redis.Options{Addr: paused.Addr, ContextTimeoutEnabled: true}, []string{FailClosed, FailOpen}, "context deadline exceeded", "closed answers 503"},
		{"wrong password", redis.Options{Addr: live.Addr, Username: "noping", Password: "wrong"}, []string{FailLocal}, "WRONGPASS", "local limits per instance"},
		{"live", redis.Options{Addr: live.Addr}, []string{FailOpen}, "", ""},
		{"no +ping", redis.Options{Addr: live.Addr, Username: "noping", Password: "pw"}, []string{FailOpen}, "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			rdb := redis.NewClient(&c.opts)
			t.Cleanup(func() { _ = rdb.Close() })
			core, logs := observer.New(zapcore.DebugLevel)
			warnIfUnreachable(context.Background(), zap.New(core), rdb, []string{c.opts.Addr}, 300*time.Millisecond, c.modes)
			warns := logs.FilterLevelExact(zapcore.WarnLevel).All()
			if c.warn == "" {
				if len(warns) != 0 || logs.FilterMessage("redis reachable at load").Len() != 1 {
					t.Fatalf("Redis answers, got %v; want no warning and one debug line", logs.All())
				}
				return
			}
			if len(warns) != 1 {
				t.Fatalf("%d warnings, want 1: %v", len(warns), logs.All())
			}
			w := warns[0]
			f := w.ContextMap()
			if !strings.HasPrefix(w.Message, "redis unreachable at load") || !strings.Contains(w.Message, c.wantEffect) ||
				!strings.Contains(fmt.Sprint(f["error"]), c.warn) || fmt.Sprint(f["redis"]) != "["+c.opts.Addr+"]" ||
				fmt.Sprint(f["fail_mode"]) != fmt.Sprint(c.modes) {
				t.Fatalf("warning %q %v: want it to name %s, error %q and fail_mode %v (%q)", w.Message, f, c.opts.Addr, c.warn, c.modes, c.wantEffect)
			}
		})
	}

	t.Run("unloaded", func(t *testing.T) {
		rdb := redis.NewClient(&redis.Options{Addr: paused.Addr, ContextTimeoutEnabled: true, DialTimeout: 500 * time.Millisecond})
		t.Cleanup(func() { _ = rdb.Close() })
		core, logs := observer.New(zapcore.DebugLevel)
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(50*time.Millisecond, cancel)
		warnIfUnreachable(ctx, zap.New(core), rdb, []string{paused.Addr}, 10*time.Second, []string{FailOpen})
		if logs.Len() != 0 {
			t.Fatalf("config unloaded while the PING waited: got %v, want nothing logged", logs.All())
		}
	})
}

// TestAcquireClientCreated checks that only the first handler on a connection config creates
// its client, and so PINGs Redis at load: a second handler, or a reload's, shares it.
func TestAcquireClientCreated(t *testing.T) {
	srv := redistest.Start(t)
	r := (&RedisConfig{Addresses: []string{srv.Addr}}).resolve(DefaultTimeout, defaultBreakerOpenFor)
	for i, want := range []bool{true, false, false} {
		_, key, created, err := acquireClient(r)
		if err != nil || created != want {
			t.Fatalf("acquiring %d: created %v, %v; want %v", i, created, err, want)
		}
		t.Cleanup(func() { _, _ = clients.Delete(key) })
	}
}
