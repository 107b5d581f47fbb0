// Package ratelimitredis is a Caddy v2 HTTP handler that rate-limits requests across every Caddy
// instance of a deployment. All limiter state lives in Redis and every decision is one atomic Lua
// script execution, so N instances enforce one global limit exactly.
package ratelimitredis

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	_ "time/tzdata" // time_zone works where the system has no time zone database (scratch images)

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
)

func init() {
	caddy.RegisterModule((*Handler)(nil))
}

// Defaults applied in Provision when a field is left empty.
const (
	DefaultAddress   = "127.0.0.1:6379"
	DefaultKeyPrefix = "rl:"
	DefaultTimeout   = 100 * time.Millisecond
	DefaultKey       = "{http.vars.client_ip}"
	DefaultCost      = "1"
	DefaultZoneName  = "default"
	// DefaultIPv4Prefix and DefaultIPv6Prefix are the prefix lengths to which a key candidate
	// that is an IP address is masked: an IPv4 client is its address, an IPv6 client its /64
	// (what one subscriber is usually given, and rotates addresses within).
	DefaultIPv4Prefix = 32
	DefaultIPv6Prefix = 64
	// MaxSlidingWindowCost bounds the max_cost of a sliding_window zone whose cost is a
	// placeholder: one request adds that many sorted set entries in one script call.
	MaxSlidingWindowCost = 1000
	// DefaultMaxWaiting is how many requests a handler with a max_wait zone holds at once by
	// default: about 40 MB when all are held, at about 40 KB per held request with its HTTP/1.1
	// connection (measured: docs/shaping.md).
	DefaultMaxWaiting = 1000
)

// localKeys bounds the client buckets fail_mode local keeps per zone: a variable so that tests
// can exceed it with fewer requests.
var localKeys = limiter.DefaultLocalKeys

// Values of Handler.FailMode.
const (
	FailOpen   = "open"
	FailClosed = "closed"
	FailLocal  = "local"
)

// Values of Zone.EmptyKey: what a request whose key placeholders are all empty does in a zone.
const (
	EmptyKeyShared = "shared" // counted under one key shared by all such requests of the zone
	EmptyKeySkip   = "skip"   // the zone does not apply to it
	EmptyKeyDeny   = "deny"   // rejected with 403
)

// Values of Handler.Headers.
const (
	HeadersLegacy = "legacy"
	HeadersIETF   = "ietf"
	HeadersBoth   = "both"
	HeadersOff    = "off"
)

// Values of Handler.Clock.
const (
	ClockRedis = "redis"
	ClockLocal = "local"
)

