package ratelimitredis

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// Values of Zone.EmptyKey: what a request whose key placeholders are all empty does in a zone.
const (
	EmptyKeyShared = "shared" // counted under one key shared by all such requests of the zone
	EmptyKeySkip   = "skip"   // the zone does not apply to it
	EmptyKeyDeny   = "deny"   // rejected with 403
)

// The names of the algorithms that zone errors name, as configured.
var (
	tokenBucketName   = limiter.TokenBucket.String()
	slidingWindowName = limiter.SlidingWindow.String()
	concurrencyName   = limiter.Concurrency.String()
)

// Zone is one rate limit: which requests it applies to, how it keys them and its algorithm's
// parameters.
type Zone struct {
	// The zone's name: 1 to 64 characters of [A-Za-z0-9_.-], unique within the handler. It is part
	// of every Redis key of the zone, so two handlers with a zone of the same name and key prefix
	// share its state. Required.
	Name string `json:"name,omitempty"`

	// Placeholders resolved per request to find the client key; the first that is not empty wins.
	// The client key says which candidate won: the first candidate's value as it is, candidate
	// n's (n ≥ 2) as `<n>=value` (so `2=203.0.113.7`), so that a value of one candidate can never
	// name another candidate's state (an API key header equal to an IP address). The
	// {http.rate_limit_redis.key} placeholder and the admin API use that form. When all are
	// empty, `empty_key` decides. Caddyfile shorthands ({client_ip}, {header.X-API-Key}, …) are
	// expanded as the Caddyfile adapter expands them, with a warning: in JSON, write the full
	// placeholder ({http.vars.client_ip}). Default:
	// ["{http.vars.client_ip}"].
	Key []string `json:"key,omitempty"`

	// What a request whose key placeholders are all empty does in this zone: `shared` counts it
	// under one key of the zone shared by every such request (one client can then exhaust it for
	// all the others); `skip` leaves the zone out for it, as when the zone's match does not
	// apply (nginx's limit_req does the same), so the zone does not limit it at all; `deny`
	// rejects it with 403 and no body (handle_errors can shape it), charging no zone.
	// Default: `shared`.
	EmptyKey string `json:"empty_key,omitempty"`

	// `token_bucket`, `sliding_window` (the exact sliding window log), `fixed_window` (a counter
	// per window or calendar period), `sliding_window_counter` (constant memory, approximate) or
	// `concurrency` (at most `limit` requests of a client in flight at once, across all
	// instances; see docs/decisions.md) or `adaptive_concurrency` (concurrency whose limit, at
	// most `limit`, is learnt from the upstream's latency, one limit for every instance; see
	// docs/adaptive.md). Default: `token_bucket`.
	Algorithm string `json:"algorithm,omitempty"`

	// token_bucket: the bucket size (burst), in tokens; 1 to 2^53. Like refill_rate, limit,
	// window and max_cost, it may instead come from a placeholder resolved per request (plans and
	// tiers): in JSON a string holding the placeholder and, optionally after a space, a literal
	// fallback used when the placeholder is empty: "{http.vars.plan_capacity} 100". A literal may
	// also be given as a string in the Caddyfile's syntax ("100"; refill_rate "100/1m"). A
	// placeholder's value has the Caddyfile's syntax and range; one that is empty without a
	// fallback, does not parse or is out of range rejects the request with 500 and an error
	// naming the zone, the number and why (logged at error level); nothing is charged.
	// Required for token_bucket; not allowed with the other algorithms.
	Capacity Number `json:"capacity,omitzero"`

	// token_bucket: tokens added per second (a float; 100 per minute is 1.6667). Must be > 0. Or
	// a placeholder, optionally with a fallback, as for capacity: "{http.vars.plan_rate} 10"; its
	// value is written as in the Caddyfile, tokens per second or per a duration ("100/1m").
	// Required for token_bucket; not allowed with the other algorithms.
	RefillRate Number `json:"refill_rate,omitzero"`

	// sliding_window, fixed_window, sliding_window_counter: requests admitted per window; 1 to
	// 1,000,000 for sliding_window (one Redis entry per request), to 2^53 for the others (one
	// counter per client). concurrency: requests of a client in flight at once, 1 to 100,000 (one
	// Redis entry per request in flight). Or a placeholder, optionally with a fallback, as for
	// capacity. Required for every algorithm but token_bucket.
	Limit Number `json:"limit,omitzero"`

	// sliding_window, fixed_window, sliding_window_counter: the window length, as a duration
	// (JSON: nanoseconds or a duration string); 1ms to 366 days. A fixed_window's windows of a
	// duration are aligned to the Unix epoch (a 1h window starts on the hour, UTC). Or a
	// placeholder, optionally with a fallback, as for capacity: "{http.vars.plan_window} 1h"; its
	// value is a duration string ("1h", "1d").
	// Required for sliding_window and sliding_window_counter, and for fixed_window without period.
	Window Number `json:"window,omitzero"`

	// fixed_window, instead of window: a calendar period, `hour`, `day`, `week` (from Monday) or
	// `month`, starting at its start in `time_zone`. The count starts again at 0 when the period
	// does; X-RateLimit-Reset and Retry-After say when. Default: none, the windows are of `window`.
	Period string `json:"period,omitempty"`

	// fixed_window with a period: the IANA time zone of the calendar (Europe/Paris), from Go's
	// time zone database (the system's, or the one built into Caddy); a day there is 23 or 25
	// hours long on a daylight saving change. Default: UTC.
	TimeZone string `json:"time_zone,omitempty"`

	// Tokens (or window slots) one request takes: a positive integer, or a placeholder resolved
	// per request. A placeholder that resolves empty counts as 1; one that is not a positive integer
	// rejects the request with 400. Default: "1".
	Cost string `json:"cost,omitempty"`

	// token_bucket: shape instead of rejecting, as a duration (JSON: nanoseconds or a duration
	// string). A request the bucket cannot serve now but would within max_wait is admitted at
	// once, its tokens reserved in Redis (the bucket owes at most max_wait × refill_rate tokens),
	// and held before the next handler until its turn: until the bucket would have held its
	// cost. A request that would have to wait longer is rejected (429) as without max_wait,
	// charging nothing. Held requests come out at the refill rate across all instances. A
	// client that disconnects while held ends its wait at once (499); its tokens stay spent.
	// More than 0, up to 1m. Not for the window algorithms: they give their quota back in steps,
	// so a held request would have no exact turn. Default: none, reject at once.
	MaxWait *caddy.Duration `json:"max_wait,omitempty"`

	// The largest cost a request may take: a request whose cost (a placeholder's value) is larger
	// is denied with 429 and no Retry-After, as a cost above the quota is, and charges nothing.
	// 1 to the quota. Default: the quota; for a sliding_window zone whose cost is a placeholder,
	// the quota or 1000, whichever is smaller: a sliding window log stores one entry per unit of
	// cost, and one request's entries are written in one script call that holds Redis, so a cost
	// chosen per request is bounded by 1000 at most (MaxSlidingWindowCost). Or a placeholder,
	// optionally with a fallback, as for capacity; a value above the quota resolved for the same
	// request counts as that quota (and above 1000 as 1000 where that bound applies). It also
	// bounds what a zone with charge is charged after the response: a larger amount reported
	// is charged as max_cost (counted in charge_capped_total).
	MaxCost Number `json:"max_cost,omitzero"`

	// What happens in this zone when Redis fails: `open`, `closed` or `local`, as the handler's
	// `fail_mode`, which is the default. When the zones of a request have different modes and
	// Redis fails, closed wins over local, and local over open: a closed zone answers 503; else
	// the local zones are enforced in process and the open zones let the request through.
	// Default: the handler's fail_mode.
	FailMode string `json:"fail_mode,omitempty"`

	// The zone applies only to requests matching one of these matcher sets (as in a route's
	// `match`). Default: every request.
	MatcherSetsRaw caddyhttp.RawMatcherSets `json:"match,omitempty" caddy:"namespace=http.matchers"`

	// This zone's IPv4 prefix length (1 to 32), instead of the handler's ipv4_prefix.
	// Default: the handler's.
	IPv4Prefix *int `json:"ipv4_prefix,omitempty"`

	// This zone's IPv6 prefix length (1 to 128), instead of the handler's ipv6_prefix.
	// Default: the handler's.
	IPv6Prefix *int `json:"ipv6_prefix,omitempty"`

	// This zone's Retry-After jitter, instead of the handler's: used when the zone decides a
	// denial. 0 turns jitter off for the zone. Default: the handler's.
	Jitter *caddy.Duration `json:"jitter,omitempty"`

	// This zone's no_retry_over, instead of the handler's: used when the zone decides a denial.
	// 0 turns it off for the zone. Default: the handler's.
	NoRetryOver *caddy.Duration `json:"no_retry_over,omitempty"`

	// Charge after the response only the requests whose status is listed: codes (401) or
	// classes (4xx). A request is admitted only if the zone has room for its cost, which it
	// holds while the request runs; the others get it back (a window counter's, while the
	// window it was charged in lasts). Every algorithm.
	// Default: none, every admitted request is charged its cost.
	CountStatus []string `json:"count_status,omitempty"`

	// Charge what the response reports in place of the cost, which becomes a reservation
	// (token_bucket, fixed_window and sliding_window_counter; not sliding_window). See Charge.
	// Default: none, a request is charged its cost when admitted.
	Charge *Charge `json:"charge,omitempty"`

	// With charge openai_usage, anthropic_usage or gemini_usage: a budget that is never
	// overdrawn. Each request reserves a true bound of what it can use (its prompt's bound and
	// its output cap), and its output cap is rewritten down to what the client has left (see
	// CapOutput). token_bucket and fixed_window; the cost is computed per request (no cost).
	// Default: none, a request reserves its cost.
	CapOutput *CapOutput `json:"cap_output,omitempty"`

	// token_bucket and fixed_window: lease the tokens (window slots) of this instance's hot
	// clients from Redis in grants spent in process (see Lease). Not with max_wait, count_status
	// or charge. Default: none, every request decided in Redis.
	Lease *Lease `json:"lease,omitempty"`

	// concurrency or token_bucket, with max_wait: the priority classes of the zone's queue (see
	// Priority). A waiter of a higher class is granted a slot (or its tokens) before any of a
	// lower class, but for the shares. On a token bucket it makes max_wait a queue instead of
	// shaping. Default: one class, in arrival order.
	Priority *Priority `json:"priority,omitempty"`

	// With a queue (max_wait on concurrency, or on a token bucket with priority): serve each
	// class's waiters in turn by this placeholder's value (the tenant: an API key, a user, a
	// `map` output), not in arrival order, by start-time fair queuing with each request's cost
	// as its size, across every instance: a waiter of a tenant with k waiters ahead of it in its
	// class is granted after at most k + 2 grants to each other tenant of the class (on a token
	// bucket, in tokens: the tokens of its tenant's waiters ahead of it, plus one request of each
	// of the two); one tenant alone gets every grant. It is also the client
	// identity whose waiting places max_waiting counts. Keyed with key_secret, as a key is. See
	// docs/queues.md. Default: none, arrival order.
	FairBy string `json:"fair_by,omitempty"`

	// With fair_by: the most tenants with a place of their own in a class's line at once (1 to
	// 100000); tenants beyond them share one place, taking turns as one tenant. Redis holds one
	// sorted set member per tenant with a place (its finish tag). Default: 1000.
	FairTenants int `json:"fair_tenants,omitempty"`

	// With count_status or charge: how long a reservation waits for its response; an
	// unsettled one (an instance that crashed) counts as charged after it. concurrency: how
	// long a slot is held without a refresh (1s to 1d): the instance refreshes the slots of its
	// requests in flight every third of it, and the slots of an instance that died free
	// themselves at most hold_max after it died. Default: 10m.
	HoldMax caddy.Duration `json:"hold_max,omitempty"`

	// The penalty box, as a duration (JSON: nanoseconds or a duration string): once this zone
	// denies a client, it refuses that client for this long, on every instance at once, whatever
	// its requests' cost; a refused request charges no zone, and its Retry-After and rate limit
	// headers give the block's remaining time. The block is written in the same Redis call as
	// the denial that starts it. A denial for a cost the zone can never admit starts none. 1s to
	// 366d. Every algorithm but concurrency; not with lease or dry_run. Default: 0, no penalty box (and no
	// Redis read for one).
	Block caddy.Duration `json:"block,omitempty"`

	// With block: the longest block of a repeat offender, as a duration. A client denied again
	// within as long after its last block ended as that block lasted is blocked for twice the
	// last block, up to block_max; one that stays out of trouble that long starts again at
	// block. block to 366d. Default: 0, every block lasts block.
	BlockMax caddy.Duration `json:"block_max,omitempty"`

	// Read per-client numbers set at run time through the admin API (PUT
	// /rate_limit_redis/override?zone=&key=) in the same script call as the decision: a number
	// of the client's override takes the place of the zone's (literal or placeholder), on every
	// instance at its next decision. A zone without it reads nothing more. Not with lease,
	// count_status or charge. See docs/admin-api.md. Default: false.
	Overrides bool `json:"overrides,omitempty"`

	// Make this a shadow zone: decided and charged as an enforced zone would be (a request that
	// every zone, this one included, admits charges it; a denied request charges nothing), but
	// its denial never refuses the request and never stops the other zones: they are decided
	// all-or-nothing as if it were absent. Its would-be denials count as dry_run_denied and are
	// named in {http.rate_limit_redis.shadow_denied}. Not with max_wait, lease or empty_key deny.
	// Default: false, the zone is enforced.
	DryRun bool `json:"dry_run,omitempty"`

	// Count each client's denials and charged units in the zone's top, written in the same Redis
	// call as the decision, and listed by GET /rate_limit_redis/top: sorted sets of at most this
	// many clients (1 to 10000) per time bucket (top_window) and kind (per hash slot on Redis
	// Cluster), a count never below the true one. Not with lease. See docs/operations.md.
	// Default: 0, no top (and no Redis write for one).
	Top int `json:"top,omitempty"`

	// With top: the length of a top bucket, as a duration (1s to 24h). The listing sums the
	// current bucket and the one before, so it covers the last top_window to twice that.
	// Default: 1m.
	TopWindow caddy.Duration `json:"top_window,omitempty"`
	// Report the request that takes a client past this fraction of its quota (0.8: 80% used;
	// above 0, at most 1, in millionths): the one whose charge takes the client's used units
	// (the quota in force less the whole units remaining) from below ceil(fraction × quota) to
	// at or past it. Decided in the same Redis call as the decision, so one request per
	// crossing, whichever instance decides it; the client crosses again once it is back below.
	// It emits the rate_limit_redis_near_limit event, counts in near_limit_total and names the
	// zone in {http.rate_limit_redis.near_limit}. Not with lease. See docs/operations.md.
	// Default: 0, nothing reported (and nothing more computed).
	NearLimit float64 `json:"near_limit,omitempty"`

	// adaptive_concurrency: the floor of the learnt limit, in requests in flight (1 to limit),
	// and the limit while the upstream's minimum latency is measured (see docs/adaptive.md).
	// Default: 3, or limit when lower.
	MinLimit int `json:"min_limit,omitempty"`
	// adaptive_concurrency: how far above the minimum latency the latency may go before the
	// limit falls, as a fraction of it (0.25, or 25%; above 0, at most 1). The limit settles
	// where requests take about the minimum latency × (1 + buffer). Default: 0.25.
	Buffer float64 `json:"buffer,omitempty"`
	// adaptive_concurrency: how often the limit is computed again from the latency of the
	// requests that ended since, as a duration (10ms to 10s). Default: 100ms.
	UpdateInterval caddy.Duration `json:"update_interval,omitempty"`
	// adaptive_concurrency: how often the upstream's minimum latency is measured again, as a
	// duration (1s to 24h); while it is, the limit is min_limit. Default: 1m.
	ProbeInterval caddy.Duration `json:"probe_interval,omitempty"`
	// adaptive_concurrency: how many requests admitted during a probe of the minimum latency it
	// measures (1 to 10,000). Default: 50.
	ProbeSamples int `json:"probe_samples,omitempty"`

	after  *afterResponse // count_status and charge, provisioned; nil without them
	capOut *outputCap     // cap_output, provisioned; nil without it
	// dyn are the numbers resolved per request, as provisioned: those given by a placeholder;
	// empty when every number is a literal, and the zone's requests then use lz itself.
	dyn         []dynNumber
	matcherSets caddyhttp.MatcherSets
	// tag is the zone's index in its handler's Zones, the Tag of its limiter requests.
	tag int
	// lz is the zone's limiter parameters: the literals, and each placeholder number's
	// fallback (0 without one), which ServeHTTP copies and completes per request (number.go).
	lz        limiter.Zone
	fixedCost int64               // > 0 when Cost is a literal integer
	decisions *decisionCounters   // the zone's series of decisions_total
	delays    prometheus.Observer // the zone's series of delay_seconds; nil without max_wait
	queue     *queueMetrics       // the series of its queue; nil without one
	emptyKeys prometheus.Counter
	// nearLimits is the zone's series of near_limit_total; nil without near_limit.
	nearLimits prometheus.Counter
	learnt     *learntGauges // an adaptive_concurrency zone's gauges; nil for the others
	failMode   string        // FailMode, or the handler's
	v4, v6     int           // the prefix lengths in force
	jitter     int64         // the Retry-After jitter in force, in seconds
	// noRetryOver is the no_retry_over in force: a denial of a longer wait says X-Should-Retry:
	// false; 0 never.
	noRetryOver time.Duration
	perClient   bool // a key has a placeholder: its client keys tell clients apart (waiting.go)
	// keySources are, per entry of Key, how the entry is read (compileKey): an entry that is
	// exactly one placeholder is looked up directly, with no string building (clientKey).
	keySources []keySource
	// usesModel: the zone's key, cost or a number uses the model placeholder; modelMatchers are,
	// per matcher set, its matchers that use it (nil when none does). The request's body is read
	// for them: model.go.
	usesModel     bool
	modelMatchers caddyhttp.MatcherSets
	// shadowLogged is when a request last left this shadow zone out (Unix ns): logged at most
	// once a minute (shadowUnresolved).
	shadowLogged *atomic.Int64
	// emptyKeyLogged is when a charging zone last decided with an empty key (Unix ns): logged
	// at most once a minute (warnEmptyKey).
	emptyKeyLogged *atomic.Int64

	// Formatted once for the hot path: the quota (X-RateLimit-Limit), the quoted name and the
	// RateLimit-Policy value, and the errors of a denial.
	quota, quotedName, policy                 string
	errLimited, errUnsatisfiable, errEmptyKey error
}

