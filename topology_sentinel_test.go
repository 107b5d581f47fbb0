package ratelimitredis

import (
	"context"
	"errors"
	"math"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestSentinelFailover: a handler on a Sentinel-monitored primary keeps deciding while the
// primary is killed under load: decisions fail (fail_mode closed: 503) until the Sentinels
// promote the replica, then resume on it with no restart or reload. Replication is asynchronous,
// so the failover may lose the last writes the primary acknowledged; the test measures that loss
// from the replica's state and shows the new primary admits exactly what it holds: over-admission
// is exactly the writes the failover lost, never more.
func TestSentinelFailover(t *testing.T) {
	ss := redistest.StartSentinels(t, time.Second)
	const capacity = 400
	h := provisioned(t, &Handler{
		Redis:    &RedisConfig{Addresses: ss.Addrs(), Sentinel: ss.Master},
		FailMode: FailClosed,
		Timeout:  caddy.Duration(200 * time.Millisecond),
		Zones:    []*Zone{{Name: "z", Capacity: NumberOf(capacity), RefillRate: NumberOf(capacity / (limiter.MaxWindow.Seconds() / 2))}},
	})
	// serve's requests carry no client IP: all count under the zone's key for an empty client key.
	key := limiter.StateKey(DefaultKeyPrefix, &h.Zones[0].lz, "")

	var admitted, denied, failed atomic.Int64
	var killed atomic.Bool
	var recoveredAt atomic.Int64 // unix ns of the first decision started after the kill that Redis decided
	const workers = 4
	iterations := make([]atomic.Int64, workers)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				// Only a decision started after the kill tells that the new primary answers: one
				// under way at the kill may have had its reply from the old primary.
				afterKill := killed.Load()
				_, err, next := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
				var he caddyhttp.HandlerError
				switch {
				case err == nil && next:
					admitted.Add(1)
				case errors.As(err, &he) && he.StatusCode == 429:
					denied.Add(1)
				case errors.As(err, &he) && he.StatusCode == 503:
					failed.Add(1)
				default:
					t.Errorf("unexpected outcome: err %v, next %t", err, next)
				}
				if afterKill && (err == nil || he.StatusCode == 429) {
					recoveredAt.CompareAndSwap(0, time.Now().UnixNano())
				}
				iterations[w].Add(1)
			}
		}(w)
	}
	defer func() { close(stop); wg.Wait() }()

	waitFor(t, 10*time.Second, "150 admitted requests", func() bool { return admitted.Load() >= 150 })
	ss.Primary.Stop() // SIGKILL
	killAt := time.Now()
	killed.Store(true)
	// Every worker finishes the decision it had under way at the kill: from then on, admitted
	// counts only what the new primary admits.
	var at [workers]int64
	for w := range at {
		at[w] = iterations[w].Load()
	}
	waitFor(t, 5*time.Second, "the workers to move past the kill", func() bool {
		for w := range at {
			if iterations[w].Load() < at[w]+2 {
				return false
			}
		}
		return true
	})
	admittedByOld := admitted.Load()
	if recoveredAt.Load() != 0 {
		t.Fatal("decisions succeeded before the Sentinels could promote the replica")
	}
	tokens, err := ss.Replica.Client().HGet(context.Background(), key, "t").Float64()
	if err != nil {
		t.Fatalf("reading the bucket %s on the replica: %v (keys: %v)", key, err, ss.Replica.Do("KEYS", "*"))
	}
	onReplica := int64(math.Floor(tokens + 1e-9)) // what the new primary will have to give

	waitFor(t, 30*time.Second, "decisions to resume and the bucket to run out", func() bool {
		return recoveredAt.Load() != 0 && denied.Load() >= 10
	})
	close(stop)
	wg.Wait()
	stop = make(chan struct{})

	recovery := time.Duration(recoveredAt.Load() - killAt.UnixNano())
	lost := admittedByOld - (capacity - onReplica) // acknowledged by the old primary, never replicated
	t.Logf("Sentinel failover: decisions resumed %.2fs after the primary was killed (down-after-milliseconds 1000); "+
		"%d admitted before the kill; lost by asynchronous replication: %d (negative: charges whose replies the kill cut off); %d failed (503) meanwhile",
		recovery.Seconds(), admittedByOld, lost, failed.Load())
	if after := admitted.Load() - admittedByOld; after != onReplica {
		t.Fatalf("the new primary admitted %d, want exactly the %d tokens it held", after, onReplica)
	}
	if over := admitted.Load() - capacity; over != lost {
		t.Fatalf("over-admission %d, want exactly the %d writes the failover lost", over, lost)
	}
	if role := ss.Replica.Do("ROLE").([]any)[0]; role != "master" {
		t.Fatalf("the replica's role is %v after the failover, want master", role)
	}
}