// Handler implements the http.handlers.rate_limit_redis module: a middleware that admits or rejects
// each request by running one Lua script on Redis that decides every zone applying to it.
type Handler struct {
	// How to connect to Redis. Default: one standalone server at 127.0.0.1:6379.
	Redis *RedisConfig `json:"redis,omitempty"`

	// Prepended to every Redis key the handler writes. Must not contain `{` or `}` (the client key
	// is the Redis Cluster hash tag). Default: `rl:`.
	KeyPrefix string `json:"key_prefix,omitempty"`

	// The deadline of one decision's Redis call, as a duration (JSON: nanoseconds or a duration
	// string such as "100ms"). When it passes, the decision counts as a Redis failure and
	// `fail_mode` applies. Default: 100ms.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// What happens when Redis fails (error, timeout, a reply of the wrong shape, or the circuit
	// breaker open after repeated failures): `open` lets the request through (with
	// `X-RateLimit-Degraded: true` when headers are on); `closed` rejects it with 503 and
	// `Retry-After: 1`; `local` enforces every zone in process on this instance until Redis
	// answers again, so the global limit becomes a per-instance one (window zones as a token
	// bucket of the same rate). A zone's own `fail_mode` overrides this one for the
	// zone. Default: `open`.
	FailMode string `json:"fail_mode,omitempty"`

	// Which rate limit response headers to send: `legacy` (X-RateLimit-Limit, -Remaining, -Reset),
	// `ietf` (RateLimit-Policy and RateLimit of the IETF httpapi ratelimit-headers draft), `both`
	// or `off`. Default: `legacy`.
	Headers string `json:"headers,omitempty"`

	// Whose clock the scripts use: `redis` (the Redis server's TIME, so instances with skewed clocks
	// agree) or `local` (this instance's clock, sent with each call). Default: `redis`.
	Clock string `json:"clock,omitempty"`

	// Whether to send `X-RateLimit-Degraded: true` on the responses decided while Redis failed
	// (fail_mode open or local), when headers are on. It tells clients and monitoring that the
	// limits are off or per instance; it tells an attacker the same. The
	// {http.rate_limit_redis.degraded} placeholder is set either way. Default: true.
	DegradedHeader *bool `json:"degraded_header,omitempty"`

	// Whether a refused gRPC call (a POST over HTTP/2 of content-type application/grpc) gets the
	// response gRPC clients understand instead of the HTTP status: gRPC's Trailers-Only
	// response, HTTP 200 with `grpc-status: 8` (RESOURCE_EXHAUSTED) for a denial (429), `14`
	// (UNAVAILABLE) for fail_mode closed (503), `7` (PERMISSION_DENIED) for empty_key deny
	// (403), `3` (INVALID_ARGUMENT) for a bad cost (400), `13` (INTERNAL) for an unusable zone
	// number or matcher (500), a `grpc-message` naming the zone, and, for a denial or fail_mode
	// closed, `grpc-retry-pushback-ms` (the Retry-After wait in milliseconds; -1, do not retry,
	// when waiting cannot cure the denial). It is written by the handler, never through
	// handle_errors, whose routes would answer it with a status or body a gRPC client cannot
	// read; off sends gRPC calls the HTTP refusal through Caddy's error path like any request.
	// Every refusal, gRPC or not, is Cache-Control: no-store. Default: true.
	GRPCStatus *bool `json:"grpc_status,omitempty"`

	// Decide and report (headers, placeholders) as usual, but never reject a request.
	DryRun bool `json:"dry_run,omitempty"`

	// Whether denials are cached in process (the deny cache). When a zone denies a client, this
	// instance remembers Redis's answer and gives it again, with no Redis call and the times less
	// what elapsed, to the requests of the same zone, client and cost (and, where the zone's
	// numbers come from placeholders, the same numbers), until the zone's next token
	// or window slot arrives (so the answer is still Redis's), and for at most
	// `deny_cache_max_age`. Bounded to 65,536 (zone, client, cost) entries per handler, least
	// recently used evicted. Default: true.
	DenyCache *bool `json:"deny_cache,omitempty"`

	// How long a cached denial is trusted at most, counted from when its Redis call was sent, as a
	// duration (JSON: nanoseconds or a duration string). It bounds how long an instance can keep
	// denying a client after something gave capacity back that the instance did not hear of: an
	// admin reset whose broadcast it missed, a raised limit on another instance, a Redis Cluster
	// release. A flooding client costs one Redis call per zone per max_age per instance.
	// Default: 1s.
	DenyCacheMaxAge caddy.Duration `json:"deny_cache_max_age,omitempty"`

	// Include the client key in the handler's log lines (the debug line of each denial). Client
	// keys (IP addresses, API keys) can be personal data or credentials, so by default no log
	// line of the handler holds one; the `{http.rate_limit_redis.key}` placeholder is there for
	// access logs that choose to.
	LogKey bool `json:"log_key,omitempty"`

	// A secret under which every client key is replaced, in Redis and in the deny cache, by a
	// keyed digest: `0=` and the base64url HMAC-SHA256 of the key candidate's number and value
	// (45 bytes). Without it a client that chooses its key (an API key header) also chooses the
	// Redis Cluster hash slot of its state, since CRC16 is easy to invert, and can aim all its
	// new keys at one slot and so at one primary; and short keys (IP addresses, API keys) are
	// Redis key names as they are. With it, neither: only who holds the secret can tell which
	// slot a key goes to. At least 16 bytes; use 32 random bytes (`openssl rand -base64 32`).
	// Give it as a placeholder such as {env.RATE_LIMIT_KEY_SECRET}: it is replaced when the
	// config loads (only global placeholders can be) and is never logged or put in an error. The
	// admin API maps the key it is given through the same secret. Changing the secret (or setting
	// or removing it) starts every client of every zone afresh. Handlers sharing a zone's state
	// (same Redis, key_prefix and zone name) must use the same secret.
	KeySecret string `json:"key_secret,omitempty"`

	// The prefix length, 1 to 32, to which every zone masks a key candidate that is an IPv4
	// address (an IPv4-mapped IPv6 address counts as IPv4): the client key is then the network,
	// such as 203.0.113.0/24, and every address in it shares one client's quota. A zone's own
	// ipv4_prefix overrides it. Default: 32, each address on its own (the key is the address).
	IPv4Prefix int `json:"ipv4_prefix,omitempty"`

	// The prefix length, 1 to 128, to which every zone masks a key candidate that is an IPv6
	// address: the client key is then the network, such as 2001:db8::/64. A zone's own
	// ipv6_prefix overrides it. 128 keys each address on its own. Default: 64, because an IPv6
	// client usually holds a whole /64 and can rotate through its addresses.
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`

	// The most a 429's Retry-After is randomly lengthened by, so that clients denied together do
	// not all come back at the same instant: a whole number of seconds (JSON: nanoseconds or a
	// duration string such as "5s"), drawn uniformly from 0 to it per denial and added to the
	// exact Retry-After, which it never shortens. The deny cache keeps the exact time, so jitter
	// never admits a request early. A zone's own jitter overrides it. Default: 0, none.
	Jitter caddy.Duration `json:"jitter,omitempty"`

	// The most requests this handler holds at once for their zones' `max_wait` (shaping). A
	// request that would have to wait while as many are held (or about to be) is decided as
	// without max_wait: admitted if a zone admits it now, else 429, charging nothing. No client
	// key of a zone (a literal key aside) holds more than a tenth of them, rounded up: so that one
	// client cannot take them all (docs/shaping.md). Each held request keeps its connection and
	// goroutine. Default: 1000 when a zone has a max_wait.
	MaxWaiting int `json:"max_waiting,omitempty"`

	// The zones, checked in the order given. A request must pass every zone that applies to it;
	// if any zone denies, no zone is charged. At least one zone is required.
	Zones []*Zone `json:"zones,omitempty"`

	limiter *limiter.Limiter
	local   *limiter.Local // when a zone's fail_mode is local
	// stopRefresh, closed by Cleanup, stops the refresher of concurrency slots (concurrency.go).
	stopRefresh chan struct{}
	keySecret   *limiter.KeySecret // key_secret resolved; nil without it
	// degradedHeader: X-RateLimit-Degraded is sent (headers on, degraded_header not off).
	degradedHeader bool
	client         *sharedClient
	events         *events // nil without an events app in the config
	// bareDenials: the server has no handle_errors routes, so a denial is written as a bare 429
	// by the handler instead of going through Caddy's error path (about 11% of throughput on a
	// deny flood, for the same response).
	bareDenials bool
	// grpcStatus: refused gRPC calls get a gRPC status (grpc_status not off; grpc.go).
	grpcStatus bool
	poolKey    string // the key of this handler's reference in clients; "" when it holds none
	logger     *zap.Logger
	// waiting holds the places of the requests held for a max_wait, and of those being decided
	// that may be: never more than MaxWaiting, nor more than a client's share (waiting.go).
	waiting *waitingRoom
}

// RedisConfig is how to connect to Redis.
type RedisConfig struct {
	// Redis server addresses as host:port. Placeholders such as {env.REDIS_ADDR} are replaced
	// when the config loads; one that is empty then (an unset variable), or an empty address,
	// is a load error naming it. More than one address (without `sentinel`) means Redis Cluster:
	// they are seeds, the other nodes are discovered. With `sentinel`, they are the Sentinels.
	// Default (only when no address is given): ["127.0.0.1:6379"].
	Addresses []string `json:"addresses,omitempty"`

	// The ACL user name. Placeholders are replaced when the config loads; one that is empty then
	// is a load error, as for every string of the redis block.
	Username string `json:"username,omitempty"`

	// The password (of the ACL user, or of `requirepass`). Use a placeholder such as
	// {env.REDIS_PASSWORD} to keep it out of the config; it is replaced when the config loads and
	// never logged.
	Password string `json:"password,omitempty"`

	// The database number (standalone and Sentinel only: Redis Cluster has only 0). Default: 0.
	DB int `json:"db,omitempty"`

	// The Sentinel master name: when set, the addresses are Sentinels, which name the current
	// primary; decisions follow a failover with no reload. Exclusive with Cluster.
	Sentinel string `json:"sentinel,omitempty"`

	// Use Redis Cluster even with a single seed address.
	Cluster bool `json:"cluster,omitempty"`

	// Connect with TLS (to every cluster node, and to the Sentinels as well as the data nodes).
	// The PEM files are read when the config loads.
	TLS *TLSConfig `json:"tls,omitempty"`

	// The maximum number of connections to each Redis server. Default: go-redis's, 10 per CPU.
	PoolSize int `json:"pool_size,omitempty"`

	// How long to wait for a new connection. A decision never waits longer than the handler's
	// `timeout` in any case. Default: the handler's `timeout`.
	DialTimeout caddy.Duration `json:"dial_timeout,omitempty"`
}

// TLSConfig is the TLS configuration of the Redis connection.
type TLSConfig struct {
	// A PEM file of the CA certificates that sign the Redis server certificate. Default: the
	// system roots.
	CA string `json:"ca,omitempty"`

	// A PEM client certificate file, for servers that require client certificates.
	Cert string `json:"cert,omitempty"`

	// The PEM private key file of Cert.
	Key string `json:"key,omitempty"`

	// The server name to verify the certificate against. Default: the host of the address.
	ServerName string `json:"server_name,omitempty"`

	// Skip verifying the server certificate. For testing only.
	InsecureSkipVerify bool `json:"insecure_skip_verify,omitempty"`
}

// Zone is one rate limit: which requests it applies to, how it keys them and its algorithm's
// parameters.
type Zone struct {
	// The zone's name: 1 to 64 characters of [A-Za-z0-9_.-], unique within the handler. It is part
	// of every Redis key of the zone, so two handlers with a zone of the same name and key prefix
	// share its state.
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
	// instances; see docs/decisions.md). Default: `token_bucket`.
	Algorithm string `json:"algorithm,omitempty"`

	// token_bucket: the bucket size (burst), in tokens; 1 to 2^53. Like refill_rate, limit,
	// window and max_cost, it may instead come from a placeholder resolved per request (plans and
	// tiers): in JSON a string holding the placeholder and, optionally after a space, a literal
	// fallback used when the placeholder is empty: "{http.vars.plan_capacity} 100". A literal may
	// also be given as a string in the Caddyfile's syntax ("100"; refill_rate "100/1m"). A
	// placeholder's value has the Caddyfile's syntax and range; one that is empty without a
	// fallback, does not parse or is out of range rejects the request with 500 and an error
	// naming the zone, the number and why (logged at error level); nothing is charged.
	Capacity int64 `json:"capacity,omitempty"`

	// token_bucket: tokens added per second (a float; 100 per minute is 1.6667). Must be > 0. Or
	// a placeholder, optionally with a fallback, as for capacity: "{http.vars.plan_rate} 10"; its
	// value is written as in the Caddyfile, tokens per second or per a duration ("100/1m").
	RefillRate float64 `json:"refill_rate,omitempty"`

	// sliding_window, fixed_window, sliding_window_counter: requests admitted per window; 1 to
	// 1,000,000 for sliding_window (one Redis entry per request), to 2^53 for the others (one
	// counter per client). concurrency: requests of a client in flight at once, 1 to 100,000 (one
	// Redis entry per request in flight). Or a placeholder, optionally with a fallback, as for
	// capacity.
	Limit int64 `json:"limit,omitempty"`

	// sliding_window, fixed_window, sliding_window_counter: the window length, as a duration
	// (JSON: nanoseconds or a duration string); 1ms to 366 days. A fixed_window's windows of a
	// duration are aligned to the Unix epoch (a 1h window starts on the hour, UTC). Or a
	// placeholder, optionally with a fallback, as for capacity: "{http.vars.plan_window} 1h"; its
	// value is a duration string ("1h", "1d").
	Window caddy.Duration `json:"window,omitempty"`

	// fixed_window, instead of window: a calendar period, `hour`, `day`, `week` (from Monday) or
	// `month`, starting at its start in `time_zone`. The count starts again at 0 when the period
	// does; X-RateLimit-Reset and Retry-After say when.
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
	// client that disconnects while held ends its wait at once (499); its tokens stay spent. Up
	// to 1m. Not for the window algorithms: they give their quota back in steps, so a held
	// request would have no exact turn. Default: 0, reject at once.
	MaxWait caddy.Duration `json:"max_wait,omitempty"`

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
	MaxCost int64 `json:"max_cost,omitempty"`

	// What happens in this zone when Redis fails: `open`, `closed` or `local`, as the handler's
	// `fail_mode`, which is the default. When the zones of a request have different modes and
	// Redis fails, closed wins over local, and local over open: a closed zone answers 503; else
	// the local zones are enforced in process and the open zones let the request through.
	FailMode string `json:"fail_mode,omitempty"`

	// The zone applies only to requests matching one of these matcher sets (as in a route's
	// `match`). Default: every request.
	MatcherSetsRaw caddyhttp.RawMatcherSets `json:"match,omitempty" caddy:"namespace=http.matchers"`

	// This zone's IPv4 prefix length (1 to 32), instead of the handler's ipv4_prefix.
	IPv4Prefix int `json:"ipv4_prefix,omitempty"`

	// This zone's IPv6 prefix length (1 to 128), instead of the handler's ipv6_prefix.
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`

	// This zone's Retry-After jitter, instead of the handler's: used when the zone decides a
	// denial. 0 turns jitter off for the zone.
	Jitter *caddy.Duration `json:"jitter,omitempty"`

	// Charge after the response only the requests whose status is listed: codes (401) or
	// classes (4xx). A request is admitted only if the zone has room for its cost, which it
	// holds while the request runs; the others get it back (a window counter's, while the
	// window it was charged in lasts). Every algorithm.
	CountStatus []string `json:"count_status,omitempty"`

	// Charge what the response reports in place of the cost, which becomes a reservation
	// (token_bucket, fixed_window and sliding_window_counter; not sliding_window). See Charge.
	Charge *Charge `json:"charge,omitempty"`

	// token_bucket and fixed_window: lease the tokens (window slots) of this instance's hot
	// clients from Redis in grants spent in process (see Lease). Not with max_wait, count_status
	// or charge. Default: none, every request decided in Redis.
	Lease *Lease `json:"lease,omitempty"`

	// With count_status or charge: how long a reservation waits for its response; an
	// unsettled one (an instance that crashed) counts as charged after it. concurrency: how
	// long a slot is held without a refresh (1s to 1d): the instance refreshes the slots of its
	// requests in flight every third of it, and the slots of an instance that died free
	// themselves at most hold_max after it died. Default: 10m.
	HoldMax caddy.Duration `json:"hold_max,omitempty"`

	after *afterResponse // count_status and charge, provisioned; nil without them
	// exprs holds each number given by a placeholder as configured: the placeholder and,
	// optionally after a space, the literal fallback ("{plan_capacity} 100"); "" for a literal.
	// Set by the Caddyfile parser and UnmarshalJSON, written back by MarshalJSON (numbers.go).
	exprs [numFields]string
	// dyn are the numbers resolved per request, as provisioned from exprs; empty when every
	// number is a literal, and the zone's requests then use lz itself.
	dyn         []dynNumber
	matcherSets caddyhttp.MatcherSets
	// lz is the zone's limiter parameters: the literals, and each placeholder number's
	// fallback (0 without one), which ServeHTTP copies and completes per request (numbers.go).
	lz        limiter.Zone
	fixedCost int64               // > 0 when Cost is a literal integer
	decisions *decisionCounters   // the zone's series of decisions_total
	delays    prometheus.Observer // the zone's series of delay_seconds; nil without max_wait
	emptyKeys prometheus.Counter
	failMode  string // FailMode, or the handler's
	v4, v6    int    // the prefix lengths in force
	jitter    int64  // the Retry-After jitter in force, in seconds
	perClient bool   // a key has a placeholder: its client keys tell clients apart (waiting.go)
	// keySources are, per entry of Key, how the entry is read (compileKey): an entry that is
	// exactly one placeholder is looked up directly, with no string building (clientKey).
	keySources []keySource

	// Formatted once for the hot path: the quota (X-RateLimit-Limit), the quoted name and the
	// RateLimit-Policy value, and the errors of a denial.
	quota, quotedName, policy                 string
	errLimited, errUnsatisfiable, errEmptyKey error
}