func (z *Zone) provision(ctx caddy.Context, logger *zap.Logger, in inherited) error {
	z.inherit(in)
	z.shadowLogged = new(atomic.Int64)
	z.emptyKeyLogged = new(atomic.Int64)
	if len(z.Key) == 0 {
		z.Key = []string{DefaultKey}
	}
	z.perClient = slices.ContainsFunc(z.Key, func(k string) bool { return strings.Contains(k, "{") })
	if z.Cost == "" {
		z.Cost = DefaultCost
	}
	if z.EmptyKey == "" {
		z.EmptyKey = EmptyKeyShared
	}
	z.checkPlaceholders(logger)
	z.keySources = make([]keySource, len(z.Key))
	for i, k := range z.Key {
		z.keySources[i] = compileKey(k)
	}
	z.usesModel = z.usesModelPlaceholder()
	var err error
	z.lz, z.dyn, err = z.limiterZone(func(field, value string) string {
		return z.checkPlaceholder(logger, field, value, zap.String("when_empty", "the fallback, else 500"))
	})
	if err != nil {
		return err
	}
	if z.fixedCost, err = z.parseCost(); err != nil {
		return err
	}
	if z.MaxCost.IsZero() && z.lz.Algorithm.StoresEntries() && hasPlaceholder(z.Cost) && len(z.dyn) == 0 {
		z.lz.MaxCost = min(z.lz.Limit, MaxSlidingWindowCost) // with placeholder numbers: per request
		if z.lz.Overrides {
			// The quota in force bounds it in decide.lua: a client's override may raise it.
			z.lz.MaxCost = MaxSlidingWindowCost
		}
	}
	z.lz.Prepare()                    // after every number of lz is set
	z.quotedName = `"` + z.Name + `"` // zone names are [A-Za-z0-9_.-]: nothing to escape
	if len(z.dyn) == 0 {              // else formatted per request: quotaOf, policyOf
		z.quota = strconv.FormatInt(z.lz.Quota(), 10)
		z.policy = policyValue(z.quotedName, &z.lz)
	}
	z.errLimited = fmt.Errorf("zone %s: rate limit exceeded", z.Name)
	z.errUnsatisfiable = unsatisfiableError(z.Name, &z.lz)
	z.errEmptyKey = fmt.Errorf("zone %s: every key placeholder is empty (empty_key deny)", z.Name)
	if limiter.ValidZoneName(z.Name) { // else Validate rejects it: no metric series for a name that never serves
		z.decisions = newDecisionCounters(z.Name)
		z.emptyKeys = metrics.emptyKeys.WithLabelValues(z.Name)
		if z.lz.MaxWait > 0 {
			z.delays = metrics.delays.WithLabelValues(z.Name)
		}
		if z.lz.NearLimit > 0 {
			z.nearLimits = metrics.nearLimit.WithLabelValues(z.Name)
		}
	}
	z.provisionQueue()
	z.provisionLearnt()
	if err := z.provisionAfter(); err != nil {
		return err
	}
	if z.CapOutput != nil && z.after != nil && z.Charge != nil {
		z.capOut = newOutputCap(z.CapOutput, z.after)
		z.after.bounded = true
	}
	if z.MatcherSetsRaw != nil {
		modelNames := z.modelMatcherNames()
		mods, err := ctx.LoadModule(z, "MatcherSetsRaw")
		if err != nil {
			return fmt.Errorf("zone %s: loading matchers: %w", z.Name, err)
		}
		if err := z.loadMatchers(mods, modelNames); err != nil {
			return fmt.Errorf("zone %s: %w", z.Name, err)
		}
	}
	return nil
}

