package limiter

import (
	"strconv"
	"time"
)

// Adaptive concurrency (AdaptiveConcurrency) is a concurrency zone whose limit is learnt from the
// latency of its requests, with Envoy's gradient controller (envoy.filters.http.adaptive_concurrency,
// "gradient controller"), its state one hash per client key in Redis, so that every instance
// admits against the one limit and feeds it its samples:
//
//	gradient  = clamp((minRTT × (1 + Buffer)) / sampleRTT, 0.5, 2)
//	newLimit  = clamp(limit × gradient, MinLimit, Limit)
//
// sampleRTT is the mean latency of the requests that ended in the last UpdateInterval (Envoy:
// a percentile, p50 by default); minRTT is measured every ProbeInterval by a probe that holds the
// limit at MinLimit until ProbeSamples requests admitted during the probe have ended, and is their
// mean. Envoy adds a burst headroom of sqrt(newLimit) to the limit; here there is none: with it,
// an upstream of 4 places keeps about 2 more requests queued inside itself (60% more time spent
// there), which is what the limit is for. A window whose requests include a failure (a 5xx, an
// upstream timeout) lowers the limit to at most limit × 0.9 (Netflix concurrency-limits' AIMD
// back-off ratio), and a window whose peak of requests in flight was under half the limit does
// not raise it (Netflix's rule for a limit the traffic does not reach).
//
// The controller runs in settle.lua, on the call that gives a request's slot back (no call of
// its own): the first settlement after UpdateInterval has passed updates the limit, atomically,
// whichever instance sends it. decide.lua reads the limit in force with the slots in the same
// call; queue.lua grants waiters against it.

// Defaults of Adaptive's fields (Envoy's adaptive_concurrency defaults, but ProbeSamples).
const (
	DefaultMinLimit       = 3
	DefaultBuffer         = 0.25
	DefaultUpdateInterval = 100 * time.Millisecond
	DefaultProbeInterval  = time.Minute
	DefaultProbeSamples   = 50
)

// Bounds of Adaptive's fields.
const (
	MinUpdateInterval = 10 * time.Millisecond
	MaxUpdateInterval = 10 * time.Second
	MinProbeInterval  = time.Second
	MaxProbeInterval  = 24 * time.Hour
	MaxProbeSamples   = 10_000
)

// Adaptive is an adaptive concurrency zone's controller (see above). A field left 0 takes its
// default (WithDefaults).
type Adaptive struct {
	// MinLimit is the floor of the learnt limit, in slots, and the limit while the minimum latency
	// is probed: 1 to the zone's Limit (its ceiling). Default DefaultMinLimit, at most Limit.
	MinLimit int64
	// Buffer is how far above the minimum latency the sample latency may be before the limit
	// falls, as a fraction of the minimum latency (0.25: 25%): above 0, at most 1. The limit
	// settles where the latency is minRTT × (1 + Buffer): with an upstream of C places that
	// queues the rest, at about C × (1 + Buffer) requests in flight.
	Buffer float64
	// UpdateInterval is how often the limit is computed again from the samples of the requests
	// that ended since (MinUpdateInterval to MaxUpdateInterval).
	UpdateInterval time.Duration
	// ProbeInterval is how often the minimum latency is measured again (MinProbeInterval to
	// MaxProbeInterval); the first probe starts with the zone's first sample.
	ProbeInterval time.Duration
	// ProbeSamples is the number of requests admitted during a probe whose latency it measures
	// (1 to MaxProbeSamples).
	ProbeSamples int64
}

// WithDefaults returns a with each field left 0 set to its default, MinLimit at most limit.
func (a Adaptive) WithDefaults(limit int64) Adaptive {
	if a.MinLimit == 0 {
		a.MinLimit = min(DefaultMinLimit, max(limit, 1))
	}
	if a.Buffer == 0 {
		a.Buffer = DefaultBuffer
	}
	if a.UpdateInterval == 0 {
		a.UpdateInterval = DefaultUpdateInterval
	}
	if a.ProbeInterval == 0 {
		a.ProbeInterval = DefaultProbeInterval
	}
	if a.ProbeSamples == 0 {
		a.ProbeSamples = DefaultProbeSamples
	}
	return a
}