// CaddyModule returns the Caddy module information. Its receiver is a pointer, and it is
// registered as one: the events app asks a handler for its module ID while a request is under
// way, and a value receiver copied the whole Handler then, racing with Cleanup's writes.
func (*Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit_redis",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision fills in defaults, loads the zones' matchers and takes a reference to the shared
// Redis client for the connection config. It never contacts Redis.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if h.Redis == nil {
		h.Redis = new(RedisConfig)
	}
	if h.KeyPrefix == "" {
		h.KeyPrefix = DefaultKeyPrefix
	}
	if h.Timeout == 0 {
		h.Timeout = caddy.Duration(DefaultTimeout)
	}
	if h.FailMode == "" {
		h.FailMode = FailOpen
	}
	if h.Headers == "" {
		h.Headers = HeadersLegacy
	}
	if h.Clock == "" {
		h.Clock = ClockRedis
	}
	if h.DenyCacheMaxAge == 0 {
		h.DenyCacheMaxAge = caddy.Duration(limiter.DefaultDenyCacheMaxAge)
	}
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	h.degradedHeader = h.Headers != HeadersOff && (h.DegradedHeader == nil || *h.DegradedHeader)
	h.grpcStatus = h.GRPCStatus == nil || *h.GRPCStatus
	needLocal := h.FailMode == FailLocal
	for _, z := range h.Zones {
		if err := z.provision(ctx, h.logger); err != nil {
			return err
		}
		if z.MaxWait > 0 && h.MaxWaiting == 0 {
			h.MaxWaiting = DefaultMaxWaiting
		}
		z.failMode = z.FailMode
		if z.failMode == "" {
			z.failMode = h.FailMode
		}
		needLocal = needLocal || z.failMode == FailLocal
		z.v4 = cmp.Or(z.IPv4Prefix, h.IPv4Prefix, DefaultIPv4Prefix)
		z.v6 = cmp.Or(z.IPv6Prefix, h.IPv6Prefix, DefaultIPv6Prefix)
		jitter := h.Jitter
		if z.Jitter != nil {
			jitter = *z.Jitter
		}
		z.jitter = int64(time.Duration(jitter) / time.Second)
	}
	h.waiting = newWaitingRoom(h.MaxWaiting)
	h.keySecret = nil
	if h.KeySecret != "" {
		ks, err := resolveKeySecret(h.KeySecret)
		if err != nil {
			return err
		}
		h.keySecret = ks
	}
	// Checked here, not only in Validate, because the client must not be created for a
	// connection config that cannot work.
	if err := h.Redis.validate(); err != nil {
		return err
	}
	if err := h.Redis.checkResolved(); err != nil {
		return err
	}
	client, key, err := acquireClient(h.Redis.resolve(time.Duration(h.Timeout)))
	if err != nil {
		return fmt.Errorf("redis client: %w", err)
	}
	h.client, h.poolKey = client, key
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok {
		h.bareDenials = srv.Errors == nil || len(srv.Errors.Routes) == 0
	}
	if needLocal {
		h.local = limiter.NewLocal(localKeys)
	}
	opts := limiter.Options{KeyPrefix: h.KeyPrefix}
	if h.DenyCache == nil || *h.DenyCache {
		opts.DenyCacheKeys = limiter.DefaultDenyCacheKeys
		opts.DenyCacheMaxAge = time.Duration(h.DenyCacheMaxAge)
	}
	opts.Pipeline = client.pipeline
	opts.Cluster = client.cluster
	if client.cluster {
		opts.PipelineFor = client.pipelineFor
	}
	if h.Clock == ClockLocal {
		opts.Now = time.Now
	}
	// A grant's renewal and return share decisions' round trips; a Redis Cluster release follows
	// a decision that failed.
	opts.CallTimeout = time.Duration(h.Timeout)
	if slices.ContainsFunc(h.Zones, func(z *Zone) bool { return z.Lease != nil }) {
		opts.Leases, opts.LeaseMetrics = true, newPromLease(h.Zones)
	}
	h.limiter = limiter.New(client.rdb, opts)
	client.resets.Add(h.limiter)
	h.startRefresher()
	h.events = newEvents(ctx, client.addrs)
	register(h) // for the admin API
	return nil
}