// defaultTopWindow is a top's bucket length when top_window is left out.
const defaultTopWindow = time.Minute

// limiterZone returns the zone's limiter parameters as configured: its algorithm (token_bucket
// when none is given), each number's literal or placeholder fallback (0 without one), its period,
// time zone, max_wait, lease and block; and its numbers given by placeholders, their expressions passed
// through expand (nil: as written). Its error is a *limiter.FieldError about a value that does
// not parse.
func (z *Zone) limiterZone(expand func(field, expr string) string) (limiter.Zone, []dynNumber, error) {
	lz := limiter.Zone{Name: z.Name, Algorithm: limiter.TokenBucket, MaxWait: time.Duration(deref(z.MaxWait)), Lease: z.Lease.limiterLease(),
		Block: time.Duration(z.Block), BlockMax: time.Duration(z.BlockMax), Overrides: z.Overrides, Shadow: z.DryRun,
		UpTo: z.CapOutput != nil, Top: z.Top, TopWindow: time.Duration(z.TopWindow),
		NearLimit: z.NearLimit}
	if lz.Top != 0 && lz.TopWindow == 0 {
		lz.TopWindow = defaultTopWindow
	}
	if z.Algorithm != "" {
		algo, err := limiter.ParseAlgorithm(z.Algorithm)
		if err != nil {
			return lz, nil, z.fieldError("algorithm", "%v", err)
		}
		lz.Algorithm = algo
	}
	dyn, err := z.parseNumbers(&lz, expand)
	if err != nil {
		return lz, nil, err
	}
	if z.Period != "" {
		if lz.Period, err = limiter.ParsePeriod(z.Period); err != nil {
			return lz, nil, z.fieldError("period", "%v", err)
		}
	}
	if lz.Classes, err = z.Priority.limiterClasses(z); err != nil {
		return lz, nil, err
	}
	lz.Adaptive = z.limiterAdaptive(lz)
	if lz.FairTenants, err = z.fairTenants(); err != nil {
		return lz, nil, err
	}
	if z.TimeZone != "" {
		// Local is not one zone: each instance's system could have its own.
		if lz.Location, err = time.LoadLocation(z.TimeZone); err != nil || z.TimeZone == "Local" {
			return lz, nil, z.fieldError("time_zone", "time_zone %q is not a time zone of the IANA database (such as UTC or Europe/Paris)", z.TimeZone)
		}
	}
	return lz, dyn, nil
}

