// Package adminapi is the admin.api.rate_limit_redis module: the endpoints of Caddy's admin API
// that inspect and change a client's rate limit state in the zones of the loaded
// rate_limit_redis handlers. It reads those zones through the Registry the handler package
// gives it (Serve), and imports nothing of that package.
package adminapi

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

func init() {
	caddy.RegisterModule(AdminAPI{})
}

// adminTimeout bounds the Redis calls of one admin API request.
const adminTimeout = 2 * time.Second

// AdminAPI implements the admin.api.rate_limit_redis module: endpoints of Caddy's admin API
// (which loads every admin.api module by itself; nothing to configure) to inspect and reset a
// client's rate limit state:
//
//	GET    /rate_limit_redis/zones                         the zones of the loaded config
//	GET    /rate_limit_redis/state?zone=<name>&key=<key>   a client's state in a zone
//	       [&capacity=&refill_rate=&limit=&window=]      the numbers, for a zone whose numbers are placeholders
//	DELETE /rate_limit_redis/state?zone=<name>&key=<key>   reset it: the client starts afresh, unblocked
//	PUT    /rate_limit_redis/block?zone=<name>&key=<key>&for=<duration>   block the client (a zone with block)
//	PUT|GET|DELETE /rate_limit_redis/override?zone=<name>&key=<key>  a client's own numbers (override.go)
//	GET    /rate_limit_redis/blocks?zone=<name>[&count=<n>][&cursor=<c>]     a page of the zone's blocked clients (list.go)
//	GET    /rate_limit_redis/overrides?zone=<name>[&count=<n>][&cursor=<c>]  a page of the zone's clients with overrides
//	GET    /rate_limit_redis/top?zone=<name>[&by=denied|used][&n=<n>]      the zone's clients with the most denials or use (top.go)
//
// A zone whose numbers come from placeholders has no numbers of its own outside a request: its
// state is computed with the numbers given as query parameters of their names (in the syntax of
// the placeholder's values: capacity=10000&refill_rate=10000/1h), else with each one's fallback;
// a number with neither is a 400 naming it. Parameters of numbers that are literals are ignored.
// Each such entry holds the numbers it was computed with ("numbers").
//
// key is the client key as the {http.rate_limit_redis.key} placeholder shows it, before
// sanitising: the value of the zone's first key candidate as it is (an API key), the n-th's as
// "<n>=value" (2=203.0.113.7). It is mapped as requests' keys are: an IP address masked to the
// zone's prefix (Zone.MapKey), then to the Redis key through the handler's key_secret when it
// has one. Replies are JSON arrays; errors are Caddy's admin API errors, {"error": "<message>"},
// with status 400 (a parameter missing, or a key no request of the zone can have: the "0=" form,
// a candidate the zone lacks, a network wider than its prefix),
// 404 (no loaded zone has that name), 405 (method), 502 (Redis failed) or 504 (Redis did not
// answer within 2s; a change may have been made all the same).
//
// The zones are those of every rate_limit_redis handler loaded. The same zone name may be in
// several handlers; handlers using the same Redis (addresses and db), key_prefix and zone name
// share the client's state in Redis, so state reports each distinct Redis key (and zone
// parameters) once, and a reset deletes each distinct Redis key once and clears the deny cache
// of every handler with the zone.
type AdminAPI struct {
	// live is the registry of the handlers whose zones it serves: the process's (Serve), unless
	// it was made with its own (New).
	live Registry
}

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.rate_limit_redis",
		New: func() caddy.Module { return new(AdminAPI) },
	}
}

// Routes returns the admin API routes under /rate_limit_redis/.
func (a *AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/rate_limit_redis/zones", Handler: caddy.AdminHandlerFunc(a.handleZones)},
		{Pattern: "/rate_limit_redis/state", Handler: caddy.AdminHandlerFunc(a.handleState)},
		{Pattern: "/rate_limit_redis/block", Handler: caddy.AdminHandlerFunc(a.handleBlock)},
		{Pattern: "/rate_limit_redis/override", Handler: caddy.AdminHandlerFunc(a.handleOverride)},
		{Pattern: "/rate_limit_redis/blocks", Handler: caddy.AdminHandlerFunc(a.handleBlocks)},
		{Pattern: "/rate_limit_redis/overrides", Handler: caddy.AdminHandlerFunc(a.handleOverrides)},
		{Pattern: "/rate_limit_redis/top", Handler: caddy.AdminHandlerFunc(a.handleTop)},
	}
}