func (z *Zone) provision(ctx caddy.Context, logger *zap.Logger) error {
	if len(z.Key) == 0 {
		z.Key = []string{DefaultKey}
	}
	z.perClient = slices.ContainsFunc(z.Key, func(k string) bool { return strings.Contains(k, "{") })
	if z.Algorithm == "" {
		z.Algorithm = limiter.TokenBucket.String()
	}
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
	algo, err := limiter.ParseAlgorithm(z.Algorithm)
	if err != nil {
		return fmt.Errorf("zone %s: %w", z.Name, err)
	}
	err = z.provisionNumbers(algo, func(field, value string) string {
		return z.checkPlaceholder(logger, field, value, zap.String("when_empty", "the fallback, else 500"))
	})
	if err != nil {
		return err
	}
	z.lz = limiter.Zone{
		Name: z.Name, Algorithm: algo, Capacity: z.Capacity, RefillRate: z.RefillRate,
		Limit: z.Limit, Window: time.Duration(z.Window), MaxCost: z.MaxCost, MaxWait: time.Duration(z.MaxWait),
		Lease: z.Lease.limiterLease(),
	}
	if z.Period != "" {
		if z.lz.Period, err = limiter.ParsePeriod(z.Period); err != nil {
			return fmt.Errorf("zone %s: %w", z.Name, err)
		}
	}
	if z.TimeZone != "" {
		if z.lz.Location, err = time.LoadLocation(z.TimeZone); err != nil {
			return fmt.Errorf("zone %s: time_zone %q is not a time zone of the IANA database: %w", z.Name, z.TimeZone, err)
		}
	}
	if z.MaxCost == 0 && algo == limiter.SlidingWindow && hasPlaceholder(z.Cost) && len(z.dyn) == 0 {
		z.lz.MaxCost = min(z.Limit, MaxSlidingWindowCost) // with placeholder numbers: per request
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
		if z.MaxWait > 0 {
			z.delays = metrics.delays.WithLabelValues(z.Name)
		}
	}
	if !hasPlaceholder(z.Cost) { // as the Caddyfile parser decides
		n, err := strconv.ParseInt(z.Cost, 10, 64)
		if err != nil || n < 1 {
			return fmt.Errorf("zone %s: cost %q must be a positive integer or a placeholder", z.Name, z.Cost)
		}
		z.fixedCost = n
	}
	if err := z.provisionAfter(); err != nil {
		return err
	}
	if z.MatcherSetsRaw != nil {
		mods, err := ctx.LoadModule(z, "MatcherSetsRaw")
		if err != nil {
			return fmt.Errorf("zone %s: loading matchers: %w", z.Name, err)
		}
		if err := z.matcherSets.FromInterface(mods); err != nil {
			return fmt.Errorf("zone %s: %w", z.Name, err)
		}
	}
	return nil
}

