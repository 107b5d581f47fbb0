package ratelimitredis

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// clients holds one Redis client per distinct connection config, shared by every handler using
// that config and kept across config reloads: a reload provisions the new handlers (taking a
// reference) before it cleans up the old ones (dropping theirs), so the client, its pool and its
// open connections live on. The last Cleanup closes it.
var clients = caddy.NewUsagePool()

// roundTrips is how many round trips to Redis a client (on Redis Cluster, a node) has under way at
// most: concurrent decisions share them, in batches of up to 128 decided by one script call each
// (see limiter.Batcher). One, because Redis runs one script at a time: a second round trip under
// way would only split the waiting decisions into smaller batches, each paying a script call's
// overhead (docs/performance.md has the measurements). A decision that finds no round trip under
// way (Redis idle) is still sent at once; one that finds one waits for it and goes in the next
// batch.
const roundTrips = 1

// sharedClient is a Redis client in the clients pool.
type sharedClient struct {
	// rdb is a *redis.Client (standalone, or Sentinel's failover client) or a
	// *redis.ClusterClient.
	rdb redis.UniversalClient
	// cluster is true when rdb is a Redis Cluster client; cc is then rdb.
	cluster bool
	cc      *redis.ClusterClient
	// addrs are the addresses rdb was made with (placeholders replaced): the seeds, the
	// Sentinels or the one server. They name the client in logs and the admin API.
	addrs []string
	// batcher carries every decision of the handlers using the client (on Redis Cluster, those
	// whose node is not known: see nodes); it lives as long as the client, so a reload never
	// stops it under a request in flight.
	batcher *limiter.Batcher
	// breaker is shared by every handler using the client, so all of them stop calling a
	// failing Redis together. On Redis Cluster it guards only the loading of the cluster's slot
	// map, while that is not known: each node has a breaker of its own (see nodes).
	breaker *breaker
	// breakerOpenFor is how long each of its breakers stays open before a probe.
	breakerOpenFor time.Duration
	// nodes are, on Redis Cluster, the primaries met so far by address, each with its own
	// breaker and batcher, so that a failing or stalled node fails only the decisions of its
	// own slots.
	nodes sync.Map // string -> *redisNode
	// nodesMu serialises the creation of nodes.
	nodesMu sync.Mutex
	// slotMapKnown is set once go-redis has loaded the cluster's slot map: from then on it keeps
	// one (refreshing it in the background), so finding a slot's node never calls Redis.
	slotMapKnown atomic.Bool
	closed       bool // under nodesMu
	// resets delivers the admin resets of every instance to the handlers' deny caches.
	resets *limiter.ResetListener
}

// redisNode is a primary of a Redis Cluster: its circuit breaker, and the batcher of the
// decisions of its slots.
type redisNode struct {
	breaker *breaker
	batcher *limiter.Batcher
}

// Destruct stops the batchers and closes the client and its connections when the last handler
// using it is cleaned up.
func (c *sharedClient) Destruct() error {
	c.batcher.Close()
	_ = c.resets.Close()
	c.nodesMu.Lock()
	c.closed = true
	c.nodesMu.Unlock()
	c.nodes.Range(func(_, v any) bool {
		v.(*redisNode).batcher.Close()
		return true
	})
	return c.rdb.Close()
}

// node returns the Redis Cluster primary that owns key's hash slot, as go-redis's slot map says.
// It calls Redis only while that map has never been loaded.
func (c *sharedClient) node(ctx context.Context, key string) (*redisNode, error) {
	cl, err := c.cc.MasterForKey(ctx, key)
	if err != nil {
		return nil, err
	}
	addr := cl.Options().Addr
	if n, ok := c.nodes.Load(addr); ok {
		return n.(*redisNode), nil
	}
	c.nodesMu.Lock()
	defer c.nodesMu.Unlock()
	if n, ok := c.nodes.Load(addr); ok {
		return n.(*redisNode), nil
	}
	n := &redisNode{breaker: newBreaker(addr, strings.Join(c.addrs, ","), c.breakerOpenFor), batcher: limiter.NewBatcher(c.cc, roundTrips)}
	if c.closed {
		n.batcher.Close()
	}
	c.nodes.Store(addr, n)
	return n, nil
}