// Registry is the live handlers whose zones the admin API serves.
type Registry interface {
	// Zones returns the zones named name of the live handlers (every zone when name is ""),
	// sorted by name, key prefix and Redis, so replies do not depend on map order.
	Zones(name string) []Zone
}

// Zone is a zone of a live handler: what the admin API reads of the zone and of its handler.
type Zone interface {
	// Info describes the zone and its handler's Redis, as GET /rate_limit_redis/zones lists it.
	Info() ZoneInfo
	// Params is the zone's limiter parameters (a number from a placeholder is its fallback).
	Params() *limiter.Zone
	// Limiter is the handler's limiter, through which the zone's clients are read and changed.
	Limiter() *limiter.Limiter
	// RedisID names which Redis data the handler reaches: addresses, Sentinel master, db.
	RedisID() string
	// Primaries returns the Redis servers that hold the zone's keys, to scan: the one server,
	// or every primary of a Redis Cluster.
	Primaries(ctx context.Context) ([]limiter.Scanner, error)
	// MapKey maps a client key given to the admin API, as {http.rate_limit_redis.key} shows
	// it, to the key a request of that client has in the zone; warning is not empty when the
	// key may not name the client meant. The error is for a key no request of the zone can
	// have.
	MapKey(given string) (key, warning string, err error)
	// LimiterKey maps a client key of the zone to the limiter's key (through key_secret).
	LimiterKey(key string) string
	// Numbers returns the parameters to read the zone's state with: its own, or for a zone
	// whose numbers come from placeholders (dynamic), a copy with the numbers param gives by
	// name (capacity, refill_rate, limit, window), else their fallbacks. The error names a
	// number missing or unusable.
	Numbers(param func(name string) string) (lz *limiter.Zone, dynamic bool, err error)
	// Override returns the override and its lifetime (0: until deleted) that the JSON body of
	// PUT /rate_limit_redis/override asks of the zone, checked as the zone's own numbers are.
	Override(body []byte) (o limiter.Override, expiresIn time.Duration, err error)
	// ClassName names the zone's priority class of index class.
	ClassName(class int) string
	// TimedOut reports whether err, of a Redis call of the zone's handler, is a timeout (a 504,
	// else a 502).
	TimedOut(err error) bool
}

// served is the registry that every AdminAPI module without its own serves (set by Serve).
var served Registry

// Serve sets the registry of the handlers whose zones the admin.api.rate_limit_redis module
// serves: the process's, given by the handler's package when it is loaded.
func Serve(r Registry) { served = r }

// New returns an AdminAPI serving the zones of r.
func New(r Registry) *AdminAPI { return &AdminAPI{live: r} }

// registry is the registry a serves; a registry of no zones when none was given (a binary that
// has this package without the handler's: every endpoint then answers as for a config with no
// rate_limit_redis handler).
func (a *AdminAPI) registry() Registry {
	if a.live != nil {
		return a.live
	}
	if served == nil {
		return noRegistry{}
	}
	return served
}

// noRegistry is a registry of no zones.
type noRegistry struct{}

func (noRegistry) Zones(string) []Zone { return nil }