// Validate checks the provisioned configuration; its errors name the field at fault.
func (h *Handler) Validate() error {
	if len(h.Zones) == 0 {
		return fmt.Errorf("at least one zone is required")
	}
	if strings.ContainsAny(h.KeyPrefix, "{}") {
		return fmt.Errorf("key_prefix %q must not contain { or }: the client key is the Redis Cluster hash tag", h.KeyPrefix)
	}
	if h.Timeout <= 0 {
		return fmt.Errorf("timeout must be > 0")
	}
	if h.DenyCacheMaxAge < 0 {
		return fmt.Errorf("deny_cache_max_age must be > 0")
	}
	if h.MaxWaiting < 0 {
		return fmt.Errorf("max_waiting %d must be >= 1", h.MaxWaiting)
	}
	switch h.FailMode {
	case FailOpen, FailClosed, FailLocal:
	default:
		return fmt.Errorf("fail_mode %q must be open, closed or local", h.FailMode)
	}
	switch h.Headers {
	case HeadersLegacy, HeadersIETF, HeadersBoth, HeadersOff:
	default:
		return fmt.Errorf("headers %q must be legacy, ietf, both or off", h.Headers)
	}
	switch h.Clock {
	case ClockRedis, ClockLocal:
	default:
		return fmt.Errorf("clock %q must be redis or local", h.Clock)
	}
	if err := checkPrefixes("", h.IPv4Prefix, h.IPv6Prefix); err != nil {
		return err
	}
	if err := checkJitter("", h.Jitter); err != nil {
		return err
	}
	seen := make(map[string]bool, len(h.Zones))
	for _, z := range h.Zones {
		// A zone with placeholder numbers is checked as Zone.probe says (and per request as
		// Zone.finishNumbers does); one of literals as it is.
		lz := z.lz
		if len(z.dyn) > 0 {
			lz = z.probe()
		}
		if err := lz.Validate(); err != nil {
			return err
		}
		if err := z.validateAfter(); err != nil {
			return err
		}
		if err := z.validateLease(); err != nil {
			return err
		}
		switch z.FailMode {
		case "", FailOpen, FailClosed, FailLocal:
		default:
			return fmt.Errorf("zone %s: fail_mode %q must be open, closed or local", z.Name, z.FailMode)
		}
		switch z.EmptyKey {
		case EmptyKeyShared, EmptyKeySkip, EmptyKeyDeny:
		default:
			return fmt.Errorf("zone %s: empty_key %q must be shared, skip or deny", z.Name, z.EmptyKey)
		}
		if err := checkPrefixes("zone "+z.Name+": ", z.IPv4Prefix, z.IPv6Prefix); err != nil {
			return err
		}
		if z.Jitter != nil {
			if err := checkJitter("zone "+z.Name+": ", *z.Jitter); err != nil {
				return err
			}
		}
		// A quota or max_cost from a placeholder bounds the cost per request (see
		// Zone.finishNumbers), as the Caddyfile parser's checks say.
		if z.fixedCost > lz.Quota() && !z.quotaDynamic(lz.Algorithm) {
			return fmt.Errorf("zone %s: cost %d is larger than the zone's quota %d: no request could ever be admitted", z.Name, z.fixedCost, lz.Quota())
		}
		if z.MaxCost > 0 && z.fixedCost > z.MaxCost && !z.dynamic(numMaxCost) {
			return fmt.Errorf("zone %s: cost %d is larger than max_cost %d: no request could ever be admitted", z.Name, z.fixedCost, z.MaxCost)
		}
		if lz.Algorithm == limiter.SlidingWindow && z.fixedCost == 0 && lz.MaxCost > MaxSlidingWindowCost && !z.dynamic(numMaxCost) {
			return fmt.Errorf("zone %s: max_cost %d: a sliding_window zone stores one entry per unit of cost, so a cost from a placeholder is bounded by max_cost %d at most; use token_bucket for larger costs",
				z.Name, lz.MaxCost, MaxSlidingWindowCost)
		}
		if seen[z.Name] {
			return fmt.Errorf("zone name %q is used twice", z.Name)
		}
		seen[z.Name] = true
	}
	return h.Redis.validate()
}