// validateAdaptive reports an Adaptive missing from, or out of the range of, an adaptive
// concurrency zone, or given to another algorithm.
func (z *Zone) validateAdaptive() *FieldError {
	a := z.Adaptive
	switch {
	case a == nil && z.Algorithm.Adapts():
		return z.fieldError("algorithm", "an %s zone needs its controller (Zone.Adaptive)", z.Algorithm)
	case a == nil:
		return nil
	case !z.Algorithm.Adapts():
		return z.fieldError(a.firstGiven(), "min_limit, buffer, update_interval, probe_interval and probe_samples belong to algorithm adaptive_concurrency, not %s", z.Algorithm)
	case a.MinLimit < 1 || a.MinLimit > z.Limit:
		return z.fieldError("min_limit", "min_limit %d must be between 1 and limit %d", a.MinLimit, z.Limit)
	case !(a.Buffer > 0 && a.Buffer <= 1):
		return z.fieldError("buffer", "buffer %v must be above 0 and at most 1: a fraction of the minimum latency (0.25, or 25%%)", a.Buffer)
	case a.UpdateInterval < MinUpdateInterval || a.UpdateInterval > MaxUpdateInterval:
		return z.fieldError("update_interval", "update_interval %v must be between %v and %v", a.UpdateInterval, MinUpdateInterval, MaxUpdateInterval)
	case a.ProbeInterval < MinProbeInterval || a.ProbeInterval > MaxProbeInterval:
		return z.fieldError("probe_interval", "probe_interval %v must be between %v and %s", a.ProbeInterval, MinProbeInterval, FormatDuration(MaxProbeInterval))
	case a.ProbeSamples < 1 || a.ProbeSamples > MaxProbeSamples:
		return z.fieldError("probe_samples", "probe_samples %d must be between 1 and %d", a.ProbeSamples, MaxProbeSamples)
	case z.Overrides:
		return z.fieldError("overrides", "overrides exclude algorithm adaptive_concurrency: its limit is learnt (a lower limit in the configuration applies at once)")
	}
	return nil
}

// firstGiven is the configuration name of a's first field that is not 0.
func (a *Adaptive) firstGiven() string {
	switch {
	case a.MinLimit != 0:
		return "min_limit"
	case a.Buffer != 0:
		return "buffer"
	case a.UpdateInterval != 0:
		return "update_interval"
	case a.ProbeInterval != 0:
		return "probe_interval"
	}
	return "probe_samples"
}

// controllerArg is decide.lua's and settle.lua's rate argument of an adaptive concurrency zone:
// "<min limit>,<buffer ppm>,<update interval µs>,<probe interval µs>,<probe samples>".
func (a *Adaptive) controllerArg() string {
	b := make([]byte, 0, 48)
	b = strconv.AppendInt(b, a.MinLimit, 10)
	b = append(b, ',')
	b = strconv.AppendInt(b, int64(a.Buffer*1e6+0.5), 10)
	b = append(b, ',')
	b = strconv.AppendInt(b, a.UpdateInterval.Microseconds(), 10)
	b = append(b, ',')
	b = strconv.AppendInt(b, a.ProbeInterval.Microseconds(), 10)
	b = append(b, ',')
	b = strconv.AppendInt(b, a.ProbeSamples, 10)
	return string(b)
}

// adaptiveCallArgs are an adaptive concurrency zone's numbers of decide.lua's call: its limit
// (the ceiling), its controller (controllerArg, boxed by Prepare) and its cost (one slot).
func adaptiveCallArgs(r *Request, _ time.Time, cost int64) (quota, rate, costArg any) {
	if b := r.Zone.boxed; b != nil && b.controller != nil && r.Zone.ceiling == 0 {
		limit, _ := r.Zone.windowArgs()
		return limit, b.controller, cost
	}
	return r.Zone.Ceiling(), r.Zone.Adaptive.controllerArg(), cost
}

