package limiter

import (
	"context"
	"fmt"
	"math"
	"regexp"
	"strconv"
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
	// AdaptiveConcurrency is Concurrency whose limit is learnt from the upstream's latency, one
	// limit in Redis for every instance (see Adaptive and adaptive.go): a request is admitted iff
	// fewer than the limit in force of the client's requests hold a slot, that limit between
	// Adaptive.MinLimit and Limit (the ceiling).
	AdaptiveConcurrency
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

// algorithm describes an algorithm by the properties the code asks of it, so that code asks for
// a property ("its charges are recorded") rather than naming algorithms. A new algorithm is a row
// of algorithms, its Lua function in decide.lua, its state reader and its arguments here.
type algorithm struct {
	name string // its configuration name
	tag  string // its Redis key suffix and decide.lua's name for it
	// capacity: its quota is Capacity, refilled at RefillRate (token bucket); else Limit.
	capacity bool
	// window: it counts in a Window; calendar: in a Period too (fixed window).
	window, calendar bool
	// recorded: a charge held after the response, or taken across hash slots, is recorded in a
	// key of its own, which the settlement finds (window counters: their count holds no holds).
	recorded bool
	// slots: a request holds one slot while it runs, given back when it ends (concurrency).
	slots bool
	// entries: it stores one entry per unit of cost admitted (sliding window log).
	entries bool
	// shapes: MaxWait may hold a request for its turn (token bucket).
	shapes bool
	// grants: a request may be granted more units than its cost (Lease, UpTo).
	grants bool
	// adapts: its limit is learnt in Redis from the latency its requests report when they end
	// (adaptive concurrency): its decisions read it, its settlements report a sample.
	adapts bool
	// holdsInState: a charge held for later (a Hold, a charge across hash slots) is a hold in the
	// state key itself, which settle.lua commits or gives back (token bucket); the window
	// counters record theirs in keys of their own (recorded), a sliding window log's entries are
	// its charge, and a concurrency slot is its request.
	holdsInState bool
	// maxLimit is the largest Limit (a sliding window log stores one entry per admitted unit, a
	// concurrency zone one per slot in flight); 0 for a capacity.
	maxLimit int64
	// state reads a client's state in a zone of the algorithm into s at now (µs; Limiter.State).
	state func(l *Limiter, ctx context.Context, z *Zone, now int64, s *State) error
	// args returns the zone's three numbers of decide.lua's call for r, sent at ref, taking cost:
	// its quota, its rate or window, and its cost (see call.go).
	args func(r *Request, ref time.Time, cost int64) (quota, rate, costArg any)
}

// algorithms are the algorithms' descriptions, by Algorithm.
var algorithms = [...]algorithm{
	TokenBucket: {name: "token_bucket", tag: "tb", capacity: true, shapes: true, grants: true, holdsInState: true,
		state: (*Limiter).bucketState},
	SlidingWindow: {name: "sliding_window", tag: "sw", window: true, entries: true, maxLimit: MaxLimit,
		state: (*Limiter).windowState},
	FixedWindow: {name: "fixed_window", tag: "fw", window: true, calendar: true, recorded: true, grants: true, maxLimit: MaxCapacity,
		state: (*Limiter).fixedWindowState},
	SlidingWindowCounter: {name: "sliding_window_counter", tag: "sc", window: true, recorded: true, maxLimit: MaxCapacity,
		state: (*Limiter).counterState},
	Concurrency: {name: "concurrency", tag: "cc", slots: true, maxLimit: MaxConcurrency,
		state: (*Limiter).slotState},
	AdaptiveConcurrency: {name: "adaptive_concurrency", tag: "ac", slots: true, adapts: true, maxLimit: MaxConcurrency,
		state: (*Limiter).slotState},
}

// The algorithms' call arguments, set apart from their rows only because they read zones'
// properties, which read the table (Go refuses the initialization cycle).
func init() {
	algorithms[TokenBucket].args = bucketCallArgs
	algorithms[SlidingWindow].args = windowCallArgs
	algorithms[FixedWindow].args = fixedWindowCallArgs
	algorithms[SlidingWindowCounter].args = windowCallArgs
	algorithms[Concurrency].args = slotCallArgs
	algorithms[AdaptiveConcurrency].args = adaptiveCallArgs
}

// describe returns a's description; the zero algorithm (no property) for an unknown a.
func (a Algorithm) describe() algorithm {
	if a > 0 && int(a) < len(algorithms) {
		return algorithms[a]
	}
	return algorithm{}
}

// recorded reports whether a's held charges are recorded in keys of their own (algorithm.recorded).
func (a Algorithm) recorded() bool { return a.describe().recorded }

// holdsInState reports whether a's held charges are holds in its state key (algorithm.holdsInState).
func (a Algorithm) holdsInState() bool { return a.describe().holdsInState }

// keptByCall reports whether keeping a held charge of a takes a settle.lua call: a hold to
// commit, a record to delete, a slot to give back; a sliding window log's entries are kept as
// they are.
func (a Algorithm) keptByCall() bool {
	d := a.describe()
	return d.holdsInState || d.recorded || d.slots
}

// MaxLimit is the largest Limit of a zone of algorithm a (a sliding window log stores one entry
// per admitted unit, a concurrency zone one per slot in flight); 0 when a's quota is a capacity.
func (a Algorithm) MaxLimit() int64 { return a.describe().maxLimit }

// algorithmOfTag returns the algorithm whose tag (decide.lua's name for it) is t; 0 for none.
func algorithmOfTag(t string) Algorithm {
	for a, v := range algorithms {
		if a > 0 && v.tag == t {
			return Algorithm(a)
		}
	}
	return 0
}

// Adapts reports whether a zone's limit is learnt (adaptive concurrency; algorithm.adapts).
func (a Algorithm) Adapts() bool { return a.describe().adapts }

// HoldsSlots reports whether a request holds one of a zone's slots while it runs, given back when
// it ends (concurrency): its quota is the requests in flight, and it has no window or cost.
func (a Algorithm) HoldsSlots() bool { return a.describe().slots }

// QuotaIsCapacity reports whether a zone's quota is its Capacity, refilled at its RefillRate
// (token bucket); else it is its Limit.
func (a Algorithm) QuotaIsCapacity() bool { return a.describe().capacity }

// StoresEntries reports whether a zone stores one entry per unit of cost admitted (sliding
// window log), so that its cost is bounded by the memory that takes.
func (a Algorithm) StoresEntries() bool { return a.describe().entries }

// shapes reports whether MaxWait applies to a (token bucket).
func (a Algorithm) shapes() bool { return a.describe().shapes }

// grants reports whether a request of a may be granted more than its cost (Lease, UpTo).
func (a Algorithm) grants() bool { return a.describe().grants }

// ParseAlgorithm returns the algorithm named s: "token_bucket", "sliding_window",
// "fixed_window", "sliding_window_counter", "concurrency" or "adaptive_concurrency".
func ParseAlgorithm(s string) (Algorithm, error) {
	for a, v := range algorithms {
		if a > 0 && v.name == s {
			return Algorithm(a), nil
		}
	}
	return 0, fmt.Errorf("algorithm %q must be token_bucket, sliding_window, fixed_window, sliding_window_counter, concurrency or adaptive_concurrency", s)
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
	return "?" // decide.lua refuses it
}

// windowed reports whether a's quota is Limit (every algorithm but the token bucket: the window
// algorithms count requests in windows of Limit, concurrency the requests in flight).
func (a Algorithm) windowed() bool { return !a.describe().capacity }

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
	// never be admitted (Redis is asked for the state, and charges nothing). 0: the quota. With
	// Overrides it may be above the zone's own Quota: the quota in force (a client's override's)
	// bounds it in the script.
	MaxCost int64
	// MaxWait (token bucket and concurrency; 0 to MaxMaxWait) waits instead of rejecting. On a
	// token bucket it shapes: a request the bucket cannot serve now but would within MaxWait is
	// admitted at once by reserving its tokens (the bucket goes into debt, at most MaxWait ×
	// RefillRate tokens), and Decision.Delay says how long to hold it: until the bucket would
	// have held its cost. A request that would have to wait longer is denied as without MaxWait,
	// charging nothing. On a concurrency zone, and on a token bucket with Classes, it is the
	// longest a request may wait in the zone's queue for a slot or its tokens (Queues; the
	// caller waits, see Enqueue). 0: never hold, deny at once.
	MaxWait time.Duration
	// Classes are the priority classes of a zone with a queue (Queues: a MaxWait on a
	// concurrency zone, or on a token bucket with Classes), the first the highest: each the share
	// of the grants (slots, or waiters given their tokens; permille, 0 to 1000; all together at
	// most 1000) that the class is guaranteed while it has waiters. nil: one class.
	Classes []int
	// FairTenants, when > 0, serves the waiters of each class of a zone that Queues by
	// start-time fair queuing on their tenant (Request.Tenant), not in arrival order: a waiter
	// of a tenant with k waiters ahead of it in its class is granted after at most k + 2 grants
	// to each other tenant of the class (on a token bucket, in tokens: at most the tokens of its
	// own tenant's waiters ahead of it, plus one request of each of the two). It is the
	// most tenants with a place in a class's line at once (1 to MaxFairTenants); those beyond
	// share one place, as one tenant. 0: arrival order.
	FairTenants int
	// Lease, when set (token bucket without MaxWait, or fixed window), leases the zone's tokens
	// or window slots to the instance in grants that it spends in process (see Lease). nil:
	// every request decided in Redis.
	Lease *Lease
	// Block, when > 0, is the zone's penalty box: once the zone denies a client, every decision
	// of the zone refuses that client, on every instance, for Block (MinBlock to MaxBlock), and
	// charges no zone of those requests. Any algorithm but Concurrency; not with Lease. See
	// BlockKey. 0: no penalty box, and the zone's decisions read no block key.
	Block time.Duration
	// BlockMax, when > 0 (Block to MaxBlock), doubles the block of a repeat offender: a client
	// denied again within as long after its last block ended as that block lasted gets twice
	// that block, up to BlockMax. 0: every block lasts Block.
	BlockMax time.Duration
	// Overrides reads the client's numbers set at run time (SetOverride) in the same script call
	// as the decision: a number stored in the client's override key (OverrideKey) takes the place
	// of the zone's own. Not with Lease. false: the zone's numbers, and no extra read.
	Overrides bool
	// Shadow makes the zone a shadow zone: decided and charged as any zone when the request is
	// admitted, but its denial never denies the request, and the other zones are decided as if it
	// were absent (Result.Allowed false tells the caller it would have denied). Not with MaxWait
	// (a shadow zone must not change the response, and holding a request would) or Lease.
	Shadow bool
	// UpTo makes a request's cost a range: a Request given an upper bound (Request.SetUpTo) is
	// charged all the units the zone holds, at least its Cost and at most that bound
	// (Result.Granted), as a hold when it has a Hold. It reserves what a request may use when
	// that is bounded but not known (an LLM request's output cap, rewritten to what was
	// granted). Token bucket and fixed window; not with Lease or Shadow. false: a request is
	// charged its Cost.
	UpTo bool
	// Top, when > 0, counts each client's denials and charged units in the zone's top (see
	// top.go): sorted sets of at most Top entries each (1 to MaxTop), one per TopWindow bucket and
	// kind (per hash slot on Redis Cluster), written in the decision's own script call. Not with
	// Lease. 0: no top, and the zone's decisions write nothing more.
	Top int
	// TopWindow is the length of a top bucket (MinTopWindow to MaxTopWindow): a listing sums the
	// current bucket and the previous one, so it covers the last TopWindow to 2 × TopWindow.
	TopWindow time.Duration
	// NearLimit, when > 0 (a fraction of the quota, at most 1, in steps of a millionth), reports
	// the decision whose charge takes a client from below that fraction of the quota in force
	// used to at or past it (Result.NearLimit), decided in the same script call: used is the
	// quota less Result.Remaining, and the threshold ceil(NearLimit × quota) units, at least
	// one. The client crosses again only once it is back below. Not with Lease. 0: nothing
	// reported, nothing computed.
	NearLimit float64
	// Adaptive is an adaptive concurrency zone's controller (AdaptiveConcurrency; required
	// there, nil for every other algorithm: see WithDefaults).
	Adaptive *Adaptive
	// ceiling, of a copy of an adaptive concurrency zone whose Limit is a decision's limit in
	// force (applyLearnt), is the zone's own Limit; 0 in the zone itself.
	ceiling int64

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
	controller                any // an adaptive concurrency zone's controllerArg
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
	if z.Adaptive != nil {
		z.boxed.controller = z.Adaptive.controllerArg()
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
	if z.Algorithm.HoldsSlots() {
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

// FieldError is what is wrong with a zone's parameters: Field names the parameter at fault as
// the configuration does ("capacity", "max_wait"; "" when the zone as a whole is at fault, as
// when it has neither a window nor a period), and Msg says what is wrong, naming it. Zone is the
// zone's name; "" when the name itself is at fault.
type FieldError struct {
	Zone, Field, Msg string
}

// Error is Msg, after "zone <name>: " when the zone has a name.
func (e *FieldError) Error() string {
	if e.Zone == "" {
		return e.Msg
	}
	return "zone " + e.Zone + ": " + e.Msg
}

// fieldError returns the FieldError of z's parameter field.
func (z *Zone) fieldError(field, format string, args ...any) *FieldError {
	return &FieldError{Zone: z.Name, Field: field, Msg: fmt.Sprintf(format, args...)}
}

// Validate returns a *FieldError about the first parameter of z that is of another algorithm,
// missing, out of range, or at odds with another; nil when z can be decided. The parameters are
// checked in that order.
func (z *Zone) Validate() error {
	if err := z.validate(); err != nil {
		return err
	}
	return nil
}

func (z *Zone) validate() *FieldError {
	if !ValidZoneName(z.Name) {
		return &FieldError{Field: "name", Msg: fmt.Sprintf("zone name %q must be 1 to %d characters of A-Z a-z 0-9 _ . -", z.Name, MaxZoneNameBytes)}
	}
	if z.Algorithm < TokenBucket || int(z.Algorithm) >= len(algorithms) {
		return z.fieldError("algorithm", "unknown algorithm %v", z.Algorithm)
	}
	for _, check := range []func() *FieldError{z.validateOwners, z.validateRequired, z.validateRanges, z.validateMaxCost, z.validateLease, z.validateBlock, z.validateShadow, z.validateUpTo, z.validateTop, z.validateNearLimit, z.validateAdaptive} {
		if err := check(); err != nil {
			return err
		}
	}
	return nil
}

// validateOwners reports a parameter that z's algorithm does not take.
func (z *Zone) validateOwners() *FieldError {
	a, d := z.Algorithm, z.Algorithm.describe()
	// Each parameter given, and the algorithm it belongs to when z's does not take it.
	for _, p := range []struct {
		field, owner string
		given, taken bool
	}{
		{"capacity", "token_bucket", z.Capacity != 0, d.capacity},
		{"refill_rate", "token_bucket", z.RefillRate != 0, d.capacity},
		{"limit", "sliding_window", z.Limit != 0, !d.capacity},
		{"window", "sliding_window", z.Window != 0, d.window},
		{"period", "fixed_window", z.Period != NoPeriod, d.calendar},
		{"time_zone", "fixed_window", z.Location != nil, d.calendar},
	} {
		if p.given && !p.taken {
			err := z.fieldError(p.field, "%s belongs to algorithm %s, not %s", p.field, p.owner, a)
			if d.slots && p.field != "capacity" && p.field != "refill_rate" {
				err.Msg += ": a concurrency zone has no window or period, a slot is held as long as its request"
			}
			return err
		}
	}
	switch {
	case z.FairTenants != 0 && !z.Queues():
		return z.fieldError("fair_by", "fair queuing needs a queue: a max_wait, on algorithm concurrency, or with priority on token_bucket")
	case len(z.Classes) > 0 && !z.Queues():
		return z.fieldError("priority", "priority classes need a queue: a max_wait, on algorithm concurrency or token_bucket")
	case z.Queues():
		return z.validateQueue()
	case z.MaxWait != 0 && !d.shapes:
		return z.fieldError("max_wait", "%s", errMaxWaitWindowed(a))
	case z.MaxCost != 0 && d.slots:
		return z.fieldError("max_cost", "max_cost does not apply to algorithm concurrency: a request takes one slot while it runs")
	}
	return nil
}

// validateRequired reports a parameter z's algorithm needs that is missing (0), and a fixed
// window's window and period given together, or a time zone without a period.
func (z *Zone) validateRequired() *FieldError {
	a := z.Algorithm
	required := func(field string, missing bool) *FieldError {
		if missing {
			return z.fieldError(field, "%s is required for algorithm %s", field, a)
		}
		return nil
	}
	d := a.describe()
	if d.capacity {
		if err := required("capacity", z.Capacity == 0); err != nil {
			return err
		}
		return required("refill_rate", z.RefillRate == 0)
	}
	if err := required("limit", z.Limit == 0); err != nil || !d.window {
		return err
	}
	if !d.calendar {
		return required("window", z.Window == 0)
	}
	switch {
	case z.Window != 0 && z.Period != NoPeriod:
		return z.fieldError("period", "a fixed_window zone has a window or a period, not both")
	case z.Window == 0 && z.Period == NoPeriod:
		return z.fieldError("", "window or period is required for algorithm %s", a)
	case z.Location != nil && z.Period == NoPeriod:
		return z.fieldError("time_zone", "time_zone applies to a period (period day), not to a window")
	}
	return nil
}

// validateRanges reports a number out of its range, and a token bucket too slow to refill.
func (z *Zone) validateRanges() *FieldError {
	switch {
	case z.Capacity < 0 || z.Capacity > MaxCapacity:
		return z.fieldError("capacity", "capacity %d must be between 1 and 2^53", z.Capacity)
	case z.RefillRate < 0 || math.IsInf(z.RefillRate, 0) || math.IsNaN(z.RefillRate):
		return z.fieldError("refill_rate", "refill_rate %v must be a number of tokens per second > 0", z.RefillRate)
	case z.Limit < 0 || z.Limit > z.maxLimit():
		return z.fieldError("limit", "limit %d must be between 1 and %d", z.Limit, z.maxLimit())
	case z.Window != 0 && (z.Window < MinWindow || z.Window > MaxWindow):
		return z.fieldError("window", "window %v must be between %v and %s", z.Window, MinWindow, FormatDuration(MaxWindow))
	case z.Period > Month:
		return z.fieldError("period", "unknown period %d", z.Period)
	case z.MaxWait < 0:
		return z.fieldError("max_wait", "max_wait %v must be > 0 (leave max_wait out to reject at once)", z.MaxWait)
	case z.MaxWait > MaxMaxWait:
		return z.fieldError("max_wait", "max_wait %v is longer than %v: a request held that long outlasts most clients' timeouts; "+
			"let it come back instead (429 and Retry-After)", z.MaxWait, MaxMaxWait)
	}
	if z.Algorithm.QuotaIsCapacity() {
		if fill := float64(z.Capacity) / z.RefillRate; fill > MaxWindow.Seconds() {
			return z.fieldError("refill_rate", "an empty bucket takes %.0fs to refill (capacity / refill_rate); at most %s is supported",
				fill, FormatDuration(MaxWindow))
		}
	}
	return nil
}

// maxLimit is the largest Limit of z's algorithm: a sliding window log stores one entry per
// admitted unit, and a concurrency zone one per slot in flight; the counters' memory does not
// grow with the limit.
func (z *Zone) maxLimit() int64 {
	if m := z.Algorithm.MaxLimit(); m > 0 {
		return m
	}
	return MaxCapacity
}

// validateMaxCost reports a MaxCost below 0 or above the quota.
func (z *Zone) validateMaxCost() *FieldError {
	quota := "capacity"
	if z.Algorithm.windowed() {
		quota = "limit"
	}
	switch {
	case z.MaxCost < 0:
		return z.fieldError("max_cost", "max_cost %d must be between 1 and the zone's %s", z.MaxCost, quota)
	case z.MaxCost > z.Quota() && !z.Overrides:
		return z.fieldError("max_cost", "max_cost %d is larger than %s %d", z.MaxCost, quota, z.Quota())
	case z.MaxCost > MaxCapacity:
		return z.fieldError("max_cost", "max_cost %d is larger than %d", z.MaxCost, int64(MaxCapacity))
	}
	return nil
}

// CeilMs rounds d up to whole milliseconds.
func CeilMs(d time.Duration) int64 {
	ms := d.Milliseconds()
	if d%time.Millisecond > 0 {
		ms++
	}
	return ms
}

// FormatDuration formats whole days as caddy.ParseDuration writes them (366d), else as
// time.Duration does.
func FormatDuration(dur time.Duration) string {
	const day = 24 * time.Hour
	if dur >= day && dur%day == 0 {
		return strconv.FormatInt(int64(dur/day), 10) + "d"
	}
	return dur.String()
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

// windowAt returns the fixed window of a fixed window zone that holds t: [start, end), with
// start <= t < end. A Window is aligned to the Unix epoch; a Period is a calendar period in
// Location (UTC when nil), computed by calendarWindow: a day of a daylight saving change is 23
// or 25 hours long, a month as long as it is, and each window starts where the one before it
// ended.
func (z *Zone) windowAt(t time.Time) (start, end time.Time) {
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

// errLeaseMaxWait is why a zone with a max_wait cannot lease.
const errLeaseMaxWait = "lease and max_wait exclude each other: a held request's turn is decided by the bucket's debt in Redis, which a grant spent in process does not see"

// errLeaseAlgorithm is why a zone of algorithm a cannot lease.
func errLeaseAlgorithm(a Algorithm) string {
	if a.HoldsSlots() {
		return "lease applies to algorithms token_bucket and fixed_window only, not concurrency: " +
			"a slot is taken for a request's whole run, so there is nothing to spend ahead"
	}
	return fmt.Sprintf("lease applies to algorithms token_bucket and fixed_window only, not %s: "+
		"a grant of a sliding window would need entries scored ahead, and one of a sliding window counter "+
		"would be weighed down with the window it was counted in; neither is built", a)
}

// validateShadow checks what a shadow zone, and a zone with overrides, exclude.
func (z *Zone) validateShadow() *FieldError {
	switch {
	case z.Shadow && z.MaxWait > 0:
		return z.fieldError("dry_run", "dry_run excludes max_wait: a shadow zone must never change the response, and holding a request would")
	case z.Shadow && z.Lease != nil:
		return z.fieldError("dry_run", "dry_run excludes lease: a grant admits requests in process, where a shadow zone's denial is not seen")
	case z.Overrides && z.Lease != nil:
		return z.fieldError("overrides", "overrides excludes lease: a grant is spent in process, where a client's override is not seen")
	}
	return nil
}

// validateUpTo checks what a zone with UpTo excludes.
func (z *Zone) validateUpTo() *FieldError {
	switch {
	case !z.UpTo:
		return nil
	case !z.Algorithm.grants():
		return z.fieldError("cap_output", "cap_output needs algorithm token_bucket or fixed_window, not %s", z.Algorithm)
	case z.Lease != nil:
		return z.fieldError("cap_output", "cap_output excludes lease: a grant is spent in process, where the bound of each request is not known")
	case z.Shadow:
		return z.fieldError("cap_output", "cap_output excludes dry_run: a shadow zone must never change the request, and capping it would")
	}
	return nil
}

// validateLease checks z.Lease against z's algorithm and numbers.
func (z *Zone) validateLease() *FieldError {
	le := z.Lease
	switch {
	case le == nil:
		return nil
	case !z.Algorithm.grants():
		return z.fieldError("lease", "%s", errLeaseAlgorithm(z.Algorithm))
	case z.MaxWait > 0:
		return z.fieldError("lease", "%s", errLeaseMaxWait)
	case le.Max < 1 || le.Max > MaxCapacity:
		return z.fieldError("lease", "lease max %d must be between 1 and 2^53", le.Max)
	case le.TTL < MinLeaseTTL || le.TTL > MaxLeaseTTL:
		return z.fieldError("lease", "lease ttl %v must be between %v and %v", le.TTL, MinLeaseTTL, MaxLeaseTTL)
	}
	return nil
}

// validateNearLimit checks z.NearLimit: a fraction of the quota above 0 and at most 1, a whole
// number of millionths (what decide.lua is sent), and not with a lease.
func (z *Zone) validateNearLimit() *FieldError {
	f := z.NearLimit
	switch {
	case f == 0:
		return nil
	case !(f > 0 && f <= 1):
		return z.fieldError("near_limit", "near_limit %v must be above 0 and at most 1: a fraction of the quota (0.8, or 80%%)", f)
	case nearPPM(f) < 1:
		return z.fieldError("near_limit", "near_limit %v must be at least 0.000001", f)
	case z.Lease != nil:
		return z.fieldError("near_limit", "near_limit excludes lease: a grant is spent in process, where the request that crosses the threshold is not seen")
	}
	return nil
}

// nearPPM is near limit f in millionths, as decide.lua is sent it.
func nearPPM(f float64) int64 { return int64(math.Round(f * 1e6)) }
