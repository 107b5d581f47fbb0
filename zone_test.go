package ratelimitredis

// A zone's validation (zone.go), and a fixed window of a calendar period through Caddy.

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestValidateCharging: the JSON config's count_status, charge, hold_max and no_retry_over are
// checked as the Caddyfile's are (Zone.validate, which the parser runs when a zone ends).
func TestValidateCharging(t *testing.T) {
	t.Parallel()
	tbz := Zone{Capacity: NumberOf(10), RefillRate: NumberOf(1)}
	swz := Zone{Algorithm: "sliding_window", Limit: NumberOf(10), Window: NumberOf(time.Minute)}
	fwz := Zone{Algorithm: "fixed_window", Limit: NumberOf(10), Window: NumberOf(time.Minute)}
	scz := Zone{Algorithm: "sliding_window_counter", Limit: NumberOf(10), Window: NumberOf(time.Minute)}
	with := func(z Zone, set func(*Zone)) Zone { set(&z); return z }
	for _, tc := range []struct {
		name string
		z    Zone
		want string
	}{
		{"ok", with(tbz, func(z *Zone) { z.CountStatus, z.Charge = []string{"4xx"}, &Charge{Source: "openai_usage"} }), ""},
		{"bad status", with(tbz, func(z *Zone) { z.CountStatus = []string{"4x"} }), `zone z: count_status: "4x" is not a status code (100 to 599) or a class such as 4xx`},
		{"bad source", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "body"} }), `zone z: charge source "body" must be header, openai_usage, anthropic_usage or gemini_usage`},
		{"header without field", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "header"} }), `zone z: charge header needs a header field name`},
		{"bad usage", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "openai_usage", Usage: "input"} }), `zone z: charge usage "input" must be total, prompt or completion`},
		{"missing", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "openai_usage", Missing: new(int64(0))} }), ""},
		{"missing negative", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "openai_usage", Missing: new(int64(-1))} }), `zone z: charge missing -1 must be between 0 and 9007199254740992`},
		{"missing with header", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "header", Header: "X", Missing: new(int64(1))} }), `zone z: charge usage, weights and missing belong to sources openai_usage, anthropic_usage and gemini_usage`},
		{"scale", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "header", Header: "X", Scale: 1e6} }), ""},
		{"scale negative", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "header", Header: "X", Scale: -1} }), `zone z: charge scale -1 must be greater than 0 and at most 1e+15`},
		{"scale with usage", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "openai_usage", Scale: 10} }), `zone z: charge header and scale belong to source header`},
		{"weights with header", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "header", Header: "X", Weights: &ChargeWeights{}} }), `zone z: charge usage, weights and missing belong to sources openai_usage, anthropic_usage and gemini_usage`},
		{"anthropic", with(tbz, func(z *Zone) {
			z.Charge = &Charge{Source: "anthropic_usage", Usage: "completion", Missing: new(int64(5))}
		}), ""},
		{"weights, defaults", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "anthropic_usage", Weights: &ChargeWeights{}} }), ""},
		{"weights and usage", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "openai_usage", Usage: "total", Weights: &ChargeWeights{}} }), `zone z: charge usage and weights exclude each other: weights charge every count, weighted`},
		{"weight negative", with(tbz, func(z *Zone) {
			z.Charge = &Charge{Source: "openai_usage", Weights: &ChargeWeights{CacheWrite: WeightOf(-1.0)}}
		}), `zone z: charge weight cache_write -1 must be between 0 and 1000000`},
		{"weights all 0", with(tbz, func(z *Zone) {
			z.Charge = &Charge{Source: "openai_usage", Weights: &ChargeWeights{Prompt: WeightOf(0.0), Completion: WeightOf(0.0), Cached: WeightOf(0.0)}}
		}), `zone z: charge weights are all 0: the zone would charge nothing`},
		{"weights, completion only", with(tbz, func(z *Zone) {
			z.Charge = &Charge{Source: "openai_usage", Weights: &ChargeWeights{Prompt: WeightOf(0.0)}}
		}), ""},
		{"no_retry_over negative", with(tbz, func(z *Zone) { z.NoRetryOver = new(caddy.Duration(-time.Second)) }), `zone z: no_retry_over -1s must be > 0, or off`},
		{"no_retry_over off", with(tbz, func(z *Zone) { z.NoRetryOver = new(caddy.Duration(0)) }), ""},
		{"hold_max alone", with(tbz, func(z *Zone) { z.HoldMax = caddy.Duration(time.Minute) }), `zone z: hold_max applies to a zone with count_status or charge, or of algorithm concurrency`},
		{"hold_max too long", with(tbz, func(z *Zone) { z.CountStatus, z.HoldMax = []string{"401"}, caddy.Duration(25*time.Hour) }), `zone z: hold_max 25h0m0s is out of range (at most 1d)`},
		{"sliding window count_status", with(swz, func(z *Zone) { z.CountStatus = []string{"401"} }), ""},
		{"sliding window charge", with(swz, func(z *Zone) { z.Charge = &Charge{Source: "header", Header: "X"} }), `zone z: charge needs algorithm token_bucket, fixed_window or sliding_window_counter: a sliding_window zone stores one entry per unit of cost, so charging it what a response reports (thousands of tokens) would store thousands of entries per request; count_status works with sliding_window`},
		{"fixed window", with(fwz, func(z *Zone) { z.CountStatus, z.Charge = []string{"401"}, &Charge{Source: "header", Header: "X"} }), ""},
		{"sliding window counter", with(scz, func(z *Zone) { z.CountStatus, z.Charge = []string{"401"}, &Charge{Source: "openai_usage"} }), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			z := tc.z
			z.Name = "z"
			err := z.validate()
			if got := fmt.Sprint(err); (tc.want == "") != (err == nil) || (tc.want != "" && got != tc.want) {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
		})
	}
}

