package ratelimitredis

import (
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// Lease is a token_bucket or fixed_window zone's leasing: the tokens (window slots) of a client
// that sends at least two requests' worth per ttl to this instance are taken from Redis in
// grants before they are spent, and spent in process, with no Redis call, until the grant is
// spent or its ttl ends (a fixed window's grant at the latest when its window does); its unspent
// tokens then go back to Redis. Redis has charged every token an instance admits
// before it admits it, so a zone never admits more than without lease; near the limit grants
// shrink to one request's cost, so a denial is Redis's count's. What it costs: up to max tokens
// per other instance stranded for up to ttl (a client denied on one instance while another
// holds a grant of it), and headers that are an estimate. Not with max_wait, count_status or
// charge, nor on the sliding window algorithms. See docs/decisions.md ("Leases").
type Lease struct {
	// The most tokens one grant takes: 1 to 2^53. A client is granted about 1.25 × its rate on
	// this instance × ttl, at most this and at most half of what Redis has left. Required.
	Max int64 `json:"max,omitempty"`

	// A grant's lifetime, as a duration (JSON: nanoseconds or a duration string): 10ms to 1m.
	// Its unspent tokens go back to Redis when it ends; those of an instance that crashed count
	// as spent 1s after it. Required.
	TTL caddy.Duration `json:"ttl,omitempty"`
}

// limiterLease is the limiter's parameters of l; nil when l is.
func (l *Lease) limiterLease() *limiter.Lease {
	if l == nil {
		return nil
	}
	return &limiter.Lease{Max: l.Max, TTL: time.Duration(l.TTL)}
}
