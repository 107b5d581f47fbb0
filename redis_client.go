package ratelimitredis

import (
	"encoding/json"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/limiter"
)

// clients holds one Redis client per distinct connection config, shared by every handler using
// that config and kept across config reloads: a reload provisions the new handlers (taking a
// reference) before it cleans up the old ones (dropping theirs), so the client, its pool and its
// open connections live on. The last Cleanup closes it.
var clients = caddy.NewUsagePool()

// Client settings that are not configurable. The handler's `timeout` bounds every decision,
// dial, pool wait, write and read included, through its context deadline
// (ContextTimeoutEnabled); these only back it up.
const (
	backstopIOTimeout = 3 * time.Second // socket read/write and pool wait, should a context carry no deadline
	maxRetries        = 1               // one retry on a fresh connection after EOF or a dial error
)

// pipelines is how many round trips to Redis a client has under way at most: concurrent
// decisions share them, in pipelines (see limiter.Pipeline).
const pipelines = 4

// sharedClient is a Redis client in the clients pool.
type sharedClient struct {
	rdb *redis.Client
	// pipeline carries every decision of the handlers using the client; it lives as long as
	// the client, so a reload never stops it under a request in flight.
	pipeline *limiter.Pipeline
	// breaker is shared by every handler using the client, so all of them stop calling a
	// failing Redis together.
	breaker *gobreaker.CircuitBreaker[limiter.Decision]
	// lastReason is the failureReason of the latest failed call, for the breaker's log.
	lastReason atomic.Value
}

// Destruct stops the pipeline and closes the client and its connections when the last handler
// using it is cleaned up.
func (c *sharedClient) Destruct() error {
	c.pipeline.Close()
	return c.rdb.Close()
}

// resolvedRedis is a RedisConfig with placeholders replaced and defaults applied: what one
// client is made of, and so the key of the clients pool.
type resolvedRedis struct {
	Address     string        `json:"a"`
	Username    string        `json:"u"`
	Password    string        `json:"p"`
	DB          int           `json:"db"`
	PoolSize    int           `json:"ps"`
	DialTimeout time.Duration `json:"dt"`
}

// resolve replaces global placeholders ({env.*} and the like) in cfg and fills in defaults. The
// caller has validated cfg (one address, no Sentinel, Cluster or TLS).
func (cfg *RedisConfig) resolve(dialTimeout time.Duration) resolvedRedis {
	repl := caddy.NewReplacer()
	r := resolvedRedis{
		Address:     DefaultAddress,
		Username:    repl.ReplaceKnown(cfg.Username, ""),
		Password:    repl.ReplaceKnown(cfg.Password, ""),
		DB:          cfg.DB,
		PoolSize:    cfg.PoolSize,
		DialTimeout: time.Duration(cfg.DialTimeout),
	}
	if len(cfg.Addresses) > 0 {
		r.Address = repl.ReplaceKnown(cfg.Addresses[0], "")
	}
	if r.DialTimeout == 0 {
		r.DialTimeout = dialTimeout
	}
	return r
}

// poolKey is the clients pool key of r. It holds the password, but only in memory.
func (r resolvedRedis) poolKey() string {
	b, _ := json.Marshal(r) // a struct of strings and numbers always marshals
	return string(b)
}

// acquireClient returns the shared client for r, creating it when no handler uses one yet. It
// never contacts Redis: connections are dialled when the first decision needs one, so Caddy
// starts and reloads while Redis is down.
func acquireClient(r resolvedRedis) (*sharedClient, string, error) {
	key := r.poolKey()
	v, _, err := clients.LoadOrNew(key, func() (caddy.Destructor, error) {
		c := &sharedClient{rdb: redis.NewClient(&redis.Options{
			Addr:                  r.Address,
			Username:              r.Username,
			Password:              r.Password,
			DB:                    r.DB,
			PoolSize:              r.PoolSize,
			DialTimeout:           r.DialTimeout,
			ReadTimeout:           backstopIOTimeout,
			WriteTimeout:          backstopIOTimeout,
			ContextTimeoutEnabled: true,
			MaxRetries:            maxRetries,
			PoolTimeout:           backstopIOTimeout,
			DisableIdentity:       true, // no CLIENT SETINFO round trip on each new connection
		})}
		c.breaker = newBreaker(r.Address, &c.lastReason)
		c.pipeline = limiter.NewPipeline(c.rdb, pipelines)
		return c, nil
	})
	if err != nil {
		return nil, "", err
	}
	return v.(*sharedClient), key, nil
}
