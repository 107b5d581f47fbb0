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
	// FixedWindow: one counter per client and window, the window a Window duration (aligned to
	// the Unix epoch) or a calendar Period in Location; a request taking cost is admitted iff the
	// window's count plus cost is at most Limit. The count starts at 0 when the window does.
	FixedWindow
	// SlidingWindowCounter approximates the sliding window log in constant memory: the current
	// fixed window's count plus the previous window's count weighted by the share of the previous
	// window still inside the sliding window (Window long, ending now); a request taking cost is
	// admitted iff that estimate plus cost is at most Limit. It assumes the previous window's
	// requests were spread evenly: when they were not, the sliding window ending now can hold up
	// to 2 × Limit admitted requests (never more than Limit in one fixed window).
	SlidingWindowCounter
	// Concurrency limits the requests of a client in flight at once: a request is admitted iff
	// fewer than Limit of the client's requests hold a slot. Its slot is a member of a sorted set
	// scored by its deadline, taken at admission (Request.Hold is how long it is held, required)
	// and given back by Limiter.Settle once the response is complete; a slot whose deadline has
	// passed is free. Limiter.Refresh moves the deadlines of the slots still in flight on, so that
	// a long response keeps its slot and an instance that died holds none beyond its hold time. A
	// request takes one slot: its cost is 1.
	Concurrency
)

// Period is a fixed window zone's calendar period.
type Period uint8

// The calendar periods of a fixed window zone. Each starts at the start of its hour, day, week
// (Monday) or month in the zone's Location.
const (
	NoPeriod Period = iota
	Hour
	Day
	Week
	Month
)

// ParsePeriod returns the period named s: "hour", "day", "week" or "month".
func ParsePeriod(s string) (Period, error) {
	switch s {
	case "hour":
		return Hour, nil
	case "day":
		return Day, nil
	case "week":
		return Week, nil
	case "month":
		return Month, nil
	}
	return NoPeriod, fmt.Errorf("period %q must be hour, day, week or month", s)
}

// String returns the period's configuration name.
func (p Period) String() string {
	return [...]string{"", "hour", "day", "week", "month"}[min(int(p), 4)]
}

// nominal is the period's usual length: what RateLimit-Policy advertises as its window (a month
// as 30 days; a day of a daylight saving change as 24 hours).
func (p Period) nominal() time.Duration {
	return [...]time.Duration{0, time.Hour, 24 * time.Hour, 7 * 24 * time.Hour, 30 * 24 * time.Hour}[min(int(p), 4)]
}

// Bounds of zone parameters. They keep every number exact in Lua's doubles, every TTL within
// what Redis accepts, and a sliding window log (one sorted set entry per admitted slot) bounded.
const (
	MaxCapacity      = 1 << 53   // tokens
	MaxLimit         = 1_000_000 // requests per window
	MinWindow        = time.Millisecond
	MaxWindow        = 366 * 24 * time.Hour
	MaxZoneNameBytes = 64
	// MaxConcurrency bounds a concurrency zone's Limit: one sorted set entry per slot in flight.
	MaxConcurrency = 100_000
	// MaxMaxWait bounds a token bucket zone's MaxWait: a request held longer would outlast the
	// timeouts of most clients and proxies, and is better told to come back (429, Retry-After).
	MaxMaxWait = time.Minute
)

// algorithms are the algorithms' configuration names and Redis key tags, by Algorithm.
var algorithms = [...]struct{ name, tag string }{
	TokenBucket:          {"token_bucket", "tb"},
	SlidingWindow:        {"sliding_window", "sw"},
	FixedWindow:          {"fixed_window", "fw"},
	SlidingWindowCounter: {"sliding_window_counter", "sc"},
	Concurrency:          {"concurrency", "cc"},
}

// ParseAlgorithm returns the algorithm named s: "token_bucket", "sliding_window",
// "fixed_window", "sliding_window_counter" or "concurrency".
func ParseAlgorithm(s string) (Algorithm, error) {
	for a, v := range algorithms {
		if a > 0 && v.name == s {
			return Algorithm(a), nil
		}
	}
	return 0, fmt.Errorf("algorithm %q must be token_bucket, sliding_window, fixed_window, sliding_window_counter or concurrency", s)
}

// String returns the algorithm's configuration name.
func (a Algorithm) String() string {
	if a > 0 && int(a) < len(algorithms) {
		return algorithms[a].name
	}
	return fmt.Sprintf("Algorithm(%d)", uint8(a))
}

// tag is the algorithm's suffix in Redis keys (and its name in the script's arguments), so that
// changing a zone's algorithm never meets a key of the other type (WRONGTYPE).
func (a Algorithm) tag() string {
	if a > 0 && int(a) < len(algorithms) {
		return algorithms[a].tag
	}
	return "tb"
}

// windowed reports whether a's quota is Limit (every algorithm but the token bucket: the window
// algorithms count requests in windows of Limit, concurrency the requests in flight).
func (a Algorithm) windowed() bool { return a != TokenBucket }