// fieldError returns the *limiter.FieldError of the zone's field.
func (z *Zone) fieldError(field, format string, args ...any) *limiter.FieldError {
	return &limiter.FieldError{Zone: z.Name, Field: field, Msg: fmt.Sprintf(format, args...)}
}

// parseCost returns the zone's cost when it is a literal (a Cost left empty is 1), 0 when it is
// a placeholder.
func (z *Zone) parseCost() (int64, error) {
	c := cmp.Or(z.Cost, DefaultCost)
	if hasPlaceholder(c) {
		return 0, nil
	}
	n, err := strconv.ParseInt(c, 10, 64)
	switch {
	case errors.Is(err, strconv.ErrRange):
		return 0, z.fieldError("cost", "cost: %q is out of range", c)
	case err != nil:
		return 0, z.fieldError("cost", "cost: %q is not an integer or a placeholder", c)
	case n < 1:
		return 0, z.fieldError("cost", "cost: %q must be > 0", c)
	}
	return n, nil
}

// validate checks the zone as configured: it reads only the exported fields (an empty one as its
// default), so it checks a zone the same before Provision (the Caddyfile parser, when the zone's
// block ends) and after (Validate). The limiter's Zone.Validate holds the rules of the limiter's
// parameters; validate adds those of the fields the limiter does not see: cost, key and
// charging, fail mode, prefixes and jitter. Its error is a *limiter.FieldError naming the field
// at fault: values that do not parse or are out of range first, then the fields' rules together.
func (z *Zone) validate() error {
	lz, _, err := z.limiterZone(nil)
	if err != nil {
		return err
	}
	cost, err := z.parseCost()
	if err != nil {
		return err
	}
	if err := z.validateFields(); err != nil {
		return err
	}
	// A number from a placeholder without a fallback is checked as the value that constrains
	// the others least (probe); its values are checked per request.
	probe := z.probe(lz)
	if err := probe.Validate(); err != nil {
		var fe *limiter.FieldError
		if z.Algorithm == "" && errors.As(err, &fe) && strings.HasSuffix(fe.Msg, " "+tokenBucketName) {
			fe.Msg += " (the default when no algorithm is given)"
		}
		return err
	}
	return z.validateTogether(lz, cost)
}