// TestEndToEndDailyQuota: a fixed window of 3 per UTC day through Caddy: the headers and the
// 429's Retry-After say the seconds to the next UTC midnight; the admin API shows the count and
// the window, and a reset gives the client its quota back. Its decisions wait for Redis up to
// 5 s, so that the first call, which loads the script, never fails open on a busy machine.
func TestEndToEndDailyQuota(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		timeout 5s
		headers both
		zone daily {
			key {http.request.header.X-API-Key}
			algorithm fixed_window
			limit 3
			period day
		}
	}
	respond "ok"`, srv.Addr))
	toMidnight := func() int {
		now := time.Now().UTC()
		return int(now.Truncate(24*time.Hour).Add(24*time.Hour).Sub(now).Seconds() + 0.999)
	}
	if toMidnight() < 30 {
		time.Sleep(time.Duration(toMidnight()+1) * time.Second) // not across a midnight
	}
	near := func(step, header string, got string, want int) {
		t.Helper()
		if n, err := strconv.Atoi(got); err != nil || n < want-2 || n > want+1 {
			t.Fatalf("%s: %s %q, want %d (±1s): the seconds to the next UTC midnight", step, header, got, want)
		}
	}
	for i := 1; i <= 3; i++ {
		r := ac.Get("/", "X-API-Key", "alice")
		if r.Status != 200 || r.Header.Get("X-RateLimit-Remaining") != strconv.Itoa(3-i) ||
			r.Header.Get("RateLimit-Policy") != `"daily";q=3;w=86400` {
			t.Fatalf("request %d: %d %v", i, r.Status, r.Header)
		}
		near("request "+strconv.Itoa(i), "X-RateLimit-Reset", r.Header.Get("X-RateLimit-Reset"), toMidnight())
	}
	r := ac.Get("/", "X-API-Key", "alice")
	if r.Status != 429 {
		t.Fatalf("4th request: %d, want 429", r.Status)
	}
	near("4th request", "Retry-After", r.Header.Get("Retry-After"), toMidnight())
	st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=daily&key=alice", 200)
	today := time.Now().UTC().Truncate(24 * time.Hour)
	if len(st) != 1 || st[0].Count == nil || *st[0].Count != 3 || st[0].Remaining != 0 || st[0].Algorithm != "fixed_window" ||
		st[0].WindowStart != today.Format(time.RFC3339Nano) || st[0].WindowEnd != today.Add(24*time.Hour).Format(time.RFC3339Nano) {
		t.Fatalf("state: %+v, want count 3 in today's window", st)
	}
	adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=daily&key=alice", 200)
	if r := ac.Get("/", "X-API-Key", "alice"); r.Status != 200 || r.Header.Get("X-RateLimit-Remaining") != "2" {
		t.Fatalf("after the reset: %d %v, want 200 with 2 left", r.Status, r.Header)
	}
}

// TestZoneInherit: a zone's fail_mode, prefix lengths, jitter and no_retry_over in force are its
// own when set (an explicit zero jitter or no_retry_over included), else the handler's, else
// the defaults.
func TestZoneInherit(t *testing.T) {
	d := func(v time.Duration) *caddy.Duration { c := caddy.Duration(v); return &c }
	handler := inherited{failMode: FailClosed, v4: new(24), v6: new(48), jitter: caddy.Duration(3 * time.Second), noRetryOver: d(time.Hour)}
	for _, tc := range []struct {
		name        string
		zone        Zone
		in          inherited
		failMode    string
		v4, v6      int
		jitter      int64
		noRetryOver time.Duration
	}{
		{"defaults", Zone{}, inherited{}, "", DefaultIPv4Prefix, DefaultIPv6Prefix, 0, DefaultNoRetryOver},
		{"the handler's", Zone{}, handler, FailClosed, 24, 48, 3, time.Hour},
		{"the zone's own", Zone{FailMode: FailLocal, IPv4Prefix: new(16), IPv6Prefix: new(56), Jitter: d(0), NoRetryOver: d(0)},
			handler, FailLocal, 16, 56, 0, 0},
	} {
		z := tc.zone
		z.inherit(tc.in)
		if z.failMode != tc.failMode || z.v4 != tc.v4 || z.v6 != tc.v6 || z.jitter != tc.jitter || z.noRetryOver != tc.noRetryOver {
			t.Errorf("%s: fail_mode %q, prefixes %d/%d, jitter %ds, no_retry_over %v; want %q, %d/%d, %ds, %v", tc.name,
				z.failMode, z.v4, z.v6, z.jitter, z.noRetryOver, tc.failMode, tc.v4, tc.v6, tc.jitter, tc.noRetryOver)
		}
	}
}
