package ratelimitredis

import (
	"context"
	"errors"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
)

// The circuit breaker of a Redis client: after breakerTrips consecutive failed decisions it
// opens, and fail_mode applies at once, without touching Redis, for breakerOpenFor; then one
// probe decision goes to Redis (half-open): success closes the breaker, failure opens it again.
const breakerTrips = 5

// breakerOpenFor is a variable only so that tests can lengthen it.
var breakerOpenFor = 500 * time.Millisecond

// newBreaker returns the circuit breaker of the client named name (its address, never its
// password). Every change of state is logged once; the failure that opened it is taken from
// lastErr, and logged with its reason (go-redis errors never hold the password).
func newBreaker(name string, lastErr *atomic.Pointer[error]) *gobreaker.CircuitBreaker[limiter.Decision] {
	return gobreaker.NewCircuitBreaker[limiter.Decision](gobreaker.Settings{
		Name:        name,
		MaxRequests: 1,
		Timeout:     breakerOpenFor,
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= breakerTrips },
		// A client that went away cancels the decision's context: that says nothing of Redis.
		IsExcluded: func(err error) bool { return errors.Is(err, context.Canceled) },
		OnStateChange: func(name string, from, to gobreaker.State) {
			log := caddy.Log().Named("http.handlers.rate_limit_redis").With(zap.String("redis", name))
			switch {
			case to == gobreaker.StateOpen && from == gobreaker.StateClosed:
				var err error
				if p := lastErr.Load(); p != nil {
					err = *p
				}
				log.Error("redis failing: circuit breaker open; fail_mode applies without calling redis",
					zap.String("reason", failureReason(err)), zap.Error(err), zap.Int("consecutive_failures", breakerTrips),
					zap.Duration("probe_after", breakerOpenFor))
			case to == gobreaker.StateClosed:
				log.Info("redis answering again: circuit breaker closed")
			default: // open <-> half-open: a probe every breakerOpenFor while Redis stays down
				if c := log.Check(zap.DebugLevel, "circuit breaker state change"); c != nil {
					c.Write(zap.String("from", from.String()), zap.String("to", to.String()))
				}
			}
		},
	})
}

// isBreakerOpen reports whether err is the breaker refusing a call (open, or half-open with its
// probe already under way).
func isBreakerOpen(err error) bool {
	return errors.Is(err, gobreaker.ErrOpenState) || errors.Is(err, gobreaker.ErrTooManyRequests)
}