// Zone is one rate limit's parameters. Only the fields of its Algorithm are used.
type Zone struct {
	// Name is part of every Redis key of the zone: see ValidZoneName.
	Name      string
	Algorithm Algorithm
	// Capacity is the token bucket size in tokens (1 to MaxCapacity).
	Capacity int64
	// RefillRate is the token bucket refill rate in tokens/s (> 0).
	RefillRate float64
	// Limit is the requests per Window (or Period) of the window algorithms (1 to MaxLimit; a
	// fixed window or sliding window counter up to MaxCapacity: their memory does not grow with it),
	// or a concurrency zone's requests of a client in flight at once (1 to MaxConcurrency).
	Limit int64
	// Window is the window's length (MinWindow to MaxWindow). A fixed window zone has a Window or
	// a Period, not both.
	Window time.Duration
	// Period is a fixed window zone's calendar period, in Location (UTC when nil).
	Period Period
	// Location is the time zone of Period: a day is the calendar day there, with its daylight
	// saving changes. nil: UTC.
	Location *time.Location
	// MaxCost is the largest cost a request may take (1 to Quota); a request of a larger cost can
	// never be admitted (Redis is asked for the state, and charges nothing). 0: the quota.
	MaxCost int64
	// MaxWait (token bucket only; 0 to MaxMaxWait) shapes instead of rejecting: a request the
	// bucket cannot serve now but would within MaxWait is admitted at once by reserving its
	// tokens (the bucket goes into debt, at most MaxWait × RefillRate tokens), and
	// Decision.Delay says how long to hold it: until the bucket would have held its cost. A
	// request that would have to wait longer is denied as without MaxWait, charging nothing. 0:
	// never hold, deny at once.
	MaxWait time.Duration
	// Lease, when set (token bucket without MaxWait, or fixed window), leases the zone's tokens
	// or window slots to the instance in grants that it spends in process (see Lease). nil:
	// every request decided in Redis.
	Lease *Lease

	// boxed are the zone's numbers as script arguments, boxed once by Prepare.
	boxed *zoneArgs
}

// zoneArgs are a zone's numbers boxed as script arguments (an int64 or float64 converted to an
// interface allocates), and the numbers they were boxed from.
type zoneArgs struct {
	capacity, limit, windowUs int64
	rate                      float64
	capacityArg, limitArg     any
	windowArg, rateArg        any
}

// Prepare boxes the zone's numbers as script arguments once, so that a decision does not
// allocate them (two allocations per zone and decision). Call it after the zone's fields are
// set and before the zone is shared; it is optional. A copy of a prepared zone whose numbers
// were changed afterwards boxes its own per decision.
func (z *Zone) Prepare() {
	w := z.Window.Microseconds()
	z.boxed = &zoneArgs{
		capacity: z.Capacity, limit: z.Limit, windowUs: w, rate: z.RefillRate,
		capacityArg: z.Capacity, limitArg: z.Limit, windowArg: w, rateArg: z.RefillRate,
	}
}

// bucketArgs are the token bucket's capacity (tokens) and refill rate (tokens/s) as script
// arguments.
func (z *Zone) bucketArgs() (capacity, rate any) {
	if b := z.boxed; b != nil && b.capacity == z.Capacity && b.rate == z.RefillRate {
		return b.capacityArg, b.rateArg
	}
	return z.Capacity, z.RefillRate
}

// windowArgs are a window algorithm's limit (requests) and window (µs) as script arguments.
func (z *Zone) windowArgs() (limit, windowUs any) {
	if b := z.boxed; b != nil && b.limit == z.Limit && b.windowUs == z.Window.Microseconds() {
		return b.limitArg, b.windowArg
	}
	return z.Limit, z.Window.Microseconds()
}