// ZoneInfo is one entry of GET /rate_limit_redis/zones.
type ZoneInfo struct {
	// The zone's name.
	Name string `json:"name"`
	// token_bucket or sliding_window.
	Algorithm string `json:"algorithm"`
	// token_bucket: the bucket size, in tokens.
	Capacity int64 `json:"capacity,omitempty"`
	// token_bucket: tokens added per second.
	RefillRate float64 `json:"refill_rate,omitempty"`
	// sliding_window: requests admitted per window; concurrency: requests in flight at once.
	Limit int64 `json:"limit,omitempty"`
	// sliding_window: the window length, in milliseconds.
	WindowMs int64 `json:"window_ms,omitempty"`
	// fixed_window: the calendar period and its time zone, when the window is a period.
	Period   string `json:"period,omitempty"`
	TimeZone string `json:"time_zone,omitempty"`
	// token_bucket: the longest a request may be held (shaping), in milliseconds.
	MaxWaitMs int64 `json:"max_wait_ms,omitempty"`
	// The penalty box: a block's length and a repeat offender's longest, in milliseconds.
	BlockMs    int64 `json:"block_ms,omitempty"`
	BlockMaxMs int64 `json:"block_max_ms,omitempty"`
	// The numbers that come from placeholders, by name (capacity, refill_rate, limit, window,
	// max_cost): the placeholder expression. The number's field above is then its fallback,
	// absent when it has none.
	Placeholders map[string]string `json:"placeholders,omitempty"`
	// Whether the zone reads per-client overrides (PUT /rate_limit_redis/override), and whether
	// it is a shadow zone (its dry_run).
	Overrides bool `json:"overrides,omitempty"`
	DryRun    bool `json:"dry_run,omitempty"`
	// The handler's key_prefix.
	KeyPrefix string `json:"key_prefix"`
	// The handler's Redis addresses (placeholders replaced) and database.
	Redis []string `json:"redis"`
	DB    int      `json:"db,omitempty"`
}

// SlotState is a concurrency zone's slot in flight, in GET /rate_limit_redis/state.
type SlotState struct {
	// The slot's id: the nonce of the decision that took it (instance and call).
	ID string `json:"id"`
	// When the slot frees itself unless refreshed or given back first, in RFC 3339 (UTC).
	Deadline string `json:"deadline"`
}

// ClientEntry is the fields every entry of the replies about one client in one zone begins
// with (/state, /block, /override).
type ClientEntry struct {
	// The zone's name, and the client key used: the key as given, mapped as a request's key is
	// (an IP address masked to the zone's prefix: ::1 is ::/64 in a zone of ipv6_prefix 64).
	Zone string `json:"zone"`
	Key  string `json:"key"`
	// The client key as given, when the mapping changed it.
	KeyGiven string `json:"key_given,omitempty"`
	// Why the key may not name the client meant: a first candidate's value that is an IP
	// address, in a zone whose IP address is another candidate.
	Warning string `json:"warning,omitempty"`
	// Which of the zone's key candidates the key is of, counted from 1: 2 for 2=203.0.113.7.
	Candidate int `json:"candidate"`
	// The Redis key the entry is about (the client's state, block or override), the Redis
	// addresses and database.
	RedisKey string   `json:"redis_key"`
	Redis    []string `json:"redis"`
	DB       int      `json:"db,omitempty"`
}

// entry returns the ClientEntry of t's client in t's zone, whose Redis key is redisKey.
func (t target) entry(redisKey string) ClientEntry {
	candidate, _ := limiter.ParseCandidateKey(t.key)
	e := ClientEntry{Zone: t.info.Name, Key: t.key, Warning: t.warning, Candidate: candidate, RedisKey: redisKey, Redis: t.info.Redis, DB: t.info.DB}
	if t.key != t.given {
		e.KeyGiven = t.given
	}
	return e
}

// BroadcastResult ends the entries of the replies that change a client's state (a reset, a
// block).
type BroadcastResult struct {
	// Whether the change was announced to the other instances, which then forget their cached
	// denials of the client at once. When it was not (broadcast_error says why), the change is
	// done, but they may deny the client from their deny caches for up to their
	// deny_cache_max_age.
	Broadcast      bool   `json:"broadcast"`
	BroadcastError string `json:"broadcast_error,omitempty"`
}

// broadcastOf returns the BroadcastResult of a change whose limiter call returned err, and err
// with limiter.ErrNotBroadcast (the change done, not announced) taken out.
func broadcastOf(err error) (BroadcastResult, error) {
	if errors.Is(err, limiter.ErrNotBroadcast) {
		return BroadcastResult{BroadcastError: err.Error()}, nil
	}
	return BroadcastResult{Broadcast: true}, err
}