// validateFields checks the values of the zone's fields that the limiter does not see, each on
// its own.
func (z *Zone) validateFields() error {
	switch {
	case z.EmptyKey != "" && z.EmptyKey != EmptyKeyShared && z.EmptyKey != EmptyKeySkip && z.EmptyKey != EmptyKeyDeny:
		return z.fieldError("empty_key", "empty_key %q must be shared, skip or deny", z.EmptyKey)
	case z.FailMode != "" && z.FailMode != FailOpen && z.FailMode != FailClosed && z.FailMode != FailLocal:
		return z.fieldError("fail_mode", "fail_mode %q must be open, closed or local", z.FailMode)
	case z.HoldMax < 0:
		return z.fieldError("hold_max", "hold_max %s must be > 0", time.Duration(z.HoldMax))
	case time.Duration(z.HoldMax) > MaxHoldMax:
		return z.fieldError("hold_max", "hold_max %s is out of range (at most %s)", limiter.FormatDuration(time.Duration(z.HoldMax)), limiter.FormatDuration(MaxHoldMax))
	case z.MaxWait != nil && *z.MaxWait <= 0:
		// The limiter's MaxWait cannot tell 0 from none; its upper bound is the limiter's.
		return z.fieldError("max_wait", "max_wait %v must be > 0 (leave max_wait out to reject at once)", time.Duration(*z.MaxWait))
	}
	if err := checkPrefixes(z.IPv4Prefix, z.IPv6Prefix); err != nil {
		err.Zone = z.Name
		return err
	}
	if z.Jitter != nil {
		if err := checkJitter(*z.Jitter); err != nil {
			err.Zone = z.Name
			return err
		}
	}
	if err := checkNoRetryOver(z.NoRetryOver); err != nil {
		err.Zone = z.Name
		return err
	}
	for _, s := range z.CountStatus {
		if _, _, err := parseStatus(s); err != nil {
			return z.fieldError("count_status", "count_status: %v", err)
		}
	}
	if err := z.validateCharge(); err != nil {
		return err
	}
	return z.validateCapOutput()
}

