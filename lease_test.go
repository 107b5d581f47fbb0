package ratelimitredis

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestLeaseCaddyfile: the lease block adapts to the zone's JSON `lease`, and a lease block
// missing a part, or out of range, is an error naming it.
func TestLeaseCaddyfile(t *testing.T) {
	adapt := func(block string) (string, error) {
		cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(":80 {\n\trate_limit_redis {\n\t\tzone api {\n\t\t\tkey {http.request.header.X-API-Key}\n\t\t\tcapacity 1000\n\t\t\trefill_rate 100\n"+block+"\n\t\t}\n\t}\n}\n"), nil)
		return string(cfg), err
	}
	cfg, err := adapt("lease {\n max 200\n ttl 250ms\n}")
	if err != nil || !strings.Contains(cfg, `"lease":{"max":200,"ttl":250000000}`) {
		t.Fatalf("adapted %s, %v; want the zone's lease", cfg, err)
	}
	for block, want := range map[string]string{
		"lease {\n max 200\n}":              "zone api: lease ttl 0s must be between 10ms and 1m0s",
		"lease {\n max 0\n ttl 1s\n}":       "zone api: lease max 0 must be between 1 and 2^53",
		"lease {\n max 5\n ttl 1ms\n}":      "zone api: lease ttl 1ms must be between 10ms and 1m0s",
		"lease {\n max 5\n ttl 1s\n x 1\n}": `lease: unrecognized subdirective "x"`,
		"lease 5":                           `lease: unexpected argument "5"`,
	} {
		if _, err := adapt(block); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want an error saying %q", block, err, want)
		}
	}
}

// TestLeaseRefusedAtLoad: lease is refused where it cannot hold its bounds: with max_wait,
// count_status or charge, and on the sliding window algorithms.
func TestLeaseRefusedAtLoad(t *testing.T) {
	const lease = `"lease":{"max":10,"ttl":"1s"}`
	for name, tc := range map[string]struct{ zone, want string }{
		"max_wait":       {`"capacity":10,"refill_rate":1,"max_wait":"1s",` + lease, "zone a: lease and max_wait exclude each other"},
		"count_status":   {`"capacity":10,"refill_rate":1,"count_status":["2xx"],` + lease, "zone a: lease excludes count_status and charge"},
		"charge":         {`"capacity":10,"refill_rate":1,"charge":{"source":"header","header":"X-Used"},` + lease, "zone a: lease excludes count_status and charge"},
		"sliding_window": {`"algorithm":"sliding_window","limit":10,"window":"1s",` + lease, "zone a: lease applies to algorithms token_bucket and fixed_window only, not sliding_window"},
		"counter":        {`"algorithm":"sliding_window_counter","limit":10,"window":"1s",` + lease, "zone a: lease applies to algorithms token_bucket and fixed_window only, not sliding_window_counter"},
		"concurrency":    {`"algorithm":"concurrency","limit":10,` + lease, "zone a: lease applies to algorithms token_bucket and fixed_window only, not concurrency"},
		"ttl":            {`"capacity":10,"refill_rate":1,"lease":{"max":10,"ttl":"2m"}`, "zone a: lease ttl 2m0s must be between 10ms and 1m0s"},
	} {
		t.Run(name, func(t *testing.T) { wantLoadError(t, `{"zones":[{"name":"a",`+tc.zone+`}]}`, tc.want) })
	}
}

// TestEndToEndLease: through Caddy, a hot client of a lease zone is admitted exactly its
// capacity, most requests from grants (no Redis call); a reload returns the grants' unspent
// tokens to Redis at once (Cleanup), not after their ttl.
func TestEndToEndLease(t *testing.T) {
	srv := redistest.Start(t)
	site := fmt.Sprintf(`rate_limit_redis {
		redis {
			address %s
		}
		timeout 2s
		zone api {
			key {http.request.header.X-Key}
			capacity 100
			refill_rate 1/1h
			lease {
				max 20
				ttl 1m
			}
		}
	}
	respond "ok"`, srv.Addr)
	cs := caddytest.Start(t, site)
	local := testutil.ToFloat64(metrics.leaseLocal.WithLabelValues("api"))
	grants := testutil.ToFloat64(metrics.leaseGrants.WithLabelValues("api"))
	calls := srv.ScriptCalls()
	if got := cs.Statuses(30, "/", "X-Key", "k"); got != strings.TrimSpace(strings.Repeat("200 ", 30)) {
		t.Fatalf("30 requests under a capacity of 100: %s", got)
	}
	// Most from grants: the first requests show the client's rate, then grants (each renewed
	// before it runs out, and returned once spent) serve the rest, growing with the rate.
	if n := testutil.ToFloat64(metrics.leaseLocal.WithLabelValues("api")) - local; n < 20 {
		t.Fatalf("30 requests of a hot client: %v admitted from grants, want at least 20", n)
	}
	// At most 10 exact decisions (20 or more came from grants), and the grants' asks and
	// returns: how many depends on the rate the client shows, slower on a loaded machine.
	if n := srv.ScriptCalls() - calls; n > 20 {
		t.Fatalf("30 requests of a hot client made %d script calls (decisions, grants and their returns)", n)
	}
	if testutil.ToFloat64(metrics.leaseGrants.WithLabelValues("api")) == grants {
		t.Fatal("no grant")
	}
	key := limiter.StateKey("rl:", &limiter.Zone{Name: "api", Algorithm: limiter.TokenBucket}, "k")
	if srv.Do("HGET", key, "h") == nil {
		t.Fatal("no grant held in Redis")
	}
	cs.Reload(site)                             // the previous config's Cleanup returns its grants
	deadline := time.Now().Add(5 * time.Second) // well inside the grant's ttl of 1m
	for srv.Do("HGET", key, "h") != nil {
		if time.Now().After(deadline) {
			t.Fatalf("a reload left the grants in Redis: %v", srv.Do("HGETALL", key))
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := cs.Statuses(71, "/", "X-Key", "k"); got != strings.TrimSpace(strings.Repeat("200 ", 70))+" 429" {
		t.Fatalf("after the reload: %s, want exactly the 70 left", got)
	}
}

// TestAdminResetDropsLease: an admin reset while a grant is live drops it: the client then gets
// its capacity once, never the rest of a grant from before the reset on top of it.
func TestAdminResetDropsLease(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		timeout 2s
		zone api {
			key {http.request.header.X-Client}
			capacity 50
			refill_rate 1/1h
			lease {
				max 20
				ttl 1m
			}
		}
	}
	respond "ok"`, srv.Addr))
	local := testutil.ToFloat64(metrics.leaseLocal.WithLabelValues("api"))
	if got := ac.Statuses(10, "/", "X-Client", "alice"); got != strings.TrimSpace(strings.Repeat("200 ", 10)) {
		t.Fatalf("before the reset: %s", got)
	}
	if testutil.ToFloat64(metrics.leaseLocal.WithLabelValues("api")) == local {
		t.Fatal("no request admitted from a grant before the reset")
	}
	// A grant in hand: the client's last grant, or its successor once that is answered.
	for deadline := time.Now().Add(5 * time.Second); testutil.ToFloat64(metrics.leaseStranded.WithLabelValues("api")) <= 0; {
		if time.Now().After(deadline) {
			t.Fatal("no grant in hand before the reset")
		}
		time.Sleep(time.Millisecond)
	}
	adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=api&key=alice", 200)
	if got := ac.Statuses(51, "/", "X-Client", "alice"); got != strings.TrimSpace(strings.Repeat("200 ", 50))+" 429" {
		t.Fatalf("after the reset: %s, want exactly the capacity of 50", got)
	}
}