// ClientState is one entry of GET /rate_limit_redis/state.
type ClientState struct {
	ClientEntry // redis_key: the state's
	// Why this zone's state was not read, when another handler's zone of the same name was:
	// its numbers come from placeholders and the query gives none (see stateZone). The entry
	// then has the zone, key and algorithm only.
	Error string `json:"error,omitempty"`
	// token_bucket or sliding_window.
	Algorithm string `json:"algorithm"`
	// The quota in force: capacity (token_bucket) or limit (sliding_window), as
	// X-RateLimit-Limit (the client's override's when it has one).
	Limit int64 `json:"limit"`
	// The numbers the state was computed with, for a zone whose numbers come from placeholders
	// (from the query parameters, else the fallbacks) or a client with an override (its numbers
	// in place of the zone's). Absent otherwise.
	Numbers *StateNumbers `json:"numbers,omitempty"`
	// Whether Redis holds state for the client: false for a client never seen or whose state
	// expired (a full bucket, an empty window). Reading never creates it.
	Exists bool `json:"exists"`
	// token_bucket: the tokens in the bucket now, fractional, refilled to the Redis server's
	// time as the decision script computes it; negative when it owes tokens (the reservations of
	// held requests, with max_wait).
	Tokens *float64 `json:"tokens,omitempty"`
	// token_bucket with max_wait (without priority): milliseconds (rounded up) until the bucket holds a whole
	// token: how long a request of cost 1 admitted now would be held.
	WaitMs *int64 `json:"wait_ms,omitempty"`
	// Window algorithms: the requests (slots) counted: in the sliding window ending now
	// (sliding_window), in the fixed window holding now (fixed_window), in the current fixed
	// window (sliding_window_counter).
	Count *int64 `json:"count,omitempty"`
	// sliding_window_counter: the estimate compared with the limit (count plus the previous
	// window's count weighted by its share still inside the sliding window).
	Estimate *float64 `json:"estimate,omitempty"`
	// concurrency: the client's requests in flight (count is their number), each slot with its
	// deadline, soonest first: when it frees itself unless its instance refreshes it first
	// (hold_max after it was taken or last refreshed) or gives it back.
	Slots []SlotState `json:"slots,omitempty"`
	// adaptive_concurrency: the controller (limit is the limit in force, learnt; see
	// LearntState).
	Learnt *LearntState `json:"learnt,omitempty"`
	// a zone with a queue (concurrency with max_wait, or token_bucket with max_wait and
	// priority): the client key's queue (see QueueState).
	Queue *QueueState `json:"queue,omitempty"`
	// fixed_window: the window holding now, [start, end), in RFC 3339 (UTC).
	WindowStart string `json:"window_start,omitempty"`
	WindowEnd   string `json:"window_end,omitempty"`
	// Whole tokens or window slots left now: what X-RateLimit-Remaining would say (0 while the
	// client is blocked).
	Remaining int64 `json:"remaining"`
	// Milliseconds (rounded up) until a request of cost 1 would be admitted (with max_wait,
	// admitted and held); 0: it would be now.
	RetryAfterMs int64 `json:"retry_after_ms"`
	// The Redis key's time to live, in milliseconds: when the bucket is full again or the newest
	// window entry leaves the window, as of the last admitted request. 0 when !exists.
	TTLMs int64 `json:"ttl_ms"`
	// A zone with block: when the client's block ends, in milliseconds since the Unix epoch
	// (Redis server time); absent when it is not blocked. retry_after_ms is then at least the
	// time until then.
	BlockedUntilMs *int64 `json:"blocked_until_ms,omitempty"`
	// A zone with block_max: how many blocks in a row the client's last block ended (1: a first
	// offence; 0: none remembered). Its next block lasts twice the last one, up to block_max.
	Strikes *int64 `json:"strikes,omitempty"`
	// A zone with block_max: the length of the client's last block, in milliseconds, while it is
	// remembered.
	LastBlockMs *int64 `json:"last_block_ms,omitempty"`
}