// validateCapOutput checks the zone's cap_output against its charge and cost.
func (z *Zone) validateCapOutput() error {
	c := z.CapOutput
	switch {
	case c == nil:
		return nil
	case z.Charge == nil || usageFormat(z.Charge.Source) == 0:
		return z.fieldError("cap_output", "cap_output needs charge openai_usage, anthropic_usage or gemini_usage: the response's usage settles the bound reserved")
	case z.Cost != "" && z.Cost != DefaultCost:
		return z.fieldError("cap_output", "cap_output computes each request's reservation from its body: leave cost out")
	case c.check() != "":
		return z.fieldError("cap_output", "%s", c.check())
	}
	return nil
}

// validateCharge checks the zone's charge on its own.
func (z *Zone) validateCharge() error {
	c := z.Charge
	if c == nil {
		return nil
	}
	reads := usageFormat(c.Source) != 0 // openai_usage, anthropic_usage or gemini_usage
	var msg string
	switch {
	case c.Source != ChargeHeader && !reads:
		msg = fmt.Sprintf("charge source %q must be header, openai_usage, anthropic_usage or gemini_usage", c.Source)
	case c.Source == ChargeHeader && c.Header == "":
		msg = "charge header needs a header field name"
	case c.Source == ChargeHeader && (c.Usage != "" || c.Weights != nil || c.Missing != nil):
		msg = "charge usage, weights and missing belong to sources openai_usage, anthropic_usage and gemini_usage"
	case reads && (c.Header != "" || c.Scale != 0):
		msg = "charge header and scale belong to source header"
	case !(c.Scale >= 0 && c.Scale <= MaxChargeScale):
		msg = fmt.Sprintf("charge scale %v must be greater than 0 and at most %g", c.Scale, float64(MaxChargeScale))
	case c.Usage != "" && c.Weights != nil:
		msg = "charge usage and weights exclude each other: weights charge every count, weighted"
	case c.Usage != "" && c.Usage != UsageTotal && c.Usage != UsagePrompt && c.Usage != UsageCompletion:
		msg = fmt.Sprintf("charge usage %q must be total, prompt or completion", c.Usage)
	case c.Weights != nil && c.Weights.check() != "":
		msg = c.Weights.check()
	case c.Missing != nil && (*c.Missing < 0 || *c.Missing > limiter.MaxCapacity):
		msg = fmt.Sprintf("charge missing %d must be between 0 and %d", *c.Missing, int64(limiter.MaxCapacity))
	default:
		return nil
	}
	return z.fieldError("charge", "%s", msg)
}