// MaxCostOrQuota is the largest cost a request may take: MaxCost, or the quota when it is 0.
// It also bounds what a charge settled after the response may be (Limiter.Settle).
func (z *Zone) MaxCostOrQuota() int64 {
	if z.Algorithm == Concurrency {
		return 1 // one slot per request
	}
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
		if z.Period != NoPeriod || z.Location != nil {
			return fmt.Errorf("zone %s: period and time_zone belong to algorithm fixed_window, not token_bucket", z.Name)
		}
		if z.MaxWait < 0 || z.MaxWait > MaxMaxWait {
			return fmt.Errorf("zone %s: max_wait %v must be between 0 and %v", z.Name, z.MaxWait, MaxMaxWait)
		}
	case SlidingWindow, FixedWindow, SlidingWindowCounter:
		maxLimit := int64(MaxCapacity) // a counter: memory does not grow with the limit
		if z.Algorithm == SlidingWindow {
			maxLimit = MaxLimit // one sorted set entry per admitted unit
		}
		if z.Limit < 1 || z.Limit > maxLimit {
			return fmt.Errorf("zone %s: limit %d must be between 1 and %d", z.Name, z.Limit, maxLimit)
		}
		switch {
		case z.Period != NoPeriod && z.Algorithm != FixedWindow:
			return fmt.Errorf("zone %s: period belongs to algorithm fixed_window, not %s", z.Name, z.Algorithm)
		case z.Period != NoPeriod && z.Window != 0:
			return fmt.Errorf("zone %s: a fixed_window zone has a window or a period, not both", z.Name)
		case z.Period > Month:
			return fmt.Errorf("zone %s: unknown period %d", z.Name, z.Period)
		case z.Period == NoPeriod && (z.Window < MinWindow || z.Window > MaxWindow):
			return fmt.Errorf("zone %s: window %v must be between %v and %v", z.Name, z.Window, MinWindow, MaxWindow)
		case z.Location != nil && z.Period == NoPeriod:
			return fmt.Errorf("zone %s: time_zone applies to a period", z.Name)
		}
		if z.Capacity != 0 || z.RefillRate != 0 {
			return fmt.Errorf("zone %s: capacity and refill_rate belong to algorithm token_bucket, not %s", z.Name, z.Algorithm)
		}
		if z.MaxWait != 0 {
			return fmt.Errorf("zone %s: %s", z.Name, errMaxWaitWindowed(z.Algorithm))
		}
	case Concurrency:
		if err := z.validateConcurrency(); err != nil {
			return err
		}
	default:
		return fmt.Errorf("zone %s: unknown algorithm %v", z.Name, z.Algorithm)
	}
	if z.MaxCost < 0 || z.MaxCost > z.Quota() {
		return fmt.Errorf("zone %s: max_cost %d must be between 1 and the zone's quota %d", z.Name, z.MaxCost, z.Quota())
	}
	return z.validateLease()
}

// validateConcurrency checks a concurrency zone: a Limit, and none of the parameters of time.
func (z *Zone) validateConcurrency() error {
	switch {
	case z.Limit < 1 || z.Limit > MaxConcurrency:
		return fmt.Errorf("zone %s: limit %d must be between 1 and %d", z.Name, z.Limit, MaxConcurrency)
	case z.Capacity != 0 || z.RefillRate != 0:
		return fmt.Errorf("zone %s: capacity and refill_rate belong to algorithm token_bucket, not concurrency", z.Name)
	case z.Window != 0 || z.Period != NoPeriod || z.Location != nil:
		return fmt.Errorf("zone %s: a concurrency zone has no window or period: a slot is held as long as its request", z.Name)
	case z.MaxWait != 0:
		return fmt.Errorf("zone %s: max_wait does not apply to algorithm concurrency: a request is admitted while a slot is free, "+
			"else denied; no queue waits for a slot", z.Name)
	case z.MaxCost > 1:
		return fmt.Errorf("zone %s: max_cost %d: a request takes one slot of a concurrency zone", z.Name, z.MaxCost)
	}
	return nil
}

// errMaxWaitWindowed is why a zone of window algorithm a cannot have a max_wait: a window gives
// its quota back in steps (at the window's end, as each entry leaves), so a held request has no
// exact turn to be given: a fixed window stores no count for the windows to come, and would
// release everything it held at the next window's start at once; a sliding window log would
// keep each reservation's entry for the window and the wait; the counter's estimate is
// approximate. A token bucket drains what was used continuously: its debt is the queue.
func errMaxWaitWindowed(a Algorithm) string {
	return fmt.Sprintf("max_wait applies to algorithm token_bucket only, not %s: a window gives its quota back in steps, "+
		"so a held request would have no exact turn; shape with a token_bucket zone", a)
}

// Quota is the most a zone admits at once: the token bucket's Capacity or the window
// algorithms' Limit. A request whose cost exceeds it can never be admitted.
func (z *Zone) Quota() int64 {
	if z.Algorithm.windowed() {
		return z.Limit
	}
	return z.Capacity
}

// PolicyWindow is the time over which Quota applies: the window, a period's nominal length (a
// month as 30 days), or the time a token bucket takes to refill from empty (Capacity /
// RefillRate). It is the `w` of the IETF RateLimit-Policy header.
func (z *Zone) PolicyWindow() time.Duration {
	switch {
	case z.Period != NoPeriod:
		return z.Period.nominal()
	case z.Algorithm.windowed():
		return z.Window
	}
	return time.Duration(float64(z.Capacity) / z.RefillRate * float64(time.Second))
}

// WindowAt returns the fixed window of a fixed window zone that holds t: [start, end), with
// start <= t < end. A Window is aligned to the Unix epoch; a Period is a calendar period in
// Location (UTC when nil), computed by calendarWindow: a day of a daylight saving change is 23
// or 25 hours long, a month as long as it is, and each window starts where the one before it
// ended.
func (z *Zone) WindowAt(t time.Time) (start, end time.Time) {
	if z.Period == NoPeriod {
		w := z.Window.Microseconds()
		us := t.UnixMicro()
		s := us - ((us%w)+w)%w
		return time.UnixMicro(s), time.UnixMicro(s + w)
	}
	loc := z.Location
	if loc == nil {
		loc = time.UTC
	}
	return calendarWindow(z.Period, t, loc)
}