// StateNumbers are the numbers a state was computed with, of a zone whose numbers come from
// placeholders or of a client with an override: tokens, tokens per second, requests or slots,
// milliseconds.
type StateNumbers struct {
	Capacity   int64   `json:"capacity,omitempty"`
	RefillRate float64 `json:"refill_rate,omitempty"`
	Limit      int64   `json:"limit,omitempty"`
	WindowMs   int64   `json:"window_ms,omitempty"`
	// Whether the client's override is in them.
	Override bool `json:"override,omitempty"`
}

// ResetResult is one entry of DELETE /rate_limit_redis/state.
type ResetResult struct {
	ClientEntry // redis_key: the key deleted
	// Whether the key existed (false: the client was already in its initial state).
	Deleted bool `json:"deleted"`
	BroadcastResult
}

// handleZones serves GET /rate_limit_redis/zones: every zone of the live handlers, identical
// ones once, sorted by name and key prefix.
func (a *AdminAPI) handleZones(w http.ResponseWriter, r *http.Request) error {
	if err := allowMethods(w, r, http.MethodGet); err != nil {
		return err
	}
	zones := []ZoneInfo{}
	for _, t := range a.targets("") {
		zi := t.info
		if !slices.ContainsFunc(zones, func(o ZoneInfo) bool { return zi.equal(o) }) {
			zones = append(zones, zi)
		}
	}
	return writeJSON(w, zones)
}

func (zi ZoneInfo) equal(o ZoneInfo) bool {
	return zi.Name == o.Name && zi.Algorithm == o.Algorithm && zi.Capacity == o.Capacity && zi.RefillRate == o.RefillRate &&
		zi.Limit == o.Limit && zi.WindowMs == o.WindowMs && zi.Period == o.Period && zi.TimeZone == o.TimeZone && zi.MaxWaitMs == o.MaxWaitMs &&
		zi.BlockMs == o.BlockMs && zi.BlockMaxMs == o.BlockMaxMs &&
		zi.Overrides == o.Overrides && zi.DryRun == o.DryRun &&
		zi.KeyPrefix == o.KeyPrefix && slices.Equal(zi.Redis, o.Redis) && zi.DB == o.DB && maps.Equal(zi.Placeholders, o.Placeholders)
}

// handleState serves GET (read) and DELETE (reset) /rate_limit_redis/state?zone=&key=.
func (a *AdminAPI) handleState(w http.ResponseWriter, r *http.Request) error {
	q, zone, key, err := clientQuery(w, r, []string{http.MethodGet, http.MethodDelete})
	if err != nil {
		return err
	}
	ts, err := a.clientTargets(zone, key)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminTimeout)
	defer cancel()
	if r.Method == http.MethodDelete {
		return resetState(ctx, w, ts)
	}
	return readState(ctx, w, ts, q)
}

// allowMethods returns nil when r's method is one of methods, else the 405 naming them, with
// the Allow header set.
func allowMethods(w http.ResponseWriter, r *http.Request, methods ...string) error {
	if slices.Contains(methods, r.Method) {
		return nil
	}
	w.Header().Set("Allow", strings.Join(methods, ", "))
	return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed: use %s", r.Method, wordList(methods, "or"))}
}

// clientQuery checks a request about one client: its method is one of methods (else a 405),
// and the query parameters zone, key and those named in required are given (else a 400). It
// returns the query, zone and key.
func clientQuery(w http.ResponseWriter, r *http.Request, methods []string, required ...string) (q url.Values, zone, key string, err error) {
	if err := allowMethods(w, r, methods...); err != nil {
		return nil, "", "", err
	}
	q = r.URL.Query()
	names := append([]string{"zone", "key"}, required...)
	for _, name := range names {
		if q.Get(name) == "" {
			return nil, "", "", badRequest(fmt.Errorf("query parameters %s are required", wordList(names, "and")))
		}
	}
	return q, q.Get("zone"), q.Get("key"), nil
}

