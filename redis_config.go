package ratelimitredis

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/caddyserver/caddy/v2"
)

// RedisConfig is how to connect to Redis.
type RedisConfig struct {
	// Redis server addresses as host:port. Placeholders such as {env.REDIS_ADDR} are replaced
	// when the config loads; one that is empty then (an unset variable), or an empty address,
	// is a load error naming it. More than one address (without `sentinel`) means Redis Cluster:
	// they are seeds, the other nodes are discovered. With `sentinel`, they are the Sentinels.
	// Default (only when no address is given): ["127.0.0.1:6379"].
	Addresses []string `json:"addresses,omitempty"`

	// The ACL user name. Placeholders are replaced when the config loads; one that is empty then
	// is a load error, as for every string of the redis block. Default: none, Redis's `default` user.
	Username string `json:"username,omitempty"`

	// The password (of the ACL user, or of `requirepass`). Use a placeholder such as
	// {env.REDIS_PASSWORD} to keep it out of the config; it is replaced when the config loads and
	// never logged. Default: none, no AUTH.
	Password string `json:"password,omitempty"`

	// The database number (standalone and Sentinel only: Redis Cluster has only 0). Default: 0.
	DB int `json:"db,omitempty"`

	// The Sentinel master name: when set, the addresses are Sentinels, which name the current
	// primary; decisions follow a failover with no reload. Exclusive with Cluster.
	// Default: none, no Sentinel.
	Sentinel string `json:"sentinel,omitempty"`

	// Use Redis Cluster even with a single seed address.
	// Default: false, Redis Cluster only with more than one address and no sentinel.
	Cluster bool `json:"cluster,omitempty"`

	// Connect with TLS (to every cluster node, and to the Sentinels as well as the data nodes).
	// The PEM files are read when the config loads. Default: none, plain TCP.
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
	// Default: none, no client certificate.
	Cert string `json:"cert,omitempty"`

	// The PEM private key file of Cert. Required with Cert.
	Key string `json:"key,omitempty"`

	// The server name to verify the certificate against. Default: the host of the address.
	ServerName string `json:"server_name,omitempty"`

	// Skip verifying the server certificate. For testing only. Default: false.
	InsecureSkipVerify bool `json:"insecure_skip_verify,omitempty"`
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
	// The Redis Cluster client re-sends on a loop of its own (maxRedirects), which MaxRetries does
	// not reach: the limiter marks every script call NoRetry, which that loop honours too (see
	// internal/limiter/script.go), so no script call is sent twice on any topology.
	maxRetries = -1
	// maxRedirects is go-redis's default: the Redis Cluster client follows up to 3 MOVED and ASK
	// redirections of one command (resharding, failover). Those re-sends are safe: the reply says
	// Redis did not run the call. Not -1, which would make every redirected decision fail until
	// the slot map is reloaded, and every one during a slot's migration (ASK).
	maxRedirects = 3
	// dialerRetries is 1: go-redis's default of 5 dials 100ms apart outlasts any decision's
	// timeout, and then the decision reports "context deadline exceeded" instead of why the
	// dial failed (a bad certificate, a refused connection).
	dialerRetries = 1
)

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
	// BreakerOpenFor is how long the client's circuit breakers stay open before a probe.
	BreakerOpenFor time.Duration `json:"bo"`
}

// resolve replaces global placeholders ({env.*} and the like) in cfg and fills in defaults: the
// dial timeout dialTimeout when cfg has none. breakerOpenFor is the breakers'. The caller has
// validated cfg.
func (cfg *RedisConfig) resolve(dialTimeout, breakerOpenFor time.Duration) resolvedRedis {
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

		BreakerOpenFor: breakerOpenFor,
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
		MaxRedirects:          maxRedirects, // Redis Cluster only
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

// load returns the crypto/tls config of t, reading its PEM files now; nil for a nil t (no
// TLS). The errors name the file and what is wrong with it.
func (t *TLSConfig) load() (*tls.Config, error) {
	if t == nil {
		return nil, nil
	}
	c := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		ServerName:         t.ServerName,
		InsecureSkipVerify: t.InsecureSkipVerify, //nolint:gosec // the operator asked for it, for testing
	}
	if t.CA != "" {
		pem, err := os.ReadFile(t.CA)
		if err != nil {
			return nil, fmt.Errorf("redis tls ca: %w", err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("redis tls ca %s: no PEM certificate found", t.CA)
		}
	}
	if t.Cert != "" {
		cert, err := tls.LoadX509KeyPair(t.Cert, t.Key)
		if err != nil {
			return nil, fmt.Errorf("redis tls cert %s and key %s: %w", t.Cert, t.Key, err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}