// checkPrefixes reports an ipv4_prefix or ipv6_prefix out of range (0 stands for the default);
// its error begins with where.
func checkPrefixes(where string, v4, v6 int) error {
	if v4 < 0 || v4 > 32 {
		return fmt.Errorf("%sipv4_prefix %d must be between 1 and 32", where, v4)
	}
	if v6 < 0 || v6 > 128 {
		return fmt.Errorf("%sipv6_prefix %d must be between 1 and 128", where, v6)
	}
	return nil
}

// checkJitter reports a jitter that is negative or not a whole number of seconds (Retry-After
// is in seconds); its error begins with where.
func checkJitter(where string, jitter caddy.Duration) error {
	if jitter < 0 || time.Duration(jitter)%time.Second != 0 {
		return fmt.Errorf("%sjitter %v must be a whole number of seconds, >= 0", where, time.Duration(jitter))
	}
	return nil
}

// Errors of key_secret. They never hold the secret, nor any part or length of it.
var (
	errKeySecretShort = fmt.Errorf("key_secret must be at least %d bytes, placeholders replaced: "+
		"use 32 random bytes, such as the output of `openssl rand -base64 32`", limiter.MinKeySecretBytes)
	errKeySecretPlaceholder = errors.New("key_secret holds { } once its placeholders are replaced: only global " +
		"placeholders such as {env.RATE_LIMIT_KEY_SECRET} are replaced when the config loads, and a secret must not hold { }")
)