// clientTargets returns the zones named zone of the live handlers, for a request about client
// key, each with the key mapped as its zone maps a request's (Zone.MapKey): a 400 when the key
// is of the "0=" form, which no candidate has, or no request of a zone can have it, a 404 when
// no loaded zone has that name.
func (a *AdminAPI) clientTargets(zone, key string) ([]target, error) {
	if n, _ := limiter.ParseCandidateKey(key); n == limiter.KeyedCandidate {
		return nil, badRequest(errors.New("key: candidates are counted from 1 (0= is no client key's): give the key as {http.rate_limit_redis.key} shows it"))
	}
	ts := a.targets(zone)
	if len(ts) == 0 {
		return nil, caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no rate_limit_redis zone named %q is loaded", zone)}
	}
	for i := range ts {
		mapped, warning, err := ts[i].MapKey(key)
		if err != nil {
			return nil, badRequest(err)
		}
		ts[i].key, ts[i].given, ts[i].warning = mapped, key, warning
	}
	return ts, nil
}

// wordList joins words as a sentence does, with conj before the last: "a", "a or b",
// "a, b or c".
func wordList(words []string, conj string) string {
	if len(words) == 1 {
		return words[0]
	}
	return strings.Join(words[:len(words)-1], ", ") + " " + conj + " " + words[len(words)-1]
}

// stateZone returns the parameters to read t's zone's state with (Zone.Numbers), from the
// query parameters q, and for a zone whose numbers come from placeholders the numbers for the
// reply. A number missing or unusable is a 400.
func stateZone(t target, q url.Values) (*limiter.Zone, *StateNumbers, error) {
	lz, dynamic, err := t.Numbers(q.Get)
	if err != nil {
		return nil, nil, badRequest(err)
	}
	if !dynamic {
		return lz, nil, nil
	}
	return lz, &StateNumbers{Capacity: lz.Capacity, RefillRate: lz.RefillRate, Limit: lz.Limit, WindowMs: lz.Window.Milliseconds()}, nil
}

// readState reads the client's state once per distinct Redis key and zone parameters. q holds
// the numbers of zones whose numbers come from placeholders (see stateZone). A zone whose
// numbers q does not give is an entry with its error when another zone of the name was read,
// else the call's error (400).
func readState(ctx context.Context, w http.ResponseWriter, ts []target, q url.Values) error {
	out := []ClientState{}
	seen := make(map[string]bool)
	var first error // the first zone's whose numbers the query does not give
	read := 0
	for _, t := range ts {
		lz, numbers, err := stateZone(t, q)
		if err != nil {
			// Handlers of one config may share a zone name with other numbers: answer for the
			// zones that can be read, and report this one's error in its entry.
			first = cmp.Or(first, err)
			out = append(out, ClientState{ClientEntry: t.entry(""), Algorithm: t.Params().Algorithm.String(), Error: err.Error()})
			continue
		}
		lk := t.LimiterKey(t.key)
		id := fmt.Sprintf("%s|%s|%d|%g|%d|%d|%s|%s|%d", t.RedisID(), limiter.StateKey(t.info.KeyPrefix, lz, lk),
			lz.Capacity, lz.RefillRate, lz.Limit, lz.Window, t.info.Period, t.info.TimeZone, lz.MaxWait)
		if seen[id] {
			continue
		}
		seen[id] = true
		cs, err := t.stateOf(ctx, lz, numbers, lk)
		if err != nil {
			return err
		}
		out = append(out, cs)
		read++
	}
	if read == 0 && first != nil {
		return first
	}
	return writeJSON(w, out)
}

