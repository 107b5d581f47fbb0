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
	"strings"
	"time"
	_ "time/tzdata" // time_zone works where the system has no time zone database (scratch images)

	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
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
	// DefaultNoRetryOver is the wait above which a 429 tells clients not to retry it
	// (X-Should-Retry: false) by default: a minute, past which an SDK that sleeps Retry-After
	// out before retrying (the OpenAI and Anthropic SDKs) would hang its caller.
	DefaultNoRetryOver = time.Minute
)

// Values of Handler.FailMode.
const (
	FailOpen   = "open"
	FailClosed = "closed"
	FailLocal  = "local"
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
	// Default: false.
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
	// access logs that choose to. Default: false.
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
	// Default: none, client keys are not keyed digests.
	KeySecret string `json:"key_secret,omitempty"`

	// The prefix length, 1 to 32, to which every zone masks a key candidate that is an IPv4
	// address (an IPv4-mapped IPv6 address counts as IPv4): the client key is then the network,
	// such as 203.0.113.0/24, and every address in it shares one client's quota. A zone's own
	// ipv4_prefix overrides it. Default: 32, each address on its own (the key is the address).
	IPv4Prefix *int `json:"ipv4_prefix,omitempty"`

	// The prefix length, 1 to 128, to which every zone masks a key candidate that is an IPv6
	// address: the client key is then the network, such as 2001:db8::/64. A zone's own
	// ipv6_prefix overrides it. 128 keys each address on its own. Default: 64, because an IPv6
	// client usually holds a whole /64 and can rotate through its addresses.
	IPv6Prefix *int `json:"ipv6_prefix,omitempty"`

	// The most a 429's Retry-After is randomly lengthened by, so that clients denied together do
	// not all come back at the same instant: a whole number of seconds (JSON: nanoseconds or a
	// duration string such as "5s"), drawn uniformly from 0 to it per denial and added to the
	// exact Retry-After, which it never shortens. The deny cache keeps the exact time, so jitter
	// never admits a request early. A zone's own jitter overrides it. Default: 0, none.
	Jitter caddy.Duration `json:"jitter,omitempty"`

	// A 429 whose Retry-After is longer than this (a duration; JSON: nanoseconds or a duration
	// string), or whose wait cannot end (a cost above the quota), also carries
	// `X-Should-Retry: false`, which the OpenAI and Anthropic SDKs (and others generated like
	// them) obey: they fail the call at once instead of sleeping through Retry-After and
	// retrying. Shorter waits keep the plain 429, which those SDKs wait out and retry. The wait
	// compared is the Retry-After sent, jitter included. 0 turns it off (`no_retry_over off` or
	// `no_retry_over 0` in the Caddyfile). A zone's own no_retry_over overrides it. gRPC calls
	// are answered as before. Default: 1m.
	NoRetryOver *caddy.Duration `json:"no_retry_over,omitempty"`

	// The most requests this handler holds at once for their zones' `max_wait` (shaping). A
	// request that would have to wait while as many are held (or about to be) is decided as
	// without max_wait: admitted if a zone admits it now, else 429, charging nothing. No client
	// key of a zone (a literal key aside) holds more than a tenth of them, rounded up: so that one
	// client cannot take them all (docs/shaping.md). Each held request keeps its connection and
	// goroutine. At least 1. Default: 1000 when a zone has a max_wait.
	MaxWaiting *int `json:"max_waiting,omitempty"`

	// The zones, checked in the order given. A request must pass every zone that applies to it;
	// if any zone denies, no zone is charged. At least one zone is required.
	Zones []*Zone `json:"zones,omitempty"`

	// An endpoint at which a client reads its own quota in every zone that applies to it,
	// without spending it, limited by a zone of its own (see QuotaEndpoint). Not with dry_run.
	// Default: none.
	QuotaEndpoint *QuotaEndpoint `json:"quota_endpoint,omitempty"`

	limiter *limiter.Limiter
	local   *limiter.Local // when a zone's fail_mode is local
	// quota answers the requests of QuotaEndpoint, nil without one; requestZones are the zones
	// that limit every other request: all of Zones but the endpoint's (quota.go).
	quota        *quotaEndpoint
	requestZones []*Zone
	// stopRefresh, closed by Cleanup, stops the refresher of concurrency slots (concurrency.go).
	stopRefresh chan struct{}
	keySecret   *limiter.KeySecret // key_secret resolved; nil without it
	// degradedHeader: X-RateLimit-Degraded is sent (headers on, degraded_header not off).
	degradedHeader bool
	client         *sharedClient
	events         *events // nil without an events app in the config
	// bareDenials: the server has no handle_errors routes, so a denial is written as a bare 429
	// by the handler instead of going through Caddy's error path: the same response, cheaper
	// (docs/performance.md).
	bareDenials bool
	// grpcStatus: refused gRPC calls get a gRPC status (grpc_status not off; grpc.go).
	grpcStatus bool
	poolKey    string // the key of this handler's reference in clients; "" when it holds none
	logger     *zap.Logger
	// configDone is the done channel of the Caddy context h was provisioned in: the same for
	// every handler of one config (warnSharedZones).
	configDone <-chan struct{}
	// waiting holds the places of the requests held for a max_wait, and of those being decided
	// that may be: never more than MaxWaiting, nor more than a client's share (waiting.go).
	waiting *waitingRoom
	// live is the registry of handlers the admin API reads (admin.go): the process's, unless
	// a test gives its own.
	live *registry

	// Settings that tests change before Provision; 0 is the default.
	localKeys      int              // the client buckets fail_mode local keeps per zone: limiter.DefaultLocalKeys
	breakerOpenFor time.Duration    // how long a circuit breaker stays open: defaultBreakerOpenFor
	now            func() time.Time // the Go side's clock (limiter.Options.Clock): time.Now when nil
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
// Redis client for the connection config. It never waits for Redis: when it creates the client,
// it PINGs Redis in the background and logs one warning if there is no answer
// (warnIfUnreachable).
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
	in := inherited{failMode: h.FailMode, v4: h.IPv4Prefix, v6: h.IPv6Prefix, jitter: h.Jitter, noRetryOver: h.NoRetryOver}
	for i, z := range h.Zones {
		z.tag = i
		if err := z.provision(ctx, h.logger, in); err != nil {
			return err
		}
		if z.lz.MaxWait > 0 && h.MaxWaiting == nil {
			h.MaxWaiting = new(DefaultMaxWaiting)
		}
		needLocal = needLocal || z.failMode == FailLocal
	}
	h.waiting = newWaitingRoom(deref(h.MaxWaiting))
	h.quota, h.requestZones = newQuotaEndpoint(h)
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
	client, key, created, err := acquireClient(h.Redis.resolve(time.Duration(h.Timeout), cmp.Or(h.breakerOpenFor, defaultBreakerOpenFor)))
	if err != nil {
		return fmt.Errorf("redis client: %w", err)
	}
	h.client, h.poolKey = client, key
	if created {
		go warnIfUnreachable(ctx, h.logger, client.rdb, client.addrs, max(time.Duration(h.Timeout), loadPingTimeout), failModesOf(h))
	}
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok {
		h.bareDenials = srv.Errors == nil || len(srv.Errors.Routes) == 0
	}
	if needLocal {
		h.local = limiter.NewLocal(cmp.Or(h.localKeys, limiter.DefaultLocalKeys))
	}
	h.limiter = limiter.New(client.rdb, h.limiterOptions(client))
	client.resets.Add(h.limiter)
	h.startRefresher()
	h.events = newEvents(ctx, client.addrs)
	if h.live == nil {
		h.live = handlers
	}
	h.configDone = ctx.Done()
	h.live.add(h) // for the admin API
	h.live.warnSharedZones(h, h.configDone)
	return nil
}