// validateTogether checks the fields the limiter does not see against the zone's algorithm and
// numbers, lz (a placeholder's fallback as its value). cost is the literal cost; 0 for a
// placeholder.
func (z *Zone) validateTogether(lz limiter.Zone, cost int64) error {
	after := len(z.CountStatus) > 0 || z.Charge != nil
	if lz.Algorithm.HoldsSlots() {
		if err := z.validateDryRun(); err != nil {
			return err
		}
		if err := z.validateAdaptive(lz); err != nil {
			return err
		}
		return z.validateConcurrency(cost)
	}
	switch {
	case z.HoldMax != 0 && !after:
		return z.fieldError("hold_max", "hold_max applies to a zone with count_status or charge, or of algorithm concurrency")
	case z.Charge != nil && lz.Algorithm.StoresEntries():
		return z.fieldError("charge", "charge needs algorithm token_bucket, fixed_window or sliding_window_counter: "+
			"a sliding_window zone stores one entry per unit of cost, so charging it what a response reports "+
			"(thousands of tokens) would store thousands of entries per request; count_status works with sliding_window")
	case z.Lease != nil && after:
		return z.fieldError("lease", "lease excludes count_status and charge: a grant is spent as requests arrive, before any response says what to charge")
	}
	if err := z.validateDryRun(); err != nil {
		return err
	}
	// A quota or max_cost from a placeholder bounds the cost per request (Zone.finishNumbers): a
	// cost above the quota is a 429 without Retry-After, a max_cost above it counts as the quota.
	quotaName := "capacity"
	if !lz.Algorithm.QuotaIsCapacity() {
		quotaName = "limit"
	}
	maxCostPlaceholder, _ := z.MaxCost.placeholder()
	switch {
	case cost > lz.Quota() && !z.quotaPlaceholder(lz.Algorithm):
		return z.fieldError("cost", "cost %d is larger than %s %d: no request could ever be admitted", cost, quotaName, lz.Quota())
	case lz.MaxCost > 0 && cost > lz.MaxCost && !maxCostPlaceholder:
		return z.fieldError("cost", "cost %d is larger than max_cost %d: no request could ever be admitted", cost, lz.MaxCost)
	case lz.Algorithm.StoresEntries() && cost == 0 && lz.MaxCost > MaxSlidingWindowCost && !maxCostPlaceholder:
		return z.fieldError("max_cost", "max_cost %d: a %s zone stores one entry per unit of cost, so a cost from a placeholder "+
			"(chosen per request) is bounded by max_cost %d at most; use %s for larger costs", lz.MaxCost, slidingWindowName, MaxSlidingWindowCost, tokenBucketName)
	}
	return nil
}