// stateOf reads the state of client lk in t's zone with parameters lz (numbers: those from
// placeholders, for the reply); errors are the admin API's.
func (t target) stateOf(ctx context.Context, lz *limiter.Zone, numbers *StateNumbers, lk string) (ClientState, error) {
	s, err := t.Limiter().State(ctx, lz, lk)
	if err != nil {
		return ClientState{}, t.redisError(err)
	}
	if !s.Override.IsZero() {
		oz := s.Override.Apply(lz)
		lz = &oz
		numbers = &StateNumbers{Capacity: lz.Capacity, RefillRate: lz.RefillRate, Limit: lz.Limit, WindowMs: lz.Window.Milliseconds(), Override: true}
	}
	cs := ClientState{
		ClientEntry: t.entry(s.Key), Algorithm: lz.Algorithm.String(), Limit: lz.Quota(), Numbers: numbers,
		Exists: s.Exists, Remaining: s.Remaining, RetryAfterMs: limiter.CeilMs(s.RetryAfter), TTLMs: s.TTL.Milliseconds(),
	}
	setBlockState(&cs, lz, s.Block)
	switch lz.Algorithm {
	case limiter.TokenBucket:
		cs.Tokens = &s.Tokens
		switch {
		case lz.Queues():
			if cs.Queue, err = t.queueOf(ctx, lz, lk, s.Now); err != nil {
				return ClientState{}, t.redisError(err)
			}
		case lz.MaxWait > 0:
			wait := limiter.CeilMs(s.Wait)
			cs.WaitMs = &wait
		}
	case limiter.SlidingWindowCounter:
		cs.Count, cs.Estimate = &s.Count, &s.Estimate
	case limiter.FixedWindow:
		cs.Count = &s.Count
		cs.WindowStart, cs.WindowEnd = s.WindowStart.UTC().Format(time.RFC3339Nano), s.WindowEnd.UTC().Format(time.RFC3339Nano)
	case limiter.Concurrency, limiter.AdaptiveConcurrency:
		cs.Count = &s.Count
		if err := t.slotsState(ctx, lz, lk, s.Now, &cs); err != nil {
			return ClientState{}, t.redisError(err)
		}
		if lz.Algorithm.Adapts() {
			cs.Limit = s.Learnt.Limit
			cs.Learnt = &LearntState{Ceiling: lz.Limit, MinLatencyMs: s.Learnt.MinLatency.Milliseconds(), LatencyMs: s.Learnt.Latency.Milliseconds()}
		}
	case limiter.SlidingWindow:
		cs.Count = &s.Count
	default:
		return ClientState{}, fmt.Errorf("zone %s: unknown algorithm %v", t.info.Name, lz.Algorithm)
	}
	return cs, nil
}

// LearntState is an adaptive_concurrency zone's controller for a client, as its decisions read it.
type LearntState struct {
	// The zone's limit: the most the learnt limit may be (requests in flight).
	Ceiling int64 `json:"ceiling"`
	// The upstream's minimum latency its last probe measured, in milliseconds (to the response
	// header); 0 before the first probe ends.
	MinLatencyMs int64 `json:"min_latency_ms"`
	// The mean latency of its requests in its last update interval, in milliseconds; 0 before one.
	LatencyMs int64 `json:"latency_ms"`
}

// slotsState sets the slots in flight of a concurrency zone's client lk in cs, and its queue's
// state at now when the zone has one.
func (t target) slotsState(ctx context.Context, lz *limiter.Zone, lk string, now time.Time, cs *ClientState) error {
	slots, err := t.Limiter().InFlight(ctx, lz, lk)
	if err != nil {
		return err
	}
	for _, sl := range slots {
		cs.Slots = append(cs.Slots, SlotState{ID: sl.ID, Deadline: sl.Deadline.UTC().Format(time.RFC3339Nano)})
	}
	if lz.Queues() {
		cs.Queue, err = t.queueOf(ctx, lz, lk, now)
	}
	return err
}

// QueueState is a queue in the admin API's state reply: the requests waiting per class, and
// how long the oldest of them has waited.
type QueueState struct {
	// The requests waiting, by class name ("default" without priority).
	Waiting map[string]int64 `json:"waiting"`
	// Milliseconds the oldest waiter has waited (0 when none waits).
	OldestWaitMs int64 `json:"oldest_wait_ms"`
	// With fair_by: the tenants waiting now and their waiters (every class together), the most
	// waiters first, at most 100 of them. A tenant is as the queue keeps it: the fair_by value,
	// keyed with key_secret, or its digest when long; "" is the place the tenants beyond
	// fair_tenants share.
	Tenants []QueueTenant `json:"tenants,omitempty"`
	// With fair_by: how many tenants wait now, listed or not.
	TenantsWaiting int `json:"tenants_waiting,omitempty"`
}

