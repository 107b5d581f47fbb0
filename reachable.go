package ratelimitredis

import (
	"context"
	"errors"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// loadPingTimeout is how long, at least, the PING sent when a Redis client is created waits for
// its answer (the handler's timeout when that is longer).
const loadPingTimeout = 2 * time.Second

// failModeEffect says what each fail_mode does to a request while Redis cannot be reached.
var failModeEffect = map[string]string{
	FailOpen:   "open admits every request (with X-RateLimit-Degraded: true when headers are on)",
	FailClosed: "closed answers 503 with Retry-After: 1",
	FailLocal:  "local limits per instance, in process",
}

// warnIfUnreachable checks that Redis answers: it opens a TCP connection to each of addrs (the
// server, the Sentinels or the Cluster seeds) until one connects, then sends one PING through
// rdb. When neither succeeds within timeout it logs one warning naming the addresses, the error
// (the dial errors when no address connects, else the PING's: TLS, authentication, no answer)
// and what each of failModes (the handler's and its zones') does until Redis answers; when Redis
// answers it logs at debug level. It returns when the checks do, or soon after ctx ends (the
// config unloaded: then it logs nothing). Provision runs it in the background once per Redis
// client it creates, so that Caddy says at load, not at the first request, that its limits are
// not enforced; loading never waits for it.
//
// A reply that is an error of Redis's own (NOPERM for an ACL without +ping, LOADING, a READONLY
// replica) still means Redis was reached, and is not warned about here: decisions report their
// own errors.
func warnIfUnreachable(ctx context.Context, log *zap.Logger, rdb redis.UniversalClient, addrs []string, timeout time.Duration, failModes []string) {
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	err := dialAny(pctx, addrs)
	if err == nil {
		err = rdb.Ping(pctx).Err()
	}
	if ctx.Err() != nil || errors.Is(err, redis.ErrClosed) {
		return
	}
	if err == nil || isRedisReply(err) {
		log.Debug("redis reachable at load", zap.Strings("redis", addrs))
		return
	}
	effects := make([]string, 0, len(failModes))
	for _, m := range failModes {
		effects = append(effects, failModeEffect[m])
	}
	log.Warn("redis unreachable at load: until it answers, decisions follow fail_mode ("+strings.Join(effects, "; ")+")",
		zap.Strings("redis", addrs), zap.Duration("timeout", timeout), zap.Error(err), zap.Strings("fail_mode", failModes))
}

// dialAny opens a TCP connection to each of addrs in turn, closing it at once, until one
// connects; it returns nil then, else the errors of every address.
func dialAny(ctx context.Context, addrs []string) error {
	var d net.Dialer
	var errs []error
	for _, a := range addrs {
		c, err := d.DialContext(ctx, "tcp", a)
		if err == nil {
			_ = c.Close()
			return nil
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// isRedisReply reports whether err is an error reply of Redis itself (not a failure to reach it:
// a refused or timed-out connection, a TLS or authentication failure at connect).
func isRedisReply(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	msg := re.Error()
	return !strings.HasPrefix(msg, "NOAUTH") && !strings.HasPrefix(msg, "WRONGPASS") && !strings.HasPrefix(msg, "ERR AUTH")
}

// failModesOf returns the distinct fail modes of h and its zones, sorted.
func failModesOf(h *Handler) []string {
	modes := []string{h.FailMode}
	for _, z := range h.Zones {
		modes = append(modes, z.failMode)
	}
	slices.Sort(modes)
	return slices.Compact(modes)
}
