package limiter

import (
	"fmt"
	"math"
	"regexp"
	"time"
)

// Algorithm is a zone's rate limiting algorithm.
type Algorithm uint8

// The algorithms.
const (
	// TokenBucket: a bucket of Capacity tokens that starts full and refills continuously at
	// RefillRate tokens/s; a request taking cost tokens is admitted iff the bucket holds at least
	// cost tokens.
	TokenBucket Algorithm = iota + 1
	// SlidingWindow is the sliding window log: a request taking cost slots is admitted iff the
	// requests admitted in the last Window plus cost are at most Limit.
	SlidingWindow
)

// Bounds of zone parameters. They keep every number exact in Lua's doubles, every TTL within
// what Redis accepts, and a sliding window log (one sorted set entry per admitted slot) bounded.
const (
	MaxCapacity      = 1 << 53   // tokens
	MaxLimit         = 1_000_000 // requests per window
	MinWindow        = time.Millisecond
	MaxWindow        = 366 * 24 * time.Hour
	MaxZoneNameBytes = 64
)

// ParseAlgorithm returns the algorithm named s: "token_bucket" or "sliding_window".
func ParseAlgorithm(s string) (Algorithm, error) {
	switch s {
	case "token_bucket":
		return TokenBucket, nil
	case "sliding_window":
		return SlidingWindow, nil
	}
	return 0, fmt.Errorf("algorithm %q must be token_bucket or sliding_window", s)
}

// String returns the algorithm's configuration name.
func (a Algorithm) String() string {
	switch a {
	case TokenBucket:
		return "token_bucket"
	case SlidingWindow:
		return "sliding_window"
	}
	return fmt.Sprintf("Algorithm(%d)", uint8(a))
}

// tag is the algorithm's suffix in Redis keys, so that changing a zone's algorithm never meets a
// key of the other type (WRONGTYPE).
func (a Algorithm) tag() string {
	if a == SlidingWindow {
		return "sw"
	}
	return "tb"
}

// Zone is one rate limit's parameters. Only the fields of its Algorithm are used.
type Zone struct {
	// Name is part of every Redis key of the zone: see ValidZoneName.
	Name      string
	Algorithm Algorithm
	// Capacity is the token bucket size in tokens (1 to MaxCapacity).
	Capacity int64
	// RefillRate is the token bucket refill rate in tokens/s (> 0).
	RefillRate float64
	// Limit is the sliding window log's requests per Window (1 to MaxLimit).
	Limit int64
	// Window is the sliding window log's length (MinWindow to MaxWindow).
	Window time.Duration
	// MaxCost is the largest cost a request may take (1 to Quota); a request of a larger cost can
	// never be admitted (Redis is asked for the state, and charges nothing). 0: the quota.
	MaxCost int64
}

// maxCost is MaxCost, or the quota when it is 0.
func (z *Zone) maxCost() int64 {
	if z.MaxCost > 0 {
		return z.MaxCost
	}
	return z.Quota()
}

var zoneNameRE = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// ValidZoneName reports whether name can name a zone: 1 to 64 bytes of [A-Za-z0-9_.-]. Zone names
// go into Redis keys, metric labels and response headers, so the alphabet is kept safe.
func ValidZoneName(name string) bool { return zoneNameRE.MatchString(name) }

// Validate returns an error naming the first parameter of z that is missing or out of range.
func (z *Zone) Validate() error {
	if !ValidZoneName(z.Name) {
		return fmt.Errorf("zone name %q must be 1 to %d characters of A-Z a-z 0-9 _ . -", z.Name, MaxZoneNameBytes)
	}
	switch z.Algorithm {
	case TokenBucket:
		if z.Capacity < 1 || z.Capacity > MaxCapacity {
			return fmt.Errorf("zone %s: capacity %d must be between 1 and 2^53", z.Name, z.Capacity)
		}
		if !(z.RefillRate > 0) || math.IsInf(z.RefillRate, 0) {
			return fmt.Errorf("zone %s: refill_rate %v must be a number of tokens per second > 0", z.Name, z.RefillRate)
		}
		if fill := float64(z.Capacity) / z.RefillRate; fill > MaxWindow.Seconds() {
			return fmt.Errorf("zone %s: an empty bucket takes %.0fs to refill (capacity / refill_rate); at most %v is supported",
				z.Name, fill, MaxWindow)
		}
		if z.Limit != 0 || z.Window != 0 {
			return fmt.Errorf("zone %s: limit and window belong to algorithm sliding_window, not token_bucket", z.Name)
		}
	case SlidingWindow:
		if z.Limit < 1 || z.Limit > MaxLimit {
			return fmt.Errorf("zone %s: limit %d must be between 1 and %d", z.Name, z.Limit, MaxLimit)
		}
		if z.Window < MinWindow || z.Window > MaxWindow {
			return fmt.Errorf("zone %s: window %v must be between %v and %v", z.Name, z.Window, MinWindow, MaxWindow)
		}
		if z.Capacity != 0 || z.RefillRate != 0 {
			return fmt.Errorf("zone %s: capacity and refill_rate belong to algorithm token_bucket, not sliding_window", z.Name)
		}
	default:
		return fmt.Errorf("zone %s: unknown algorithm %v", z.Name, z.Algorithm)
	}
	if z.MaxCost < 0 || z.MaxCost > z.Quota() {
		return fmt.Errorf("zone %s: max_cost %d must be between 1 and the zone's quota %d", z.Name, z.MaxCost, z.Quota())
	}
	return nil
}

// Quota is the most a zone admits at once: the token bucket's Capacity or the sliding window's
// Limit. A request whose cost exceeds it can never be admitted.
func (z *Zone) Quota() int64 {
	if z.Algorithm == SlidingWindow {
		return z.Limit
	}
	return z.Capacity
}

// PolicyWindow is the time over which Quota applies: the sliding window's Window, or the time a
// token bucket takes to refill from empty (Capacity / RefillRate). It is the `w` of the IETF
// RateLimit-Policy header.
func (z *Zone) PolicyWindow() time.Duration {
	if z.Algorithm == SlidingWindow {
		return z.Window
	}
	return time.Duration(float64(z.Capacity) / z.RefillRate * float64(time.Second))
}