// resolveKeySecret replaces the global placeholders ({env.*}) in the configured key_secret, as
// for the Redis password, and returns the KeySecret of the result.
func resolveKeySecret(configured string) (*limiter.KeySecret, error) {
	secret := caddy.NewReplacer().ReplaceKnown(configured, "")
	if hasPlaceholder(secret) {
		return nil, errKeySecretPlaceholder
	}
	if len(secret) < limiter.MinKeySecretBytes {
		return nil, errKeySecretShort
	}
	return limiter.NewKeySecret([]byte(secret)), nil
}

// validate reports a connection config that cannot work (see check).
func (cfg *RedisConfig) validate() error {
	_, err := cfg.check()
	return err
}

// check reports a connection config that cannot work, and the subdirective the error is about.
func (cfg *RedisConfig) check() (field string, err error) {
	cluster := cfg.isCluster()
	switch {
	case cfg.Sentinel != "" && cfg.Cluster:
		return "cluster", fmt.Errorf("redis cluster and sentinel exclude each other: with sentinel, the addresses are Sentinels")
	case cfg.Sentinel != "" && len(cfg.Addresses) == 0:
		return "sentinel", fmt.Errorf("redis sentinel %s needs the addresses of its Sentinels (address host:26379 ...)", cfg.Sentinel)
	case cfg.DB < 0:
		return "db", fmt.Errorf("redis db %d must be >= 0", cfg.DB)
	case cluster && cfg.DB != 0:
		return "db", fmt.Errorf("redis db %d: Redis Cluster has only database 0 (more than one address without sentinel means cluster)", cfg.DB)
	case cfg.PoolSize < 0:
		return "pool_size", fmt.Errorf("redis pool_size %d must be >= 0", cfg.PoolSize)
	case cfg.DialTimeout < 0:
		return "dial_timeout", fmt.Errorf("redis dial_timeout must be >= 0")
	case cfg.TLS != nil && (cfg.TLS.Cert == "") != (cfg.TLS.Key == ""):
		return "tls", fmt.Errorf("redis tls: cert and key must be given together")
	}
	return "", nil
}