// validateConcurrency checks what does not apply to a concurrency zone: a cost (a request takes
// one slot while it runs), count_status and charge (a slot is given back when its response is
// complete, whatever it was); and its hold_max, refreshed every third (MinSlotHold at least).
func (z *Zone) validateConcurrency(cost int64) error {
	switch {
	case cost != 1:
		return z.fieldError("cost", "cost does not apply to algorithm concurrency: a request takes one slot while it runs")
	case len(z.CountStatus) > 0:
		return z.fieldError("count_status", "count_status does not apply to algorithm concurrency: a slot is given back when its response is complete, whatever it was")
	case z.Charge != nil:
		return z.fieldError("charge", "charge does not apply to algorithm concurrency: a slot is given back when its response is complete, whatever it was")
	case z.HoldMax != 0 && time.Duration(z.HoldMax) < MinSlotHold:
		return z.fieldError("hold_max", "hold_max %s: a %s zone's slots are refreshed every third of it; at least %s", time.Duration(z.HoldMax), concurrencyName, MinSlotHold)
	}
	return nil
}

// inherited is what a zone takes from its handler when it does not set its own.
type inherited struct {
	failMode    string
	v4, v6      *int // prefix lengths: nil for the default
	jitter      caddy.Duration
	noRetryOver *caddy.Duration
}

// inherit sets the values in force of the options a zone inherits: the zone's own, else the
// handler's (in), else the defaults.
func (z *Zone) inherit(in inherited) {
	z.failMode = cmp.Or(z.FailMode, in.failMode)
	z.v4 = cmp.Or(deref(z.IPv4Prefix), deref(in.v4), DefaultIPv4Prefix)
	z.v6 = cmp.Or(deref(z.IPv6Prefix), deref(in.v6), DefaultIPv6Prefix)
	jitter := in.jitter
	if z.Jitter != nil {
		jitter = *z.Jitter
	}
	z.jitter = int64(time.Duration(jitter) / time.Second)
	z.noRetryOver = DefaultNoRetryOver
	for _, d := range []*caddy.Duration{in.noRetryOver, z.NoRetryOver} {
		if d != nil {
			z.noRetryOver = time.Duration(*d)
		}
	}
}

// deref returns *p, or the zero value when p is nil.
func deref[T any](p *T) T {
	if p == nil {
		var zero T
		return zero
	}
	return *p
}