// limiterOptions returns the options of the handler's limiter, which decides through client.
func (h *Handler) limiterOptions(client *sharedClient) limiter.Options {
	opts := limiter.Options{KeyPrefix: h.KeyPrefix}
	if h.DenyCache == nil || *h.DenyCache {
		opts.DenyCacheKeys = limiter.DefaultDenyCacheKeys
		opts.DenyCacheMaxAge = time.Duration(h.DenyCacheMaxAge)
	}
	// A decision in Redis asks the circuit breakers of the Redis servers it needs
	// (sharedClient.acquire), and fails once the handler's timeout has passed.
	opts.Gate = func(ctx context.Context, reqs []limiter.Request) (func(error), error) {
		return client.acquire(ctx, h.KeyPrefix, reqs)
	}
	opts.Timeout = time.Duration(h.Timeout)
	opts.ObserveCall = func(took time.Duration) { metrics.redisDuration.Observe(took.Seconds()) }
	opts.Batcher = client.batcher
	opts.Cluster = client.cluster
	if client.cluster {
		opts.BatcherFor = client.batcherFor
	}
	if h.Clock == ClockLocal {
		opts.Now = time.Now
	}
	opts.Clock = h.now
	if slices.ContainsFunc(h.Zones, func(z *Zone) bool { return z.lz.Queues() }) {
		opts.Subscriber = client.rdb // a queue's grants reach its waiters at once
	}
	// A grant's renewal and return share decisions' round trips; a Redis Cluster release follows
	// a decision that failed.
	opts.CallTimeout = time.Duration(h.Timeout)
	if slices.ContainsFunc(h.Zones, func(z *Zone) bool { return z.Lease != nil }) {
		opts.Leases, opts.LeaseMetrics = true, newPromLease(h.Zones)
	}
	return opts
}

// Validate checks the provisioned configuration: the handler's options and each zone, with the
// rules the Caddyfile parser applies (validateOptions, Zone.validate). Its errors name the field
// at fault.
func (h *Handler) Validate() error {
	if len(h.Zones) == 0 {
		return errors.New("at least one zone is required")
	}
	if err := h.validateOptions(); err != nil {
		return err
	}
	seen := make(map[string]bool, len(h.Zones))
	for _, z := range h.Zones {
		if err := z.validate(); err != nil {
			return err
		}
		if seen[z.Name] {
			return errZoneNameTwice(z.Name)
		}
		seen[z.Name] = true
	}
	if err := h.checkQuotaEndpoint(); err != nil {
		return err
	}
	return h.Redis.validate()
}

