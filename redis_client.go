package ratelimitredis

import (
	"encoding/json"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
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
	// maxRetries is -1: go-redis never sends a command again. A script whose connection dropped
	// after Redis ran it, before its reply was read, would otherwise run twice: a decision
	// charged twice (a sliding window's first request denied by its own entry), a settle applied
	// twice. The failed call applies fail_mode once instead. Stale pooled connections (a Redis
	// restart) are found by go-redis's health check when taken from the pool, not by a retry.
	maxRetries = -1
	// dialerRetries is 1: go-redis's default of 5 dials 100ms apart outlasts any decision's
	// timeout, and then the decision reports "context deadline exceeded" instead of why the
	// dial failed (a bad certificate, a refused connection).
	dialerRetries = 1
)

// pipelines is how many round trips to Redis a client has under way at most: concurrent
// decisions share them, in pipelines (see limiter.Pipeline).
const pipelines = 4

// sharedClient is a Redis client in the clients pool.
type sharedClient struct {
	// rdb is a *redis.Client (standalone, or Sentinel's failover client) or a
	// *redis.ClusterClient.
	rdb redis.UniversalClient
	// cluster is true when rdb is a Redis Cluster client.
	cluster bool
	// addrs are the addresses rdb was made with (placeholders replaced): the seeds, the
	// Sentinels or the one server. They name the client in logs and the admin API.
	addrs []string
	// pipeline carries every decision of the handlers using the client; it lives as long as
	// the client, so a reload never stops it under a request in flight.
	pipeline *limiter.Pipeline
	// breaker is shared by every handler using the client, so all of them stop calling a
	// failing Redis together.
	breaker *gobreaker.CircuitBreaker[limiter.Decision]
	// lastErr is the error of the latest failed call, for the breaker's log.
	lastErr atomic.Pointer[error]
	// resets delivers the admin resets of every instance to the handlers' deny caches.
	resets *limiter.ResetListener
}

// Destruct stops the pipeline and closes the client and its connections when the last handler
// using it is cleaned up.
func (c *sharedClient) Destruct() error {
	c.pipeline.Close()
	_ = c.resets.Close()
	return c.rdb.Close()
}

// resolvedRedis is a RedisConfig with placeholders replaced and defaults applied: what one
// client is made of, and so the key of the clients pool.
type resolvedRedis struct {
	Addresses   []string      `json:"a"`
	Username    string        `json:"u"`
	Password    string        `json:"p"`
	DB          int           `json:"db"`
	Sentinel    string        `json:"s"`
	Cluster     bool          `json:"c"`
	TLS         *TLSConfig    `json:"t"`
	TLSFiles    string        `json:"tf"` // the TLS files' modification times: new files, new client
	PoolSize    int           `json:"ps"`
	DialTimeout time.Duration `json:"dt"`
}

// resolve replaces global placeholders ({env.*} and the like) in cfg and fills in defaults. The
// caller has validated cfg.
func (cfg *RedisConfig) resolve(dialTimeout time.Duration) resolvedRedis {
	repl := caddy.NewReplacer()
	r := resolvedRedis{
		Addresses:   []string{DefaultAddress},
		Username:    repl.ReplaceKnown(cfg.Username, ""),
		Password:    repl.ReplaceKnown(cfg.Password, ""),
		DB:          cfg.DB,
		Sentinel:    repl.ReplaceKnown(cfg.Sentinel, ""),
		Cluster:     cfg.isCluster(),
		PoolSize:    cfg.PoolSize,
		DialTimeout: time.Duration(cfg.DialTimeout),
	}
	if len(cfg.Addresses) > 0 {
		r.Addresses = make([]string, len(cfg.Addresses))
		for i, a := range cfg.Addresses {
			r.Addresses[i] = repl.ReplaceKnown(a, "")
		}
	}
	if cfg.TLS != nil {
		t := *cfg.TLS
		t.CA = repl.ReplaceKnown(t.CA, "")
		t.Cert = repl.ReplaceKnown(t.Cert, "")
		t.Key = repl.ReplaceKnown(t.Key, "")
		t.ServerName = repl.ReplaceKnown(t.ServerName, "")
		r.TLS = &t
		for _, f := range []string{t.CA, t.Cert, t.Key} {
			if fi, err := os.Stat(f); err == nil {
				r.TLSFiles += fi.ModTime().UTC().Format(time.RFC3339Nano) + " "
			}
		}
	}
	if r.DialTimeout == 0 {
		r.DialTimeout = dialTimeout
	}
	return r
}

// poolKey is the clients pool key of r. It holds the password, but only in memory.
func (r resolvedRedis) poolKey() string {
	b, _ := json.Marshal(r) // a struct of strings, numbers and bools always marshals
	return string(b)
}

// acquireClient returns the shared client for r, creating it when no handler uses one yet. It
// never contacts Redis: connections are dialled when the first decision needs one, so Caddy
// starts and reloads while Redis is down. Its errors are about the TLS files.
func acquireClient(r resolvedRedis) (*sharedClient, string, error) {
	key := r.poolKey()
	v, _, err := clients.LoadOrNew(key, func() (caddy.Destructor, error) {
		rdb, err := r.newClient()
		if err != nil {
			return nil, err
		}
		c := &sharedClient{rdb: rdb, cluster: r.Cluster, addrs: r.Addresses}
		c.breaker = newBreaker(strings.Join(c.addrs, ","), &c.lastErr)
		c.pipeline = limiter.NewPipeline(rdb, pipelines)
		c.resets = limiter.NewResetListener(rdb)
		return c, nil
	})
	if err != nil {
		return nil, "", err
	}
	return v.(*sharedClient), key, nil
}

// newClient returns the go-redis client of r, through redis.NewUniversalClient: a Sentinel
// failover client when r.Sentinel is set, a cluster client when r.Cluster, else a plain one.
func (r resolvedRedis) newClient() (redis.UniversalClient, error) {
	opts, err := r.options()
	if err != nil {
		return nil, err
	}
	return redis.NewUniversalClient(opts), nil
}

// options returns the go-redis options of r. Its errors are about the TLS files.
func (r resolvedRedis) options() (*redis.UniversalOptions, error) {
	tlsConfig, err := r.TLS.load()
	if err != nil {
		return nil, err
	}
	return &redis.UniversalOptions{
		Addrs:                 r.Addresses,
		MasterName:            r.Sentinel,
		IsClusterMode:         r.Cluster,
		Username:              r.Username,
		Password:              r.Password,
		DB:                    r.DB,
		PoolSize:              r.PoolSize,
		DialTimeout:           r.DialTimeout,
		ReadTimeout:           backstopIOTimeout,
		WriteTimeout:          backstopIOTimeout,
		ContextTimeoutEnabled: true,
		MaxRetries:            maxRetries,
		DialerRetries:         dialerRetries,
		PoolTimeout:           backstopIOTimeout,
		DisableIdentity:       true, // no CLIENT SETINFO round trip on each new connection
		TLSConfig:             tlsConfig,
		// Ignored by the Sentinel failover client, which has no maintenance notifications.
		MaintNotificationsConfig: noMaintNotifications(),
	}, nil
}

// noMaintNotifications turns off go-redis's maintenance notifications (a Redis Enterprise and
// Redis Cloud feature). Their default, "auto", resolves the address's host name when the client
// is created — a Caddy load would wait up to 2s per client on a slow DNS — and sends one more
// command on every new connection.
func noMaintNotifications() *maintnotifications.Config {
	return &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
}