// QueueTenant is one tenant waiting in a fair queue.
type QueueTenant struct {
	// The tenant.
	Tenant string `json:"tenant"`
	// Its requests waiting now.
	Waiting int64 `json:"waiting"`
}

// queueOf reads the queue of t's zone for client key lk at now.
func (t target) queueOf(ctx context.Context, lz *limiter.Zone, lk string, now time.Time) (*QueueState, error) {
	q, err := t.Limiter().Queue(ctx, lz, lk)
	if err != nil {
		return nil, err
	}
	out := &QueueState{Waiting: map[string]int64{}}
	for c, n := range q.Waiting {
		out.Waiting[t.ClassName(c)] = n
	}
	if !q.Oldest.IsZero() {
		out.OldestWaitMs = max(0, now.Sub(q.Oldest).Milliseconds())
	}
	for _, tw := range q.Tenants {
		out.Tenants = append(out.Tenants, QueueTenant{Tenant: tw.Tenant, Waiting: tw.Waiting})
	}
	out.TenantsWaiting = q.TenantsWaiting
	return out, nil
}

// resetState deletes each distinct Redis key of the client once, and clears the cached denial
// of every handler with the zone.
func resetState(ctx context.Context, w http.ResponseWriter, ts []target) error {
	out := []ResetResult{}
	err := eachClientKey(ts, true, limiter.StateKey, func(_ int, t target, lk string, e ClientEntry) error {
		existed, err := t.Limiter().Reset(ctx, t.Params(), lk)
		b, err := broadcastOf(err)
		if err != nil {
			return t.redisError(err)
		}
		out = append(out, ResetResult{ClientEntry: e, Deleted: existed, BroadcastResult: b})
		return nil
	})
	if err != nil {
		return err
	}
	return writeJSON(w, out)
}

// eachClientKey calls do once for each distinct Redis key of the targets' client among ts (the key that
// redisKey names, in the target's Redis), with the first target that has it (ts[i]), the
// client's limiter key lk and the reply's ClientEntry. With forget (do changes the client's
// state), each later target of a key clears its own handler's cached denials and grants of the
// client: do clears them in the first target's handler only.
func eachClientKey(ts []target, forget bool, redisKey func(prefix string, z *limiter.Zone, lk string) string,
	do func(i int, t target, lk string, e ClientEntry) error,
) error {
	seen := make(map[string]bool)
	for i, t := range ts {
		lk := t.LimiterKey(t.key)
		rk := redisKey(t.info.KeyPrefix, t.Params(), lk)
		id := t.RedisID() + "|" + rk
		if seen[id] {
			if forget {
				t.Limiter().Forget(t.Params(), lk) // changed already: only this handler's deny cache and grants are left
			}
			continue
		}
		seen[id] = true
		if err := do(i, t, lk, t.entry(rk)); err != nil {
			return err
		}
	}
	return nil
}

// target is a zone of a live handler.
type target struct {
	Zone
	info ZoneInfo // the zone's Info
	// The client key of an admin request about one client: as given, as the zone maps it
	// (clientTargets), and the mapping's warning.
	given, key, warning string
}

// targets returns the zones named name of a's registry (every zone when name is ""), in its
// order (Registry.Zones).
func (a *AdminAPI) targets(name string) []target {
	zs := a.registry().Zones(name)
	ts := make([]target, len(zs))
	for i, z := range zs {
		ts[i] = target{Zone: z, info: z.Info()}
	}
	return ts
}

// redisError is the admin API error for a failed Redis call of t's handler: 504 when it timed
// out, else 502.
func (t target) redisError(err error) error {
	status := http.StatusBadGateway
	if t.TimedOut(err) {
		status = http.StatusGatewayTimeout
	}
	return caddy.APIError{HTTPStatus: status, Err: fmt.Errorf("redis: %w", err)}
}

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(v)
}

// Interface guards
var _ caddy.AdminRouter = (*AdminAPI)(nil)