// primaries returns the Redis servers that hold the client's keys, to SCAN: on Redis Cluster
// every primary, sorted by address, so that a listing's cursor names the same one on its next
// page while the cluster's primaries stay the same; else the one server (with Sentinel, the
// current primary).
func (c *sharedClient) primaries(ctx context.Context) ([]limiter.Scanner, error) {
	if !c.cluster {
		return []limiter.Scanner{c.rdb}, nil
	}
	var mu sync.Mutex
	var nodes []*redis.Client
	err := c.cc.ForEachMaster(ctx, func(_ context.Context, n *redis.Client) error {
		mu.Lock()
		nodes = append(nodes, n)
		mu.Unlock()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("redis cluster primaries: %w", err)
	}
	if len(nodes) == 0 {
		return nil, errors.New("redis cluster primaries: none known")
	}
	slices.SortFunc(nodes, func(a, b *redis.Client) int { return strings.Compare(a.Options().Addr, b.Options().Addr) })
	out := make([]limiter.Scanner, len(nodes))
	for i, n := range nodes {
		out[i] = n
	}
	return out, nil
}

// batcherFor is the limiter's Options.BatcherFor on Redis Cluster: the batcher of the node
// that owns key's slot (nil, the client's batcher, when it cannot be told).
func (c *sharedClient) batcherFor(ctx context.Context, key string) *limiter.Batcher {
	n, err := c.node(ctx, key)
	if err != nil {
		return nil
	}
	return n.batcher
}

// acquire asks the circuit breakers that guard the decision of reqs for permission to send it,
// and returns the function that reports its outcome to them. Standalone and Sentinel: the
// client's one breaker. Redis Cluster: the breaker of each node that owns a slot of the
// decision — one node, unless the request's zones have different client keys in slots on
// different nodes; then the decision, all-or-nothing, needs every one of them, so it is sent
// only when all their breakers allow it, and its outcome counts for each (the limiter reports a
// failed decision without the node that failed). While the cluster's slot map has never been
// loaded, finding the nodes calls Redis, under the client's breaker.
func (c *sharedClient) acquire(ctx context.Context, prefix string, reqs []limiter.Request) (release func(error), err error) {
	if !c.cluster {
		return c.breaker.allow()
	}
	if !c.slotMapKnown.Load() {
		done, err := c.breaker.allow()
		if err != nil {
			return nil, err
		}
		_, err = c.node(ctx, limiter.StateKey(prefix, reqs[0].Zone, reqs[0].Key))
		done(err)
		if err != nil {
			return nil, fmt.Errorf("redis cluster slot map: %w", err)
		}
		c.slotMapKnown.Store(true)
	}
	var first *redisNode
	var more []*breaker // the breakers of a decision on several nodes
	for i, rq := range reqs {
		if i > 0 && rq.Key == reqs[i-1].Key {
			continue // the same client key: the same slot
		}
		n, err := c.node(ctx, limiter.StateKey(prefix, rq.Zone, rq.Key))
		if err != nil {
			return nil, fmt.Errorf("redis cluster slot map: %w", err)
		}
		switch {
		case first == nil:
			first = n
		case n == first || slices.Contains(more, n.breaker):
		default:
			if more == nil {
				more = []*breaker{first.breaker}
			}
			more = append(more, n.breaker)
		}
	}
	if more == nil {
		return first.breaker.allow()
	}
	return allowAll(more)
}

// acquireClient returns the shared client for r, creating it when no handler uses one yet
// (created is then true). It never contacts Redis: connections are dialled when the first
// decision (or the PING of warnIfUnreachable) needs one, so Caddy starts and reloads while Redis
// is down. Its errors are about the TLS files.
func acquireClient(r resolvedRedis) (c *sharedClient, key string, created bool, err error) {
	key = r.poolKey()
	v, loaded, err := clients.LoadOrNew(key, func() (caddy.Destructor, error) {
		rdb, err := r.newClient()
		if err != nil {
			return nil, err
		}
		c := &sharedClient{rdb: rdb, addrs: r.Addresses, breakerOpenFor: r.BreakerOpenFor}
		c.cc, c.cluster = rdb.(*redis.ClusterClient)
		c.breaker = newBreaker(strings.Join(c.addrs, ","), "", c.breakerOpenFor)
		c.batcher = limiter.NewBatcher(rdb, roundTrips)
		c.resets = limiter.NewResetListener(rdb)
		c.resets.SubscribeFailed = func(channel string, err error) {
			caddy.Log().Named("http.handlers.rate_limit_redis").Warn("reset broadcast: subscribing failed; go-redis subscribes again when it reconnects, "+
				"and until then admin resets reach this instance's deny cache only after deny_cache_max_age",
				zap.Strings("redis", c.addrs), zap.String("channel", channel), zap.Error(err))
		}
		return c, nil
	})
	if err != nil {
		return nil, "", false, err
	}
	return v.(*sharedClient), key, !loaded, nil
}