// checkResolved reports a connection setting that was written with a placeholder that is empty
// once the global placeholders are replaced, as resolve replaces them: `address
// {env.REDIS_ADDR}` with REDIS_ADDR unset would otherwise dial the default address (and
// `{env.REDIS_HOST}:6379` the local host), `password {env.REDIS_PASSWORD}` would connect without
// AUTH, `sentinel {env.MASTER}` would make a plain client. The error names the setting and the
// empty placeholders, never a value (so never a password). A default applies only where
// nothing was written.
func (cfg *RedisConfig) checkResolved() error {
	repl := caddy.NewReplacer()
	check := func(field, written string) error {
		var empty []string
		for _, name := range placeholderNames(written) {
			if repl.ReplaceKnown("{"+name+"}", "") != "" {
				continue
			}
			if v, ok := strings.CutPrefix(name, "env."); ok {
				empty = append(empty, "{"+name+"} (environment variable "+v+" is not set, or empty)")
			} else {
				empty = append(empty, "{"+name+"}")
			}
		}
		if len(empty) == 0 {
			return nil
		}
		words := strings.Fields(field)
		return fmt.Errorf("redis %s %s: empty placeholder %s: set it, or leave out the %s line",
			field, written, strings.Join(empty, ", "), words[len(words)-1])
	}
	for _, a := range cfg.Addresses {
		if strings.TrimSpace(a) == "" {
			return fmt.Errorf("redis address %q is empty: give host:port, or leave out the address line for the default %s", a, DefaultAddress)
		}
		if err := check("address", a); err != nil {
			return err
		}
	}
	fields := [][2]string{{"username", cfg.Username}, {"password", cfg.Password}, {"sentinel", cfg.Sentinel}}
	if t := cfg.TLS; t != nil {
		fields = append(fields, [][2]string{{"tls ca", t.CA}, {"tls cert", t.Cert}, {"tls key", t.Key}, {"tls server_name", t.ServerName}}...)
	}
	for _, f := range fields {
		if err := check(f[0], f[1]); err != nil {
			return err
		}
	}
	return nil
}

// isCluster reports whether cfg is a Redis Cluster: `cluster`, or more than one address
// without `sentinel`.
func (cfg *RedisConfig) isCluster() bool {
	return cfg.Cluster || (cfg.Sentinel == "" && len(cfg.Addresses) > 1)
}

// Cleanup returns the unspent tokens of the handler's lease grants to Redis (within the
// handler's timeout, or a second when that is shorter), and drops this handler's reference to
// the shared Redis client; the last one closes it.
func (h *Handler) Cleanup() error {
	unregister(h)
	if h.stopRefresh != nil {
		close(h.stopRefresh) // the refresher ends once the slots in flight are given back
		h.stopRefresh = nil
	}
	if h.client != nil && h.limiter != nil {
		h.client.resets.Remove(h.limiter)
		ctx, cancel := context.WithTimeout(context.Background(), max(time.Duration(h.Timeout), time.Second))
		_ = h.limiter.ReturnLeases(ctx) // a grant not returned counts as spent after its ttl and 1s
		cancel()
	}
	if h.poolKey == "" {
		return nil
	}
	_, err := clients.Delete(h.poolKey)
	h.poolKey = ""
	return err
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