// errZoneNameTwice is the error of a second zone named name.
func errZoneNameTwice(name string) error {
	return fmt.Errorf("zone name %q is used twice", name)
}

// validateOptions checks the handler's options as configured, before Provision (the Caddyfile
// parser, once the block ends) or after (Validate): an empty one is its default. Its error is a
// *limiter.FieldError naming the option at fault.
func (h *Handler) validateOptions() *limiter.FieldError {
	opt := func(field, format string, args ...any) *limiter.FieldError {
		return &limiter.FieldError{Field: field, Msg: fmt.Sprintf(format, args...)}
	}
	switch {
	case strings.ContainsAny(h.KeyPrefix, "{}"):
		return opt("key_prefix", "key_prefix %q must not contain { or }: the client key is the Redis Cluster hash tag", h.KeyPrefix)
	case h.Timeout < 0:
		return opt("timeout", "timeout must be > 0")
	case h.DenyCacheMaxAge < 0:
		return opt("deny_cache", "deny_cache_max_age must be > 0")
	case h.MaxWaiting != nil && *h.MaxWaiting < 1:
		return opt("max_waiting", "max_waiting %d must be >= 1", *h.MaxWaiting)
	case !slices.Contains([]string{"", FailOpen, FailClosed, FailLocal}, h.FailMode):
		return opt("fail_mode", "fail_mode %q must be open, closed or local", h.FailMode)
	case !slices.Contains([]string{"", HeadersLegacy, HeadersIETF, HeadersBoth, HeadersOff}, h.Headers):
		return opt("headers", "headers %q must be legacy, ietf, both or off", h.Headers)
	case !slices.Contains([]string{"", ClockRedis, ClockLocal}, h.Clock):
		return opt("clock", "clock %q must be redis or local", h.Clock)
	}
	if err := checkPrefixes(h.IPv4Prefix, h.IPv6Prefix); err != nil {
		return err
	}
	if err := checkNoRetryOver(h.NoRetryOver); err != nil {
		return err
	}
	return checkJitter(h.Jitter)
}

// checkNoRetryOver reports a no_retry_over that is negative, of the handler (a zone's sets the
// error's Zone).
func checkNoRetryOver(d *caddy.Duration) *limiter.FieldError {
	if d != nil && *d < 0 {
		return &limiter.FieldError{Field: "no_retry_over", Msg: fmt.Sprintf("no_retry_over %v must be > 0, or off", time.Duration(*d))}
	}
	return nil
}

// checkPrefixes reports an ipv4_prefix or ipv6_prefix out of range (nil is the default), of the
// handler (a zone's sets the error's Zone).
func checkPrefixes(v4, v6 *int) *limiter.FieldError {
	if v4 != nil && (*v4 < 1 || *v4 > 32) {
		return &limiter.FieldError{Field: "ipv4_prefix", Msg: fmt.Sprintf("ipv4_prefix %d must be between 1 and 32", *v4)}
	}
	if v6 != nil && (*v6 < 1 || *v6 > 128) {
		return &limiter.FieldError{Field: "ipv6_prefix", Msg: fmt.Sprintf("ipv6_prefix %d must be between 1 and 128", *v6)}
	}
	return nil
}

// checkJitter reports a jitter that is negative or not a whole number of seconds (Retry-After
// is in seconds), of the handler (a zone's sets the error's Zone).
func checkJitter(jitter caddy.Duration) *limiter.FieldError {
	if jitter < 0 || time.Duration(jitter)%time.Second != 0 {
		return &limiter.FieldError{Field: "jitter", Msg: fmt.Sprintf("jitter %v must be a whole number of seconds, >= 0", time.Duration(jitter))}
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

// Cleanup returns the unspent tokens of the handler's lease grants to Redis (within the
// handler's timeout, or a second when that is shorter), and drops this handler's reference to
// the shared Redis client; the last one closes it.
func (h *Handler) Cleanup() error {
	if h.live != nil {
		h.live.remove(h)
	}
	if h.stopRefresh != nil {
		close(h.stopRefresh) // the refresher ends once the slots in flight are given back
		h.stopRefresh = nil
	}
	if h.client != nil && h.limiter != nil {
		h.client.resets.Remove(h.limiter)
		ctx, cancel := context.WithTimeout(context.Background(), max(time.Duration(h.Timeout), time.Second))
		if err := h.limiter.ReturnLeases(ctx); err != nil {
			h.logger.Warn("rate limit lease grants not returned to redis: their unspent tokens count as spent until their ttl and 1s have passed",
				zap.Error(err))
		}
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

// clock returns the Go side's time now: h.now (a test's fake clock), else time.Now.
func (h *Handler) clock() time.Time {
	if h.now != nil {
		return h.now()
	}
	return time.Now()
}
