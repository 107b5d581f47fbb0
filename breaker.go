package ratelimitredis

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// The circuit breaker of a Redis server: after breakerTrips consecutive failed decisions it
// opens, and fail_mode applies at once, without touching Redis, for defaultBreakerOpenFor; then
// one probe decision goes to Redis (half-open): success closes the breaker, failure opens it again.
// Standalone and Sentinel have one breaker per client; Redis Cluster one per node (see
// sharedClient.acquire).
const breakerTrips = 5

// defaultBreakerOpenFor is how long a breaker stays open before its probe. Tests lengthen it
// through Handler.breakerOpenFor.
const defaultBreakerOpenFor = 500 * time.Millisecond

// errNotCalled releases a breaker's permission without an outcome: the decision was not sent,
// because the breaker of another node it needed refused it. Excluded, it counts neither as a
// success nor as a failure, and frees a half-open breaker's probe for another decision.
var errNotCalled = errors.New("decision not sent: another node's circuit breaker refused it")

// breaker is the circuit breaker of one Redis server (or of a cluster's slot map, while it is
// not known yet).
type breaker struct {
	cb *gobreaker.TwoStepCircuitBreaker[struct{}]
	// name is the server's address (for a standalone or Sentinel client, its addresses), never
	// its password.
	name string
	// lastErr is the error of the latest failed decision, for the log line of the opening.
	lastErr atomic.Pointer[error]
	// quiet is true while the breaker is closed with no failure counted: allow then asks
	// nothing of cb (whose Allow takes a lock and allocates) and hands out fastDone, which
	// reports only a failure. A success would only have reset a count that is 0 already.
	quiet atomic.Bool
	// fastDone is allow's report function while quiet, made once.
	fastDone func(error)
	// allowed counts the decisions allow has let through, quiet or not.
	allowed atomic.Uint64
}

// newBreaker returns the circuit breaker of the Redis server named name (its address). cluster
// is, for a node of a Redis Cluster, the cluster's seed addresses, logged with the node. Every
// change of state is logged once; the failure that opened it is taken from lastErr, and logged
// with its reason (go-redis errors never hold the password).
func newBreaker(name, cluster string, openFor time.Duration) *breaker {
	b := &breaker{name: name}
	b.quiet.Store(true)
	b.fastDone = b.reportQuiet
	b.cb = gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        name,
		MaxRequests: 1,
		Timeout:     openFor,
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= breakerTrips },
		IsExcluded:  excluded,
		OnStateChange: func(name string, from, to gobreaker.State) {
			log := caddy.Log().Named("http.handlers.rate_limit_redis").With(zap.String("redis", name))
			if cluster != "" {
				log = log.With(zap.String("cluster", cluster))
			}
			switch {
			case to == gobreaker.StateOpen && from == gobreaker.StateClosed:
				var err error
				if p := b.lastErr.Load(); p != nil {
					err = *p
				}
				log.Error("redis failing: circuit breaker open; fail_mode applies without calling redis",
					zap.String("reason", string(failureReason(err))), zap.Error(err), zap.Int("consecutive_failures", breakerTrips),
					zap.Duration("probe_after", openFor))
			case to == gobreaker.StateClosed:
				log.Info("redis answering again: circuit breaker closed")
			default: // open <-> half-open: a probe every openFor while Redis stays down
				if c := log.Check(zap.DebugLevel, "circuit breaker state change"); c != nil {
					c.Write(zap.String("from", from.String()), zap.String("to", to.String()))
				}
			}
		},
	})
	return b
}

// State is the breaker's state.
func (b *breaker) State() gobreaker.State { return b.cb.State() }

// Counts are the breaker's counts in its current state.
func (b *breaker) Counts() gobreaker.Counts { return b.cb.Counts() }

// allow asks the breaker for permission to send a decision. done reports its outcome: nil for
// an answer, the error otherwise (errNotCalled when it was not sent). The error when the breaker
// refuses wraps gobreaker.ErrOpenState or ErrTooManyRequests and names the server.
func (b *breaker) allow() (done func(error), err error) {
	if b.quiet.Load() {
		b.allowed.Add(1)
		return b.fastDone, nil
	}
	report, err := b.cb.Allow()
	if err != nil {
		return nil, fmt.Errorf("redis %s: %w", b.name, err)
	}
	b.allowed.Add(1)
	return func(err error) {
		if err != nil && !excluded(err) {
			b.lastErr.Store(&err)
		}
		report(err)
		if err == nil && b.cb.State() == gobreaker.StateClosed && b.cb.Counts().ConsecutiveFailures == 0 {
			b.quiet.Store(true)
		}
	}, nil
}

// reportQuiet reports the outcome of a decision allowed while the breaker was quiet: a failure
// leaves the quiet state and is counted by cb as any other (cb is closed then, so its Allow
// always permits). Decisions under way at that moment that succeed go unreported; those sent
// after it are reported until cb is closed with no failure counted again.
func (b *breaker) reportQuiet(err error) {
	if err == nil || excluded(err) {
		return
	}
	failed := err // a copy: taking err's own address would move it to the heap on every call
	b.lastErr.Store(&failed)
	b.quiet.Store(false)
	if report, aerr := b.cb.Allow(); aerr == nil {
		report(err)
	}
}

// excluded reports whether a decision's error says nothing of the Redis server: the client went
// away (its context canceled), the decision was not sent, or Redis Cluster refused it with
// TRYAGAIN until it failed (a slot being migrated: its node answers).
func excluded(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, errNotCalled) || errors.Is(err, limiter.ErrMigrating)
}

// allowAll asks every breaker of bs for permission to send one decision that needs all their
// servers. When one refuses, the permissions given are released (errNotCalled) and its error
// returned: the decision cannot succeed without that server, and calling the others would only
// charge and then refund them. release reports the decision's outcome to every breaker of bs.
func allowAll(bs []*breaker) (release func(error), err error) {
	if len(bs) == 1 {
		return bs[0].allow()
	}
	dones := make([]func(error), 0, len(bs))
	for _, b := range bs {
		done, err := b.allow()
		if err != nil {
			for _, d := range dones {
				d(errNotCalled)
			}
			return nil, err
		}
		dones = append(dones, done)
	}
	return func(err error) {
		for _, d := range dones {
			d(err)
		}
	}, nil
}

// isBreakerOpen reports whether err is the breaker refusing a call (open, or half-open with its
// probe already under way).
func isBreakerOpen(err error) bool {
	return errors.Is(err, gobreaker.ErrOpenState) || errors.Is(err, gobreaker.ErrTooManyRequests)
}