// Ceiling is the zone's own Limit: for an adaptive concurrency zone as a decision left it in a
// Request (its Limit the limit in force), the ceiling of its learnt limit.
func (z *Zone) Ceiling() int64 {
	if z.ceiling > 0 {
		return z.ceiling
	}
	return z.Limit
}

// controlKey is the controller's hash of the adaptive concurrency zone and client whose state
// key is stateKey, in its hash slot: `<state key>:ctl`.
func controlKey(stateKey string) string { return stateKey + ":ctl" }

// adaptiveWidth is the number of integers an adaptive concurrency zone adds to decide.lua's
// reply: the limit in force (slots), the minimum latency and the last window's latency (µs; 0
// before they are measured).
const adaptiveWidth = 3

// Learnt is an adaptive concurrency zone's controller as a decision read it (Result.Learnt).
type Learnt struct {
	// Limit is the limit in force: slots, MinLimit to the zone's Limit.
	Limit int64
	// MinLatency is the minimum latency the last probe measured; 0 before the first.
	MinLatency time.Duration
	// Latency is the mean latency of the requests of the last update interval; 0 before one.
	Latency time.Duration
}

// decodeLearnt decodes zone z's adaptive integers at arr[off], the limit at most ceiling.
func decodeLearnt(arr []any, off int, ceiling int64) (Learnt, error) {
	var v [adaptiveWidth]int64
	for k := range adaptiveWidth {
		most := int64(-1)
		if k == 0 {
			most = ceiling
		}
		var err error
		if v[k], err = replyInt(arr, off+k, most); err != nil {
			return Learnt{}, err
		}
	}
	return Learnt{Limit: max(v[0], 1), MinLatency: time.Duration(v[1]) * time.Microsecond, Latency: time.Duration(v[2]) * time.Microsecond}, nil
}

// readLearnt reads the controller hash's fields e, m and r (HMGET's values: strings or nil) of
// adaptive concurrency zone z as decide.lua does: the limit in force at most z's Limit, the min
// limit when there is none.
func readLearnt(v []any, z *Zone) Learnt {
	num := func(i int) int64 {
		s, _ := v[i].(string)
		n, _ := strconv.ParseFloat(s, 64)
		return int64(n)
	}
	out := Learnt{Limit: z.Adaptive.MinLimit, MinLatency: time.Duration(num(1)) * time.Microsecond, Latency: time.Duration(num(2)) * time.Microsecond}
	if e := num(0); e > 0 {
		out.Limit = e
	}
	out.Limit = max(1, min(out.Limit, z.Ceiling()))
	return out
}

// applyLearnt sets the Zone of each adaptive concurrency request of reqs to a copy of it with
// the limit in force of its reply (zones), so that the Decision, each Result and the caller see
// the limit that decided.
func applyLearnt(reqs []Request, zones []zoneReply) {
	for i := range zones {
		z := reqs[i].Zone
		if !z.Algorithm.Adapts() || zones[i].learnt.Limit == 0 || zones[i].learnt.Limit == z.Limit {
			continue
		}
		c := *z
		c.boxed, c.Limit, c.ceiling = nil, zones[i].learnt.Limit, z.Ceiling()
		reqs[i].Zone = &c
	}
}

// Sample reports the latency of the request whose decision made h, for its adaptive
// concurrency zones' controllers: latency is the time to the upstream's response headers, failed
// whether the upstream failed (a 5xx, a timeout). Call it before Settle; a Held without a sample
// (a client that left before the response) reports none, and changes no limit.
func (h *Held) Sample(latency time.Duration, failed bool) {
	if h == nil {
		return
	}
	h.sample = strconv.FormatInt(max(latency.Microseconds(), 0), 10)
	if failed {
		h.sample += ",1"
	} else {
		h.sample += ",0"
	}
}
