package ratelimitredis

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// matchSets is the Zone.MatcherSetsRaw of one matcher set, given as matcher name, JSON pairs.
func matchSets(nameJSON ...string) caddyhttp.RawMatcherSets {
	set := make(caddy.ModuleMap)
	for i := 0; i < len(nameJSON); i += 2 {
		set[nameJSON[i]] = json.RawMessage(nameJSON[i+1])
	}
	return caddyhttp.RawMatcherSets{set}
}

func TestUnmarshalCaddyfile(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		input string
		want  *Handler
	}{
		{
			name: "design example",
			input: `rate_limit_redis {
				redis {
					address {env.REDIS_ADDR}
				}
				zone api {
					key {http.request.header.X-API-Key} {client_ip}
					capacity 100
					refill_rate 10
				}
				zone login {
					match path /login
					key {client_ip}
					algorithm sliding_window
					limit 5
					window 1m
				}
			}`,
			want: &Handler{
				Redis: &RedisConfig{Addresses: []string{"{env.REDIS_ADDR}"}},
				Zones: []*Zone{
					{Name: "api", Key: []string{"{http.request.header.X-API-Key}", "{client_ip}"}, Capacity: NumberOf(100), RefillRate: NumberOf(10)},
					{
						Name: "login", Key: []string{"{client_ip}"}, Algorithm: "sliding_window", Limit: NumberOf(5),
						Window: NumberOf(caddy.Duration(time.Minute)), MatcherSetsRaw: matchSets("path", `["/login"]`),
					},
				},
			},
		},
		{
			name: "every top-level and redis subdirective",
			input: `rate_limit_redis {
				redis {
					address      redis.internal:6380
					username     limiter
					password     "{env.REDIS_PASSWORD}"
					db           3
					pool_size    20
					dial_timeout 250ms
				}
				key_prefix myapp:rl:
				timeout    50ms
				fail_mode  closed
				headers    ietf
				clock      local
				dry_run
				deny_cache off
				log_key
				zone z {
					capacity    5
					refill_rate 1
				}
			}`,
			want: &Handler{
				Redis: &RedisConfig{
					Addresses: []string{"redis.internal:6380"}, Username: "limiter", Password: "{env.REDIS_PASSWORD}",
					DB: 3, PoolSize: 20, DialTimeout: caddy.Duration(250 * time.Millisecond),
				},
				KeyPrefix: "myapp:rl:",
				Timeout:   caddy.Duration(50 * time.Millisecond),
				FailMode:  "closed",
				Headers:   "ietf",
				Clock:     "local",
				DryRun:    true,
				DenyCache: new(false),
				LogKey:    true,
				Zones:     []*Zone{{Name: "z", Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
			},
		},
		{
			name: "key_secret literal, quoted",
			input: `rate_limit_redis {
				key_secret "sixteen bytes ok"
				zone z {
					key {http.request.header.X-API-Key} {client_ip}
					capacity    5
					refill_rate 1
				}
			}`,
			want: &Handler{
				KeySecret: "sixteen bytes ok",
				Zones:     []*Zone{{Name: "z", Key: []string{"{http.request.header.X-API-Key}", "{client_ip}"}, Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
			},
		},
		{
			name: "key_secret placeholder",
			input: `rate_limit_redis {
				key_secret {env.RATE_LIMIT_KEY_SECRET}
				capacity    5
				refill_rate 1
			}`,
			want: &Handler{
				KeySecret: "{env.RATE_LIMIT_KEY_SECRET}",
				Zones:     []*Zone{{Name: "default", Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
			},
		},
		{
			name: "the other values of the enumerations",
			input: `rate_limit_redis {
				fail_mode  open
				headers    both
				clock      redis
				deny_cache on
				zone z {
					capacity    5
					refill_rate 1
				}
			}`,
			want: &Handler{
				FailMode: "open", Headers: "both", Clock: "redis", DenyCache: new(true),
				Zones: []*Zone{{Name: "z", Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
			},
		},
		{
			name: "headers legacy, headers off and an empty redis block",
			input: `rate_limit_redis {
				redis
				headers legacy
				zone a {
					capacity    5
					refill_rate 1
				}
			}`,
			want: &Handler{Redis: &RedisConfig{}, Headers: "legacy", Zones: []*Zone{{Name: "a", Capacity: NumberOf(5), RefillRate: NumberOf(1)}}},
		},
		{
			name: "cluster from several addresses, with tls",
			input: `rate_limit_redis {
				redis {
					address n1:6379 n2:6379
					address n3:6379
					tls {
						ca          /etc/redis/ca.pem
						cert        /etc/redis/client.pem
						key         /etc/redis/client.key
						server_name redis.internal
					}
				}
				zone z {
					capacity    5
					refill_rate 1
				}
			}`,
			want: &Handler{
				Redis: &RedisConfig{Addresses: []string{"n1:6379", "n2:6379", "n3:6379"}, TLS: &TLSConfig{
					CA: "/etc/redis/ca.pem", Cert: "/etc/redis/client.pem", Key: "/etc/redis/client.key", ServerName: "redis.internal",
				}},
				Zones: []*Zone{{Name: "z", Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
			},
		},
		{
			name: "cluster with one seed",
			input: `rate_limit_redis {
				redis {
					address seed:6379
					cluster
				}
				zone z {
					capacity    5
					refill_rate 1
				}
			}`,
			want: &Handler{
				Redis: &RedisConfig{Addresses: []string{"seed:6379"}, Cluster: true},
				Zones: []*Zone{{Name: "z", Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
			},
		},
		{
			name: "sentinel, with a db and a tls block of one flag",
			input: `rate_limit_redis {
				redis {
					address s1:26379 s2:26379 s3:26379
					sentinel mymaster
					db 2
					tls {
						insecure_skip_verify
					}
				}
				zone z {
					capacity    5
					refill_rate 1
				}
			}`,
			want: &Handler{
				Redis: &RedisConfig{
					Addresses: []string{"s1:26379", "s2:26379", "s3:26379"}, Sentinel: "mymaster", DB: 2,
					TLS: &TLSConfig{InsecureSkipVerify: true},
				},
				Zones: []*Zone{{Name: "z", Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
			},
		},
		{
			name: "shorthand token bucket",
			input: `rate_limit_redis {
				key         {http.request.header.X-API-Key} {client_ip}
				capacity    100
				refill_rate 100/1m
				cost        {http.request.header.X-Cost}
			}`,
			want: &Handler{Zones: []*Zone{{
				Name: DefaultZoneName, Key: []string{"{http.request.header.X-API-Key}", "{client_ip}"},
				Capacity: NumberOf(100), RefillRate: NumberOf(100.0 / 60), Cost: "{http.request.header.X-Cost}",
			}}},
		},
		{
			name: "shorthand sliding window with a match block, after handler subdirectives",
			input: `rate_limit_redis {
				timeout 1s
				match {
					path   /api/*
					method POST
				}
				algorithm sliding_window
				limit     10
				window    1d
				dry_run
			}`,
			want: &Handler{
				Timeout: caddy.Duration(time.Second),
				DryRun:  true,
				Zones: []*Zone{{
					Name: DefaultZoneName, Algorithm: "sliding_window", Limit: NumberOf(10), Window: NumberOf(caddy.Duration(24 * time.Hour)),
					MatcherSetsRaw: matchSets("path", `["/api/*"]`, "method", `["POST"]`),
				}},
			},
		},
		{
			name: "refill rates, literal costs and an explicit token_bucket",
			input: `rate_limit_redis {
				zone a {
					algorithm   token_bucket
					capacity    10
					refill_rate 100/1m
					cost        05
				}
				zone b {
					capacity    1
					refill_rate 0.5
				}
				zone c {
					capacity    9007199254740992
					refill_rate 1e12/1s
					cost        9007199254740992
				}
				zone d.e-f_9 {
					capacity    10
					refill_rate 3/1.5s
				}
			}`,
			want: &Handler{Zones: []*Zone{
				{Name: "a", Algorithm: "token_bucket", Capacity: NumberOf(10), RefillRate: NumberOf(100.0 / 60), Cost: "5"},
				{Name: "b", Capacity: NumberOf(1), RefillRate: NumberOf(0.5)},
				{Name: "c", Capacity: NumberOf(1 << 53), RefillRate: NumberOf(1e12), Cost: "9007199254740992"},
				{Name: "d.e-f_9", Capacity: NumberOf(10), RefillRate: NumberOf(2)},
			}},
		},
		{
			name: "sliding window bounds and match not",
			input: `rate_limit_redis {
				zone a {
					algorithm sliding_window
					limit     1000000
					window    366d
					cost      1000000
					match not path /health
				}
				zone b {
					algorithm sliding_window
					limit     1
					window    1ms
				}
			}`,
			want: &Handler{Zones: []*Zone{
				{
					Name: "a", Algorithm: "sliding_window", Limit: NumberOf(1_000_000), Window: NumberOf(caddy.Duration(366 * 24 * time.Hour)),
					Cost: "1000000", MatcherSetsRaw: matchSets("not", `[{"path":["/health"]}]`),
				},
				{Name: "b", Algorithm: "sliding_window", Limit: NumberOf(1), Window: NumberOf(caddy.Duration(time.Millisecond))},
			}},
		},
		{
			name: "degraded_header, a zone's fail_mode and empty_key",
			input: `rate_limit_redis {
				fail_mode       open
				degraded_header off
				grpc_status     off
				zone login {
					match path /login
					key       {http.request.header.X-User}
					empty_key deny
					fail_mode closed
					algorithm sliding_window
					limit     5
					window    1m
				}
				zone api {
					key         {http.request.header.X-API-Key}
					empty_key   skip
					fail_mode   local
					capacity    100
					refill_rate 10
				}
				zone anon {
					key         {http.request.header.X-API-Key}
					empty_key   shared
					fail_mode   open
					capacity    10
					refill_rate 1
				}
			}`,
			want: &Handler{
				FailMode: "open", DegradedHeader: new(false), GRPCStatus: new(false),
				Zones: []*Zone{
					{
						Name: "login", Key: []string{"{http.request.header.X-User}"}, EmptyKey: "deny", FailMode: "closed",
						Algorithm: "sliding_window", Limit: NumberOf(5), Window: NumberOf(caddy.Duration(time.Minute)), MatcherSetsRaw: matchSets("path", `["/login"]`),
					},
					{Name: "api", Key: []string{"{http.request.header.X-API-Key}"}, EmptyKey: "skip", FailMode: "local", Capacity: NumberOf(100), RefillRate: NumberOf(10)},
					{Name: "anon", Key: []string{"{http.request.header.X-API-Key}"}, EmptyKey: "shared", FailMode: "open", Capacity: NumberOf(10), RefillRate: NumberOf(1)},
				},
			},
		},
		{
			name: "degraded_header on, and empty_key in the shorthand",
			input: `rate_limit_redis {
				degraded_header on
				grpc_status on
				fail_mode closed
				key       {http.request.header.X-API-Key}
				empty_key deny
				capacity  5
				refill_rate 1
			}`,
			want: &Handler{
				DegradedHeader: new(true), GRPCStatus: new(true), FailMode: "closed",
				Zones: []*Zone{{Name: DefaultZoneName, Key: []string{"{http.request.header.X-API-Key}"}, EmptyKey: "deny", Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
			},
		},
		{
			name: "shaping: max_wait in a zone and the shorthand, max_waiting",
			input: `rate_limit_redis {
				max_waiting 50
				zone api {
					capacity    10
					refill_rate 10
					max_wait    2s
				}
				zone login {
					algorithm token_bucket
					capacity    5
					refill_rate 1/1m
					max_wait    1m
				}
			}`,
			want: &Handler{MaxWaiting: new(50), Zones: []*Zone{
				{Name: "api", Capacity: NumberOf(10), RefillRate: NumberOf(10), MaxWait: new(caddy.Duration(2 * time.Second))},
				{Name: "login", Algorithm: "token_bucket", Capacity: NumberOf(5), RefillRate: NumberOf(1.0 / 60), MaxWait: new(caddy.Duration(time.Minute))},
			}},
		},
		{
			name: "shaping in the shorthand",
			input: `rate_limit_redis {
				capacity    10
				refill_rate 10
				max_wait    250ms
			}`,
			want: &Handler{Zones: []*Zone{{Name: DefaultZoneName, Capacity: NumberOf(10), RefillRate: NumberOf(10), MaxWait: new(caddy.Duration(250 * time.Millisecond))}}},
		},
		{
			name: "a matcher written twice in a match block is one matcher",
			input: `rate_limit_redis {
				zone a {
					match {
						path /a
						path /b
					}
					capacity    1
					refill_rate 1
				}
			}`,
			want: &Handler{Zones: []*Zone{
				{Name: "a", Capacity: NumberOf(1), RefillRate: NumberOf(1), MatcherSetsRaw: matchSets("path", `["/a","/b"]`)},
			}},
		},

		{
			name: "near_limit as a percentage and as a fraction",
			input: `rate_limit_redis {
				zone a {
					capacity    10
					refill_rate 1
					near_limit  80%
				}
				zone b {
					capacity    10
					refill_rate 1
					near_limit  0.95
				}
			}`,
			want: &Handler{Zones: []*Zone{
				{Name: "a", Capacity: NumberOf(10), RefillRate: NumberOf(1), NearLimit: 0.8},
				{Name: "b", Capacity: NumberOf(10), RefillRate: NumberOf(1), NearLimit: 0.95},
			}},
		},

		// ipv4_prefix, ipv6_prefix and jitter, at the top level (every zone) and in a zone block
		// (that zone)
		{
			name: "top level and zone overrides",
			input: `rate_limit_redis {
				ipv4_prefix 24
				ipv6_prefix 56
				jitter      5s
				zone a {
					capacity    5
					refill_rate 1
				}
				zone b {
					ipv4_prefix 32
					ipv6_prefix 128
					jitter      0
					capacity    5
					refill_rate 1
				}
			}`,
			want: &Handler{
				IPv4Prefix: new(24), IPv6Prefix: new(56), Jitter: caddy.Duration(5 * time.Second),
				Zones: []*Zone{
					{Name: "a", Capacity: NumberOf(5), RefillRate: NumberOf(1)},
					{Name: "b", Capacity: NumberOf(5), RefillRate: NumberOf(1), IPv4Prefix: new(32), IPv6Prefix: new(128), Jitter: new(caddy.Duration(0))},
				},
			},
		},
		{
			name: "with the shorthand, they are the handler's",
			input: `rate_limit_redis {
				capacity    5
				ipv6_prefix 48
				refill_rate 1
				jitter      1m
			}`,
			want: &Handler{
				IPv6Prefix: new(48), Jitter: caddy.Duration(time.Minute),
				Zones: []*Zone{{Name: "default", Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
			},
		},
		{
			name: "the bounds",
			input: `rate_limit_redis {
				ipv4_prefix 1
				ipv6_prefix 1
				zone a {
					ipv4_prefix 32
					ipv6_prefix 128
					jitter 1s
					algorithm sliding_window
					limit 1
					window 1s
				}
			}`,
			want: &Handler{
				IPv4Prefix: new(1), IPv6Prefix: new(1),
				Zones: []*Zone{{
					Name: "a", Algorithm: "sliding_window", Limit: NumberOf(1), Window: NumberOf(caddy.Duration(time.Second)),
					IPv4Prefix: new(32), IPv6Prefix: new(128), Jitter: new(caddy.Duration(time.Second)),
				}},
			},
		},

		// count_status, charge and hold_max
		{"count_status", "rate_limit_redis {\n\tzone login {\n\t\talgorithm sliding_window\n\t\tlimit 5\n\t\twindow 15m\n\t\tcount_status 401 403 5xx\n\t}\n}",
			&Handler{Zones: []*Zone{{Name: "login", Algorithm: "sliding_window", Limit: NumberOf(5), Window: NumberOf(caddy.Duration(15 * time.Minute)), CountStatus: []string{"401", "403", "5xx"}}}}},
		{"charge header", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1000/1h\n\tcost 100\n\tcharge header X-Tokens-Used\n\thold_max 30m\n}",
			&Handler{Zones: []*Zone{{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1000.0 / 3600), Cost: "100", Charge: &Charge{Source: "header", Header: "X-Tokens-Used"}, HoldMax: caddy.Duration(30 * time.Minute)}}}},
		{"charge openai_usage", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge openai_usage\n}",
			&Handler{Zones: []*Zone{{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "openai_usage"}}}}},
		{"cap_output with every option", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge openai_usage\n\tcap_output min_output 8 unreadable pass insert_max_tokens default_output 100\n}",
			&Handler{Zones: []*Zone{{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "openai_usage"}, CapOutput: &CapOutput{MinOutput: new(int64(8)), DefaultOutput: 100, Unreadable: UnreadablePass, InsertMaxTokens: true}}}}},
		{"charge openai_usage completion with count_status", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge openai_usage completion\n\tcount_status 2xx\n}",
			&Handler{Zones: []*Zone{{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "openai_usage", Usage: "completion"}, CountStatus: []string{"2xx"}}}}},
		{"charge openai_usage missing", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge openai_usage missing 0\n}",
			&Handler{Zones: []*Zone{{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "openai_usage", Missing: new(int64(0))}}}}},
		{"charge openai_usage prompt missing", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge openai_usage prompt missing 800\n}",
			&Handler{Zones: []*Zone{{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "openai_usage", Usage: "prompt", Missing: new(int64(800))}}}}},
		{"count_status fixed_window", "rate_limit_redis {\n\tzone z {\n\t\talgorithm fixed_window\n\t\tlimit 10\n\t\tperiod day\n\t\tcount_status 401\n\t}\n}",
			&Handler{Zones: []*Zone{{Name: "z", Algorithm: "fixed_window", Limit: NumberOf(10), Period: "day", CountStatus: []string{"401"}}}}},
		{"charge fixed_window", "rate_limit_redis {\n\tzone z {\n\t\talgorithm fixed_window\n\t\tlimit 100000\n\t\twindow 1d\n\t\tcost 100\n\t\tcharge openai_usage\n\t}\n}",
			&Handler{Zones: []*Zone{{Name: "z", Algorithm: "fixed_window", Limit: NumberOf(100000), Window: NumberOf(caddy.Duration(24 * time.Hour)), Cost: "100", Charge: &Charge{Source: "openai_usage"}}}}},
		{"charge sliding_window_counter", "rate_limit_redis {\n\tzone z {\n\t\talgorithm sliding_window_counter\n\t\tlimit 10\n\t\twindow 1m\n\t\tcharge header X\n\t\tcount_status 2xx\n\t}\n}",
			&Handler{Zones: []*Zone{{Name: "z", Algorithm: "sliding_window_counter", Limit: NumberOf(10), Window: NumberOf(caddy.Duration(time.Minute)), Charge: &Charge{Source: "header", Header: "X"}, CountStatus: []string{"2xx"}}}}},
		{"charge header scale", "rate_limit_redis {\n\tcapacity 5000000\n\trefill_rate 5000000/1d\n\tcharge header x-litellm-response-cost scale 1000000\n}",
			&Handler{Zones: []*Zone{{Name: "default", Capacity: NumberOf(5000000), RefillRate: NumberOf(5000000.0 / 86400), Charge: &Charge{Source: "header", Header: "x-litellm-response-cost", Scale: 1e6}}}}},
		{"charge openai_usage weights", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge openai_usage weights prompt 1 completion 4 cached 0.1\n}",
			&Handler{Zones: []*Zone{{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "openai_usage", Weights: &ChargeWeights{Prompt: WeightOf(1.0), Completion: WeightOf(4.0), Cached: WeightOf(0.1)}}}}}},
		{"charge anthropic_usage weights missing", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge anthropic_usage weights cache_write 3.75 completion 15 missing 900\n}",
			&Handler{Zones: []*Zone{{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "anthropic_usage", Weights: &ChargeWeights{Completion: WeightOf(15.0), CacheWrite: WeightOf(3.75)}, Missing: new(int64(900))}}}}},
		{"charge anthropic_usage prompt", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge anthropic_usage prompt\n}",
			&Handler{Zones: []*Zone{{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "anthropic_usage", Usage: "prompt"}}}}},
		{"no_retry_over", "rate_limit_redis {\n\tno_retry_over 10m\n\tzone a {\n\t\tno_retry_over off\n\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n\tzone b {\n\t\tno_retry_over 30s\n\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n}",
			&Handler{NoRetryOver: new(caddy.Duration(10 * time.Minute)), Zones: []*Zone{
				{Name: "a", Capacity: NumberOf(1), RefillRate: NumberOf(1), NoRetryOver: new(caddy.Duration(0))},
				{Name: "b", Capacity: NumberOf(1), RefillRate: NumberOf(1), NoRetryOver: new(caddy.Duration(30 * time.Second))}}}},
		{"no_retry_over off with the shorthand", "rate_limit_redis {\n\tcapacity 1\n\tno_retry_over off\n\trefill_rate 1\n}",
			&Handler{NoRetryOver: new(caddy.Duration(0)), Zones: []*Zone{{Name: "default", Capacity: NumberOf(1), RefillRate: NumberOf(1)}}}},
		{"no_retry_over 0 is off, as in JSON", "rate_limit_redis {\n\tno_retry_over 0\n\tzone a {\n\t\tno_retry_over 0s\n\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n}",
			&Handler{NoRetryOver: new(caddy.Duration(0)), Zones: []*Zone{{Name: "a", Capacity: NumberOf(1), RefillRate: NumberOf(1), NoRetryOver: new(caddy.Duration(0))}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got Handler
			if err := got.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input)); err != nil {
				t.Fatalf("UnmarshalCaddyfile: %v", err)
			}
			if !reflect.DeepEqual(&got, tc.want) {
				t.Errorf("got\n%s\nwant\n%s", toJSON(t, &got), toJSON(t, tc.want))
			}
		})
	}
}

func toJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestUnmarshalCaddyfileMinimalJSON checks that the parser fills in no defaults: the JSON of a
// handler holds what its Caddyfile says and nothing more (a zone's jitter 0 included: it
// overrides the handler's).
func TestUnmarshalCaddyfileMinimalJSON(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, input, want string }{
		{"a zone", `rate_limit_redis {
		zone login {
			match path /login
			algorithm sliding_window
			limit 5
			window 1m
		}
	}`, `{"zones":[{"name":"login","algorithm":"sliding_window","limit":5,"window":60000000000,"match":[{"path":["/login"]}]}]}`},
		{"prefixes and jitter", "rate_limit_redis {\n\tipv6_prefix 56\n\tjitter 3s\n\tzone a {\n\t\tjitter 0\n\t\tipv4_prefix 24\n\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n}",
			`{"ipv6_prefix":56,"jitter":3000000000,"zones":[{"name":"a","capacity":1,"refill_rate":1,"ipv4_prefix":24,"jitter":0}]}`},
		{"no_retry_over off, weights and scale", "rate_limit_redis {\n\tno_retry_over off\n\tzone a {\n\t\tno_retry_over 2m\n\t\tcapacity 1000\n\t\trefill_rate 1\n\t\tcharge anthropic_usage weights prompt 3 completion 15 cached 0.3 cache_write 3.75\n\t}\n\tzone b {\n\t\tcapacity 1000\n\t\trefill_rate 1\n\t\tcharge header x-litellm-response-cost scale 1e6\n\t}\n}",
			`{"no_retry_over":0,"zones":[{"name":"a","capacity":1000,"refill_rate":1,"no_retry_over":120000000000,"charge":{"source":"anthropic_usage","weights":{"prompt":3,"completion":15,"cached":0.3,"cache_write":3.75}}},{"name":"b","capacity":1000,"refill_rate":1,"charge":{"source":"header","header":"x-litellm-response-cost","scale":1000000}}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h Handler
			if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input)); err != nil {
				t.Fatal(err)
			}
			b, err := json.Marshal(&h)
			if err != nil {
				t.Fatal(err)
			}
			if string(b) != tc.want {
				t.Errorf("got  %s\nwant %s", b, tc.want)
			}
		})
	}
}

// TestOptionRangeSameFromCaddyfileAndJSON: a value out of range of max_waiting, ipv4_prefix,
// ipv6_prefix, no_retry_over (the handler's or a zone's) or max_wait, an explicit 0 included, gets
// the same error from the Caddyfile (at the option's line) as from a JSON config when it loads.
func TestOptionRangeSameFromCaddyfileAndJSON(t *testing.T) {
	const zoneJSON = `"name":"a","capacity":1,"refill_rate":1`
	for _, tc := range []struct {
		name, option, value string
		inZone              bool   // the zone's option, else the handler's
		jsonValue           string // the value in JSON
		want                string
	}{
		{"max_waiting 0", "max_waiting", "0", false, "0", "max_waiting 0 must be >= 1"},
		{"max_waiting negative", "max_waiting", "-1", false, "-1", "max_waiting -1 must be >= 1"},
		{"ipv4_prefix 0", "ipv4_prefix", "0", false, "0", "ipv4_prefix 0 must be between 1 and 32"},
		{"ipv4_prefix above 32", "ipv4_prefix", "33", false, "33", "ipv4_prefix 33 must be between 1 and 32"},
		{"ipv6_prefix 0", "ipv6_prefix", "0", false, "0", "ipv6_prefix 0 must be between 1 and 128"},
		{"ipv6_prefix negative", "ipv6_prefix", "-1", false, "-1", "ipv6_prefix -1 must be between 1 and 128"},
		{"zone ipv4_prefix 0", "ipv4_prefix", "0", true, "0", "zone a: ipv4_prefix 0 must be between 1 and 32"},
		{"zone ipv6_prefix 0", "ipv6_prefix", "0", true, "0", "zone a: ipv6_prefix 0 must be between 1 and 128"},
		{"zone ipv6_prefix above 128", "ipv6_prefix", "129", true, "129", "zone a: ipv6_prefix 129 must be between 1 and 128"},
		{"no_retry_over negative", "no_retry_over", "-1m", false, `"-1m"`, "no_retry_over -1m0s must be > 0, or off"},
		{"zone no_retry_over negative", "no_retry_over", "-1s", true, `"-1s"`, "zone a: no_retry_over -1s must be > 0, or off"},
		{"zone max_wait 0", "max_wait", "0s", true, "0", "zone a: max_wait 0s must be > 0 (leave max_wait out to reject at once)"},
		{"zone max_wait negative", "max_wait", "-2s", true, `"-2s"`, "zone a: max_wait -2s must be > 0 (leave max_wait out to reject at once)"},
		{"zone near_limit above 1", "near_limit", "1.5", true, "1.5", "zone a: near_limit 1.5 must be above 0 and at most 1: a fraction of the quota (0.8, or 80%)"},
		{"zone near_limit 120%", "near_limit", "120%", true, "1.2", "zone a: near_limit 1.2 must be above 0 and at most 1: a fraction of the quota (0.8, or 80%)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			option := tc.option + " " + tc.value
			field := fmt.Sprintf(`"%s":%s`, tc.option, tc.jsonValue)
			caddyfileText := "rate_limit_redis {\n\t" + option + "\n\tzone a {\n\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n}"
			wantAt := tc.want + ", at Testfile:2"
			handlerJSON := `{` + field + `,"zones":[{` + zoneJSON + `}]}`
			if tc.inZone {
				caddyfileText = "rate_limit_redis {\n\tzone a {\n\t\t" + option + "\n\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n}"
				wantAt = tc.want + ", at Testfile:3"
				handlerJSON = `{"zones":[{` + zoneJSON + `,` + field + `}]}`
			}
			var h Handler
			if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(caddyfileText)); err == nil || err.Error() != wantAt {
				t.Errorf("Caddyfile error %v, want %q", err, wantAt)
			}
			if err := loadHandlerJSON(t, handlerJSON); err == nil || !strings.HasSuffix(err.Error(), ": "+tc.want) {
				t.Errorf("JSON error %v, want one ending %q", err, ": "+tc.want)
			}
		})
	}
}

// TestUnmarshalCaddyfileErrors: every Caddyfile the parser refuses gets its error exactly, at the
// token's file and line: the rows below, and those that every subdirective's syntax gives alike
// (subdirectiveRows).
func TestUnmarshalCaddyfileErrors(t *testing.T) {
	t.Parallel()
	// zone is a zone block that is valid on its own, for inputs whose error lies elsewhere.
	const zone = `
		zone z {
			capacity 1
			refill_rate 1
		}`
	// tb is a token bucket zone's first lines, for the rows of count_status, charge and hold_max.
	const tb = "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 1\n"
	// inZone is a zone block holding lines, and a valid zone's numbers.
	inZone := func(lines string) string {
		return "rate_limit_redis {\n\tzone a {\n" + lines + "\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n}"
	}
	table := []errorRow{
		// The directive line and the zones.
		{"argument", "rate_limit_redis foo {" + zone + "\n}",
			`rate_limit_redis: unexpected argument "foo"; it takes only a matcher and a block, at Testfile:1`},
		{"no block", "rate_limit_redis",
			`rate_limit_redis: at least one zone is required: a zone block, or zone subdirectives (such as capacity and refill_rate) directly in this block, at Testfile:1`},
		{"no zone", "rate_limit_redis {\n\ttimeout 1s\n}",
			`rate_limit_redis: at least one zone is required: a zone block, or zone subdirectives (such as capacity and refill_rate) directly in this block, at Testfile:1`},
		{"unknown subdirective", "rate_limit_redis {\n\tfoo bar\n}",
			`unrecognized subdirective "foo", at Testfile:2`},

		// key_prefix
		{"key_prefix braces", "rate_limit_redis {\n\tkey_prefix rl{x}:\n}",
			`key_prefix "rl{x}:" must not contain { or }: the client key is the Redis Cluster hash tag, at Testfile:2`},
		{"key_prefix brace", "rate_limit_redis {\n\tkey_prefix rl}\n}",
			`key_prefix "rl}" must not contain { or }: the client key is the Redis Cluster hash tag, at Testfile:2`},
		{"key_prefix empty", "rate_limit_redis {\n\tkey_prefix \"\"\n}",
			`key_prefix: must not be empty (leave it out for the default "rl:"), at Testfile:2`},

		// key_secret: no error shows the secret, or a piece of it.
		{"key_secret extra is not echoed", "rate_limit_redis {\n\tkey_secret 0123456789abcdef-part1 part2-0123456789abcdef\n}",
			`key_secret: too many arguments (quote a secret that contains spaces), at Testfile:2`},
		{"key_secret short literal is not echoed", "rate_limit_redis {\n\tkey_secret short-secret-15\n}",
			"key_secret: must be at least 16 bytes: use 32 random bytes, such as the output of `openssl rand -base64 32`, " +
				"from the environment: key_secret {env.RATE_LIMIT_KEY_SECRET}, at Testfile:2"},

		// timeout
		{"timeout not a duration", "rate_limit_redis {\n\ttimeout soon\n}",
			`timeout: "soon" is not a duration, at Testfile:2`},
		{"timeout zero", "rate_limit_redis {\n\ttimeout 0s\n}",
			`timeout: "0s" must be > 0, at Testfile:2`},
		{"timeout negative", "rate_limit_redis {\n\ttimeout -1s\n}",
			`timeout: "-1s" must be > 0, at Testfile:2`},

		// fail_mode
		{"fail_mode bad", "rate_limit_redis {\n\tfail_mode maybe\n}",
			`fail_mode "maybe" must be open, closed or local, at Testfile:2`},

		// headers
		{"headers bad", "rate_limit_redis {\n\theaders draft\n}",
			`headers "draft" must be legacy, ietf, both or off, at Testfile:2`},

		// clock
		{"clock bad", "rate_limit_redis {\n\tclock ntp\n}",
			`clock "ntp" must be redis or local, at Testfile:2`},

		// dry_run
		{"dry_run argument", "rate_limit_redis {\n\tdry_run yes\n}",
			`dry_run: unexpected argument "yes"; it takes no arguments, at Testfile:2`},

		// near_limit
		{"near_limit not a number", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 1\n\t\trefill_rate 1\n\t\tnear_limit most\n\t}\n}",
			`near_limit: "most" is not a fraction (0.8) or a percentage (80%), at Testfile:5`},
		{"near_limit 0", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 1\n\t\trefill_rate 1\n\t\tnear_limit 0%\n\t}\n}",
			`near_limit: "0%" must be above 0 (leave near_limit out for none), at Testfile:5`},
		{"near_limit NaN", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 1\n\t\trefill_rate 1\n\t\tnear_limit NaN\n\t}\n}",
			`near_limit: "NaN" is not a fraction (0.8) or a percentage (80%), at Testfile:5`},
		{"near_limit with lease", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 1\n\t\trefill_rate 1\n\t\tnear_limit 80%\n\t\tlease {\n\t\t\tmax 5\n\t\t\tttl 1s\n\t\t}\n\t}\n}",
			`zone a: near_limit excludes lease: a grant is spent in process, where the request that crosses the threshold is not seen, at Testfile:5`},

		// log_key
		{"log_key argument", "rate_limit_redis {\n\tlog_key on\n}",
			`log_key: unexpected argument "on"; it takes no arguments, at Testfile:2`},
		{"log_key in a zone", "rate_limit_redis {\n\tzone a {\n\t\tlog_key\n\t}\n}",
			`unrecognized subdirective "log_key", at Testfile:3`},

		// deny_cache
		{"deny_cache bad", "rate_limit_redis {\n\tdeny_cache false\n}",
			`deny_cache: "false" must be on or off, at Testfile:2`},
		{"deny_cache max_age bad", "rate_limit_redis {\n\tdeny_cache {\n\t\tmax_age soon\n\t}\n}",
			`max_age: "soon" is not a duration, at Testfile:3`},
		{"deny_cache max_age zero", "rate_limit_redis {\n\tdeny_cache {\n\t\tmax_age 0s\n\t}\n}",
			`max_age: "0s" must be > 0, at Testfile:3`},
		{"deny_cache unknown", "rate_limit_redis {\n\tdeny_cache {\n\t\tsize 10\n\t}\n}",
			`deny_cache: unrecognized subdirective "size", at Testfile:3`},
		{"period unknown", "rate_limit_redis {\n\talgorithm fixed_window\n\tlimit 5\n\tperiod fortnight\n}",
			`zone default: period "fortnight" must be hour, day, week or month, at Testfile:4`},
		{"period and window", "rate_limit_redis {\n\talgorithm fixed_window\n\tlimit 5\n\twindow 1h\n\tperiod day\n}",
			`zone default: a fixed_window zone has a window or a period, not both, at Testfile:5`},
		{"fixed_window without window", "rate_limit_redis {\n\talgorithm fixed_window\n\tlimit 5\n}",
			`zone default: window or period is required for algorithm fixed_window, at Testfile:2`},
		{"time_zone unknown", "rate_limit_redis {\n\talgorithm fixed_window\n\tlimit 5\n\tperiod day\n\ttime_zone Mars/Olympus\n}",
			`zone default: time_zone "Mars/Olympus" is not a time zone of the IANA database (such as UTC or Europe/Paris), at Testfile:5`},
		{"time_zone without period", "rate_limit_redis {\n\talgorithm fixed_window\n\tlimit 5\n\twindow 1h\n\ttime_zone UTC\n}",
			`zone default: time_zone applies to a period (period day), not to a window, at Testfile:5`},
		{"period on sliding_window", "rate_limit_redis {\n\talgorithm sliding_window\n\tlimit 5\n\twindow 1h\n\tperiod day\n}",
			`zone default: period belongs to algorithm fixed_window, not sliding_window, at Testfile:5`},
		{"period on token_bucket", "rate_limit_redis {\n\tcapacity 5\n\trefill_rate 1\n\tperiod day\n}",
			`zone default: period belongs to algorithm fixed_window, not token_bucket (the default when no algorithm is given), at Testfile:4`},
		{"counter without window", "rate_limit_redis {\n\talgorithm sliding_window_counter\n\tlimit 5\n}",
			`zone default: window is required for algorithm sliding_window_counter, at Testfile:2`},
		{"capacity on fixed_window", "rate_limit_redis {\n\talgorithm fixed_window\n\tlimit 5\n\tperiod day\n\tcapacity 5\n}",
			`zone default: capacity belongs to algorithm token_bucket, not fixed_window, at Testfile:5`},
		{"max_cost above capacity", "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 1\n\tmax_cost 11\n}",
			`zone default: max_cost 11 is larger than capacity 10, at Testfile:4`},
		{"cost above max_cost", "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 1\n\tcost 5\n\tmax_cost 4\n}",
			`zone default: cost 5 is larger than max_cost 4: no request could ever be admitted, at Testfile:4`},
		{"max_cost sliding window placeholder", "rate_limit_redis {\n\talgorithm sliding_window\n\tlimit 5000\n\twindow 1h\n\tcost {http.request.header.X-Cost}\n\tmax_cost 2000\n}",
			`zone default: max_cost 2000: a sliding_window zone stores one entry per unit of cost, so a cost from a placeholder (chosen per request) is bounded by max_cost 1000 at most; use token_bucket for larger costs, at Testfile:6`},
		{"max_cost zero", "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 1\n\tmax_cost 0\n}",
			`zone default: max_cost: "0" is out of range (1 to 9007199254740992), at Testfile:4`},

		// max_wait and max_waiting (shaping)
		{"max_wait missing", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 10\n\t\trefill_rate 10\n\t\tmax_wait\n\t}\n}",
			`wrong argument count or unexpected line ending after 'max_wait', at Testfile:5`},
		{"max_wait extra", "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 10\n\tmax_wait 1s 2s\n}",
			`max_wait: unexpected argument "2s", at Testfile:4`},
		{"max_wait repeated", "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 10\n\tmax_wait 1s\n\tmax_wait 2s\n}",
			`duplicate subdirective "max_wait", at Testfile:5`},
		{"max_wait not a duration", "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 10\n\tmax_wait soon\n}",
			`max_wait: "soon" is not a duration, at Testfile:4`},
		{"max_wait zero", "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 10\n\tmax_wait 0s\n}",
			`zone default: max_wait 0s must be > 0 (leave max_wait out to reject at once), at Testfile:4`},
		{"max_wait negative", "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 10\n\tmax_wait -1s\n}",
			`zone default: max_wait -1s must be > 0 (leave max_wait out to reject at once), at Testfile:4`},
		{"max_wait too long", "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 10\n\tmax_wait 61s\n}",
			`zone default: max_wait 1m1s is longer than 1m0s: a request held that long outlasts most clients' timeouts; let it come back instead (429 and Retry-After), at Testfile:4`},
		{"max_wait block", "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 10\n\tmax_wait 1s {\n\t}\n}",
			`max_wait: unexpected block, at Testfile:4`},
		{"max_wait in a sliding window zone", "rate_limit_redis {\n\tzone a {\n\t\talgorithm sliding_window\n\t\tlimit 5\n\t\twindow 1m\n\t\tmax_wait 1s\n\t}\n}",
			`zone a: max_wait applies to algorithm token_bucket only, not sliding_window: a window gives its quota back in steps, so a held request would have no exact turn; shape with a token_bucket zone, at Testfile:6`},
		{"max_wait in a fixed window zone", "rate_limit_redis {\n\tzone a {\n\t\tmax_wait 1s\n\t\talgorithm fixed_window\n\t\tlimit 5\n\t\tperiod day\n\t}\n}",
			`zone a: max_wait applies to algorithm token_bucket only, not fixed_window: a window gives its quota back in steps, so a held request would have no exact turn; shape with a token_bucket zone, at Testfile:3`},
		{"max_wait in a sliding window counter zone", "rate_limit_redis {\n\talgorithm sliding_window_counter\n\tlimit 5\n\twindow 1m\n\tmax_wait 1s\n}",
			`zone default: max_wait applies to algorithm token_bucket only, not sliding_window_counter: a window gives its quota back in steps, so a held request would have no exact turn; shape with a token_bucket zone, at Testfile:5`},
		{"max_waiting missing", "rate_limit_redis {\n\tmax_waiting\n" + zone[1:] + "\n}",
			`wrong argument count or unexpected line ending after 'max_waiting', at Testfile:2`},
		{"max_waiting zero", "rate_limit_redis {\n\tmax_waiting 0\n}",
			`max_waiting 0 must be >= 1, at Testfile:2`},
		{"max_waiting not an integer", "rate_limit_redis {\n\tmax_waiting many\n}",
			`max_waiting: "many" is not an integer, at Testfile:2`},
		{"max_waiting in a zone", "rate_limit_redis {\n\tzone a {\n\t\tmax_waiting 1\n\t}\n}",
			`unrecognized subdirective "max_waiting", at Testfile:3`},

		// fair_by and fair_tenants (fair queuing)
		{"fair_by without a queue", "rate_limit_redis {\n\tzone a {\n\t\talgorithm concurrency\n\t\tlimit 2\n\t\tfair_by {http.request.header.X-Tenant}\n\t}\n}",
			`zone a: fair queuing needs a queue: a max_wait, on algorithm concurrency, or with priority on token_bucket, at Testfile:5`},
		{"fair_by on a shaping token bucket", inZone("\t\tmax_wait 1s\n\t\tfair_by {http.request.header.X-Tenant}\n"),
			`zone a: fair queuing needs a queue: a max_wait, on algorithm concurrency, or with priority on token_bucket (the default when no algorithm is given), at Testfile:4`},
		{"fair_by literal", "rate_limit_redis {\n\tzone a {\n\t\talgorithm concurrency\n\t\tlimit 2\n\t\tmax_wait 1s\n\t\tfair_by tenant\n\t}\n}",
			`zone a: fair_by "tenant" is a literal, so every request would be one tenant: use a placeholder, such as {http.request.header.X-Tenant}, at Testfile:6`},
		{"fair_tenants without fair_by", "rate_limit_redis {\n\tzone a {\n\t\talgorithm concurrency\n\t\tlimit 2\n\t\tmax_wait 1s\n\t\tfair_tenants 10\n\t}\n}",
			`zone a: fair_tenants needs fair_by, the placeholder that names a request's tenant, at Testfile:6`},
		{"fair_tenants zero", "rate_limit_redis {\n\tzone a {\n\t\tfair_tenants 0\n\t}\n}",
			`fair_tenants: "0" must be >= 1, at Testfile:3`},
		{"fair_tenants too many", "rate_limit_redis {\n\tzone a {\n\t\talgorithm concurrency\n\t\tlimit 2\n\t\tmax_wait 1s\n\t\tfair_by {http.request.header.X-Tenant}\n\t\tfair_tenants 100001\n\t}\n}",
			`zone a: fair_tenants 100001 must be 1 to 100000, at Testfile:7`},

		// degraded_header
		{"degraded_header bad", "rate_limit_redis {\n\tdegraded_header false\n}",
			`degraded_header: "false" must be on or off, at Testfile:2`},
		{"degraded_header in a zone", "rate_limit_redis {\n\tzone a {\n\t\tdegraded_header off\n\t}\n}",
			`unrecognized subdirective "degraded_header", at Testfile:3`},
		{"degraded_header in redis", "rate_limit_redis {\n\tredis {\n\t\tdegraded_header off\n\t}\n}",
			`unrecognized subdirective "degraded_header", at Testfile:3`},

		// grpc_status
		{"grpc_status bad", "rate_limit_redis {\n\tgrpc_status 8\n}",
			`grpc_status: "8" must be on or off, at Testfile:2`},
		{"grpc_status in a zone", "rate_limit_redis {\n\tzone a {\n\t\tgrpc_status off\n\t}\n}",
			`unrecognized subdirective "grpc_status", at Testfile:3`},

		// a zone's fail_mode
		{"zone fail_mode bad", "rate_limit_redis {\n\tzone a {\n\t\tfail_mode shut\n\t}\n}",
			`zone a: fail_mode "shut" must be open, closed or local, at Testfile:3`},
		{"fail_mode in redis", "rate_limit_redis {\n\tredis {\n\t\tfail_mode closed\n\t}\n}",
			`unrecognized subdirective "fail_mode", at Testfile:3`},
		{"fail_mode in tls", "rate_limit_redis {\n\tredis {\n\t\ttls {\n\t\t\tfail_mode closed\n\t\t}\n\t}\n}",
			`unrecognized subdirective "fail_mode", at Testfile:4`},

		// empty_key
		{"empty_key repeated in the shorthand", "rate_limit_redis {\n\tempty_key skip\n\tempty_key skip\n}",
			`duplicate subdirective "empty_key", at Testfile:3`},
		{"empty_key bad", "rate_limit_redis {\n\tzone a {\n\t\tempty_key drop\n\t}\n}",
			`zone a: empty_key "drop" must be shared, skip or deny, at Testfile:3`},
		{"empty_key in redis", "rate_limit_redis {\n\tredis {\n\t\tempty_key skip\n\t}\n}",
			`unrecognized subdirective "empty_key", at Testfile:3`},
		{"empty_key with zone blocks", "rate_limit_redis {" + zone + "\n\tempty_key skip\n}",
			`zone subdirectives at the top level (the shorthand for one zone named "default") cannot be mixed with zone blocks, at Testfile:6`},

		// redis
		{"redis argument", "rate_limit_redis {\n\tredis localhost {\n\t}\n}",
			`redis: unexpected argument "localhost"; it takes no arguments, at Testfile:2`},
		{"redis repeated", "rate_limit_redis {\n\tredis {\n\t\tdb 1\n\t}\n\tredis {\n\t\tdb 2\n\t}\n}",
			`duplicate subdirective "redis", at Testfile:5`},
		{"redis unknown", "rate_limit_redis {\n\tredis {\n\t\thost localhost\n\t}\n}",
			`unrecognized subdirective "host", at Testfile:3`},
		{"password extra is not echoed", "rate_limit_redis {\n\tredis {\n\t\tpassword open sesame\n\t}\n}",
			`password: too many arguments (quote a password that contains spaces), at Testfile:3`},
		{"db not a number", "rate_limit_redis {\n\tredis {\n\t\tdb one\n\t}\n}",
			`db: "one" is not an integer, at Testfile:3`},
		{"db negative", "rate_limit_redis {\n\tredis {\n\t\tdb -1\n\t}\n}",
			`db: "-1" must be >= 0, at Testfile:3`},
		{"pool_size not a number", "rate_limit_redis {\n\tredis {\n\t\tpool_size many\n\t}\n}",
			`pool_size: "many" is not an integer, at Testfile:3`},
		{"pool_size zero", "rate_limit_redis {\n\tredis {\n\t\tpool_size 0\n\t}\n}",
			`pool_size: "0" must be >= 1, at Testfile:3`},
		{"dial_timeout not a duration", "rate_limit_redis {\n\tredis {\n\t\tdial_timeout 5\n\t}\n}",
			`dial_timeout: "5" is not a duration, at Testfile:3`},
		{"dial_timeout zero", "rate_limit_redis {\n\tredis {\n\t\tdial_timeout 0s\n\t}\n}",
			`dial_timeout: "0s" must be > 0, at Testfile:3`},
		{"sentinel without addresses", "rate_limit_redis {\n\tredis {\n\t\tsentinel mymaster\n\t}" + zone + "\n}",
			`redis sentinel mymaster needs the addresses of its Sentinels (address host:26379 ...), at Testfile:3`},
		{"cluster argument", "rate_limit_redis {\n\tredis {\n\t\tcluster yes\n\t}\n}",
			`cluster: unexpected argument "yes"; it takes no arguments, at Testfile:3`},
		{"cluster and sentinel", "rate_limit_redis {\n\tredis {\n\t\taddress a:1\n\t\tsentinel m\n\t\tcluster\n\t}" + zone + "\n}",
			`redis cluster and sentinel exclude each other: with sentinel, the addresses are Sentinels, at Testfile:5`},
		{"cluster with a db", "rate_limit_redis {\n\tredis {\n\t\taddress a:1\n\t\tcluster\n\t\tdb 2\n\t}" + zone + "\n}",
			`redis db 2: Redis Cluster has only database 0 (more than one address without sentinel means cluster), at Testfile:5`},
		{"several addresses with a db", "rate_limit_redis {\n\tredis {\n\t\taddress a:1 b:2 c:3\n\t\tdb 1\n\t}" + zone + "\n}",
			`redis db 1: Redis Cluster has only database 0 (more than one address without sentinel means cluster), at Testfile:4`},
		{"tls cert without key", "rate_limit_redis {\n\tredis {\n\t\ttls {\n\t\t\tcert c.pem\n\t\t}\n\t}" + zone + "\n}",
			`redis tls: cert and key must be given together, at Testfile:3`},
		{"tls key without cert", "rate_limit_redis {\n\tredis {\n\t\ttls {\n\t\t\tkey k.pem\n\t\t}\n\t}" + zone + "\n}",
			`redis tls: cert and key must be given together, at Testfile:3`},
		{"tls argument", "rate_limit_redis {\n\tredis {\n\t\ttls on\n\t}\n}",
			`tls: unexpected argument "on"; it takes no arguments, at Testfile:3`},
		{"tls unknown", "rate_limit_redis {\n\tredis {\n\t\ttls {\n\t\t\tverify no\n\t\t}\n\t}\n}",
			`unrecognized subdirective "verify", at Testfile:4`},
		{"tls insecure_skip_verify argument", "rate_limit_redis {\n\tredis {\n\t\ttls {\n\t\t\tinsecure_skip_verify true\n\t\t}\n\t}\n}",
			`insecure_skip_verify: unexpected argument "true"; it takes no arguments, at Testfile:4`},

		// zone
		{"zone name missing", "rate_limit_redis {\n\tzone {\n\t\tcapacity 1\n\t}\n}",
			`wrong argument count or unexpected line ending after 'zone', at Testfile:2`},
		{"zone extra", "rate_limit_redis {\n\tzone a b {\n\t\tcapacity 1\n\t}\n}",
			`zone: unexpected argument "b", at Testfile:2`},
		{"zone bad name", "rate_limit_redis {\n\tzone a/b {\n\t\tcapacity 1\n\t}\n}",
			`zone name "a/b" must be 1 to 64 characters of A-Z a-z 0-9 _ . -, at Testfile:2`},
		{"zone name too long", "rate_limit_redis {\n\tzone a2345678901234567890123456789012345678901234567890123456789012345\n}",
			`zone name "a2345678901234567890123456789012345678901234567890123456789012345" must be 1 to 64 characters of A-Z a-z 0-9 _ . -, at Testfile:2`},
		{"zone name with a space", "rate_limit_redis {\n\tzone \"a b\" {\n\t\tcapacity 1\n\t}\n}",
			`zone name "a b" must be 1 to 64 characters of A-Z a-z 0-9 _ . -, at Testfile:2`},
		{"zone name in braces", "rate_limit_redis {\n\tzone {a} {\n\t\tcapacity 1\n\t}\n}",
			`zone name "{a}" must be 1 to 64 characters of A-Z a-z 0-9 _ . -, at Testfile:2`},
		{"zone name with a brace", "rate_limit_redis {\n\tzone a} {\n\t\tcapacity 1\n\t}\n}",
			`zone name "a}" must be 1 to 64 characters of A-Z a-z 0-9 _ . -, at Testfile:2`},
		{"zone name duplicate", "rate_limit_redis {" + zone + zone + "\n}",
			`zone name "z" is used twice, at Testfile:6`},
		{"zone unknown subdirective", "rate_limit_redis {\n\tzone a {\n\t\ttimeout 1s\n\t}\n}",
			`unrecognized subdirective "timeout", at Testfile:3`},
		{"zone without block", "rate_limit_redis {\n\tzone a\n}",
			`zone a: capacity is required for algorithm token_bucket (the default when no algorithm is given), at Testfile:2`},
		{"zone empty block", "rate_limit_redis {\n\tzone a {\n\t}\n}",
			`zone a: capacity is required for algorithm token_bucket (the default when no algorithm is given), at Testfile:2`},

		// key

		// algorithm
		{"algorithm bad", "rate_limit_redis {\n\tzone a {\n\t\talgorithm leaky_bucket\n\t}\n}",
			`zone a: algorithm "leaky_bucket" must be token_bucket, sliding_window, fixed_window, sliding_window_counter, concurrency or adaptive_concurrency, at Testfile:3`},

		// capacity
		{"capacity not a number", "rate_limit_redis {\n\tzone a {\n\t\tcapacity abc\n\t}\n}",
			`zone a: capacity: "abc" is not an integer, at Testfile:3`},
		{"capacity not an integer", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 1.5\n\t}\n}",
			`zone a: capacity: "1.5" is not an integer, at Testfile:3`},
		{"capacity zero", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 0\n\t}\n}",
			`zone a: capacity: "0" is out of range (1 to 9007199254740992), at Testfile:3`},
		{"capacity negative", "rate_limit_redis {\n\tzone a {\n\t\tcapacity -5\n\t}\n}",
			`zone a: capacity: "-5" is out of range (1 to 9007199254740992), at Testfile:3`},
		{"capacity too large", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 9007199254740993\n\t}\n}",
			`zone a: capacity: "9007199254740993" is out of range (1 to 9007199254740992), at Testfile:3`},
		{"capacity beyond int64", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 99999999999999999999\n\t}\n}",
			`zone a: capacity: "99999999999999999999" is out of range (1 to 9007199254740992), at Testfile:3`},
		{"capacity far below zero", "rate_limit_redis {\n\tzone a {\n\t\tcapacity -9007199254740993\n\t}\n}",
			`zone a: capacity: "-9007199254740993" is out of range (1 to 9007199254740992), at Testfile:3`},

		// refill_rate
		{"refill_rate not a number", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate fast\n\t}\n}",
			`zone a: refill_rate: "fast" is not a number of tokens, optionally per a duration (10, 100/1m), at Testfile:3`},
		{"refill_rate no number", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate /1m\n\t}\n}",
			`zone a: refill_rate: "/1m" is not a number of tokens, optionally per a duration (10, 100/1m), at Testfile:3`},
		{"refill_rate infinite", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate inf\n\t}\n}",
			`zone a: refill_rate: "inf" is not a number of tokens, optionally per a duration (10, 100/1m), at Testfile:3`},
		{"refill_rate NaN", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate NaN/1s\n\t}\n}",
			`zone a: refill_rate: "NaN/1s" is not a number of tokens, optionally per a duration (10, 100/1m), at Testfile:3`},
		{"refill_rate zero", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate 0\n\t}\n}",
			`zone a: refill_rate: "0" must be > 0, at Testfile:3`},
		{"refill_rate negative", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate -1/1m\n\t}\n}",
			`zone a: refill_rate: "-1/1m" must be > 0, at Testfile:3`},
		{"refill_rate bad duration", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate 10/minute\n\t}\n}",
			`zone a: refill_rate: "10/minute": "minute" is not a duration, at Testfile:3`},
		{"refill_rate empty duration", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate 10/\n\t}\n}",
			`zone a: refill_rate: "10/": "" is not a duration, at Testfile:3`},
		{"refill_rate zero duration", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate 10/0s\n\t}\n}",
			`zone a: refill_rate: "10/0s": the duration must be > 0, at Testfile:3`},
		{"refill_rate unitless zero duration", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate 10/0\n\t}\n}",
			`zone a: refill_rate: "10/0": the duration must be > 0, at Testfile:3`},
		{"refill_rate negative duration", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate 10/-1s\n\t}\n}",
			`zone a: refill_rate: "10/-1s": the duration must be > 0, at Testfile:3`},
		{"refill_rate underflow", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate 5e-324/1m\n\t}\n}",
			`zone a: refill_rate: "5e-324/1m" is out of range, at Testfile:3`},

		// limit
		{"limit not a number", "rate_limit_redis {\n\tzone a {\n\t\tlimit ten\n\t}\n}",
			`zone a: limit: "ten" is not an integer, at Testfile:3`},
		{"limit zero", "rate_limit_redis {\n\tzone a {\n\t\tlimit 0\n\t}\n}",
			`zone a: limit: "0" is out of range (1 to 1000000), at Testfile:3`},
		{"limit too large", "rate_limit_redis {\n\tzone a {\n\t\tlimit 1000001\n\t}\n}",
			`zone a: limit: "1000001" is out of range (1 to 1000000), at Testfile:3`},
		{"limit negative", "rate_limit_redis {\n\tzone a {\n\t\tlimit -1\n\t}\n}",
			`zone a: limit: "-1" is out of range (1 to 1000000), at Testfile:3`},
		{"limit beyond 2^53", "rate_limit_redis {\n\tzone a {\n\t\tlimit 9007199254740993\n\t}\n}",
			`zone a: limit: "9007199254740993" is out of range (1 to 1000000), at Testfile:3`},
		{"limit beyond int64", "rate_limit_redis {\n\tzone a {\n\t\tlimit 99999999999999999999\n\t}\n}",
			`zone a: limit: "99999999999999999999" is out of range (1 to 1000000), at Testfile:3`},

		// window
		{"window not a duration", "rate_limit_redis {\n\tzone a {\n\t\twindow 60\n\t}\n}",
			`zone a: window: "60" is not a duration, at Testfile:3`},
		{"window zero", "rate_limit_redis {\n\tzone a {\n\t\twindow 0s\n\t}\n}",
			`zone a: window: "0s" is out of range (1ms to 366d), at Testfile:3`},
		{"window too short", "rate_limit_redis {\n\tzone a {\n\t\twindow 999us\n\t}\n}",
			`zone a: window: "999us" is out of range (1ms to 366d), at Testfile:3`},
		{"window too long", "rate_limit_redis {\n\tzone a {\n\t\twindow 367d\n\t}\n}",
			`zone a: window: "367d" is out of range (1ms to 366d), at Testfile:3`},
		{"window negative", "rate_limit_redis {\n\tzone a {\n\t\twindow -1s\n\t}\n}",
			`zone a: window: "-1s" is out of range (1ms to 366d), at Testfile:3`},
		{"window 1ns", "rate_limit_redis {\n\tzone a {\n\t\twindow 1ns\n\t}\n}",
			`zone a: window: "1ns" is out of range (1ms to 366d), at Testfile:3`},
		{"window an hour over 366d", "rate_limit_redis {\n\tzone a {\n\t\twindow 8785h\n\t}\n}",
			`zone a: window: "8785h" is out of range (1ms to 366d), at Testfile:3`},
		{"window beyond int64 nanoseconds", "rate_limit_redis {\n\tzone a {\n\t\twindow 10000000000000h\n\t}\n}",
			`zone a: window: "10000000000000h" is not a duration, at Testfile:3`},

		// cost
		{"cost not a number", "rate_limit_redis {\n\tzone a {\n\t\tcost heavy\n\t}\n}",
			`zone a: cost: "heavy" is not an integer or a placeholder, at Testfile:3`},
		{"cost not an integer", "rate_limit_redis {\n\tzone a {\n\t\tcost 1.5\n\t}\n}",
			`zone a: cost: "1.5" is not an integer or a placeholder, at Testfile:3`},
		{"cost empty braces", "rate_limit_redis {\n\tzone a {\n\t\tcost x{}\n\t}\n}",
			`zone a: cost: "x{}" is not an integer or a placeholder, at Testfile:3`},
		{"cost zero", "rate_limit_redis {\n\tzone a {\n\t\tcost 0\n\t}\n}",
			`zone a: cost: "0" must be > 0, at Testfile:3`},
		{"cost negative", "rate_limit_redis {\n\tzone a {\n\t\tcost -1\n\t}\n}",
			`zone a: cost: "-1" must be > 0, at Testfile:3`},
		{"cost beyond int64", "rate_limit_redis {\n\tzone a {\n\t\tcost 99999999999999999999\n\t}\n}",
			`zone a: cost: "99999999999999999999" is out of range, at Testfile:3`},

		// match
		{"match empty", "rate_limit_redis {\n\tzone a {\n\t\tmatch\n\t}\n}",
			`match: no matchers given; write them on the line (match path /login) or in a block, at Testfile:3`},
		{"match empty block", "rate_limit_redis {\n\tzone a {\n\t\tmatch {\n\t\t}\n\t}\n}",
			`match: no matchers given; write them on the line (match path /login) or in a block, at Testfile:3`},
		{"match unknown matcher", "rate_limit_redis {\n\tzone a {\n\t\tmatch color blue\n\t}\n}",
			`getting matcher module 'color': module not registered: http.matchers.color, at Testfile:3`},

		// checks across the subdirectives of a zone
		{"limit in a token bucket zone", "rate_limit_redis {\n\tzone a {\n\t\talgorithm token_bucket\n\t\tcapacity 1\n\t\trefill_rate 1\n\t\tlimit 5\n\t}\n}",
			`zone a: limit belongs to algorithm sliding_window, not token_bucket, at Testfile:6`},
		{"window in a zone of the default algorithm", "rate_limit_redis {\n\tzone a {\n\t\twindow 1m\n\t\tlimit 5\n\t}\n}",
			`zone a: limit belongs to algorithm sliding_window, not token_bucket (the default when no algorithm is given), at Testfile:4`},
		{"refill_rate in a sliding window zone", "rate_limit_redis {\n\tzone a {\n\t\trefill_rate 1\n\t\talgorithm sliding_window\n\t\tlimit 5\n\t\twindow 1m\n\t}\n}",
			`zone a: refill_rate belongs to algorithm token_bucket, not sliding_window, at Testfile:3`},
		{"capacity in a sliding window zone", "rate_limit_redis {\n\tzone a {\n\t\talgorithm sliding_window\n\t\tcapacity 1\n\t}\n}",
			`zone a: capacity belongs to algorithm token_bucket, not sliding_window, at Testfile:4`},
		{"capacity missing from a zone", "rate_limit_redis {\n\tzone a {\n\t\tkey {client_ip}\n\t\trefill_rate 1\n\t}\n}",
			`zone a: capacity is required for algorithm token_bucket (the default when no algorithm is given), at Testfile:2`},
		{"refill_rate missing from a zone", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 1\n\t}\n}",
			`zone a: refill_rate is required for algorithm token_bucket (the default when no algorithm is given), at Testfile:2`},
		{"limit missing from a zone", "rate_limit_redis {\n\tzone a {\n\t\talgorithm sliding_window\n\t\twindow 1m\n\t}\n}",
			`zone a: limit is required for algorithm sliding_window, at Testfile:2`},
		{"window missing from a zone", "rate_limit_redis {\n\tzone a {\n\t\talgorithm sliding_window\n\t\tlimit 1\n\t}\n}",
			`zone a: window is required for algorithm sliding_window, at Testfile:2`},
		{"cost above capacity", "rate_limit_redis {\n\tzone a {\n\t\tcost 6\n\t\tcapacity 5\n\t\trefill_rate 1\n\t}\n}",
			`zone a: cost 6 is larger than capacity 5: no request could ever be admitted, at Testfile:3`},
		{"cost above limit", "rate_limit_redis {\n\tzone a {\n\t\talgorithm sliding_window\n\t\tlimit 5\n\t\twindow 1s\n\t\tcost 6\n\t}\n}",
			`zone a: cost 6 is larger than limit 5: no request could ever be admitted, at Testfile:6`},
		{"bucket too slow to refill", "rate_limit_redis {\n\tzone a {\n\t\tcapacity 1000000000\n\t\trefill_rate 1\n\t}\n}",
			`zone a: an empty bucket takes 1000000000s to refill (capacity / refill_rate); at most 366d is supported, at Testfile:4`},

		// the shorthand
		{"shorthand then zone block", "rate_limit_redis {\n\tcapacity 1\n\trefill_rate 1" + zone + "\n}",
			`zone subdirectives at the top level (the shorthand for one zone named "default") cannot be mixed with zone blocks, at Testfile:4`},
		{"zone block then shorthand", "rate_limit_redis {" + zone + "\n\tkey {client_ip}\n}",
			`zone subdirectives at the top level (the shorthand for one zone named "default") cannot be mixed with zone blocks, at Testfile:6`},
		{"shorthand incomplete", "rate_limit_redis {\n\ttimeout 1s\n\tkey {client_ip}\n\tcapacity 1\n}",
			`zone default: refill_rate is required for algorithm token_bucket (the default when no algorithm is given), at Testfile:3`},
		{"shorthand parameter of the other algorithm", "rate_limit_redis {\n\tcapacity 1\n\trefill_rate 1\n\twindow 1m\n}",
			`zone default: window belongs to algorithm sliding_window, not token_bucket (the default when no algorithm is given), at Testfile:4`},
		{"shorthand bad value", "rate_limit_redis {\n\tlimit none\n}",
			`zone default: limit: "none" is not an integer, at Testfile:2`},

		// count_status, charge and hold_max
		{"count_status empty", tb + "\tcount_status\n}", `wrong argument count or unexpected line ending after 'count_status', at Testfile:4`},
		{"count_status bad code", tb + "\tcount_status 401 999\n}", `zone default: count_status: "999" is not a status code (100 to 599) or a class such as 4xx, at Testfile:4`},
		{"count_status bad class", tb + "\tcount_status 6xx\n}", `zone default: count_status: "6xx" is not a status code (100 to 599) or a class such as 4xx, at Testfile:4`},
		{"count_status twice", tb + "\tcount_status 401\n\tcount_status 403\n}", `duplicate subdirective "count_status", at Testfile:5`},
		{"charge no source", tb + "\tcharge\n}", `charge: a source is required: header <field> [scale <n>], or openai_usage, anthropic_usage or gemini_usage [total|prompt|completion|weights ...] [missing <n>], at Testfile:4`},
		{"charge bad source", tb + "\tcharge body\n}", `zone default: charge source "body" must be header, openai_usage, anthropic_usage or gemini_usage, at Testfile:4`},
		{"charge header no field", tb + "\tcharge header\n}", `charge header: one response header field name is required, optionally with a scale (charge header X-Tokens-Used, charge header x-litellm-response-cost scale 1000000), at Testfile:4`},
		{"charge header two fields", tb + "\tcharge header A B\n}", `charge header: one response header field name is required, optionally with a scale (charge header X-Tokens-Used, charge header x-litellm-response-cost scale 1000000), at Testfile:4`},
		{"charge header scale without a number", tb + "\tcharge header A scale\n}", `charge header: one response header field name is required, optionally with a scale (charge header X-Tokens-Used, charge header x-litellm-response-cost scale 1000000), at Testfile:4`},
		{"charge header scale not a number", tb + "\tcharge header A scale lots\n}", `charge header: scale "lots" is not a number greater than 0, at Testfile:4`},
		{"charge header scale 0", tb + "\tcharge header A scale 0\n}", `charge header: scale "0" is not a number greater than 0, at Testfile:4`},
		{"charge header scale negative", tb + "\tcharge header A scale -1\n}", `zone default: charge scale -1 must be greater than 0 and at most 1e+15, at Testfile:4`},
		{"charge header scale too large", tb + "\tcharge header A scale 1e16\n}", `zone default: charge scale 1e+16 must be greater than 0 and at most 1e+15, at Testfile:4`},
		{"charge header scale NaN", tb + "\tcharge header A scale NaN\n}", `zone default: charge scale NaN must be greater than 0 and at most 1e+15, at Testfile:4`},
		{"charge weights none", tb + "\tcharge openai_usage weights\n}", `charge openai_usage: weights needs at least one weight: prompt, completion, cached or cache_write, each followed by a number (weights prompt 1 completion 4 cached 0.1), at Testfile:4`},
		{"charge weights none, missing", tb + "\tcharge anthropic_usage weights missing 5\n}", `charge anthropic_usage: weights needs at least one weight: prompt, completion, cached or cache_write, each followed by a number (weights prompt 1 completion 4 cached 0.1), at Testfile:4`},
		{"charge weight unknown", tb + "\tcharge openai_usage weights input 1\n}", `charge openai_usage: unknown weight "input": prompt, completion, cached or cache_write, at Testfile:4`},
		{"charge weight twice", tb + "\tcharge openai_usage weights prompt 1 prompt 2\n}", `charge openai_usage: weight prompt given twice, at Testfile:4`},
		{"charge weight without a number", tb + "\tcharge openai_usage weights prompt\n}", `charge openai_usage: weight prompt needs a number or a placeholder, at Testfile:4`},
		{"charge weight not a number", tb + "\tcharge openai_usage weights prompt lots\n}", `charge openai_usage: weight prompt "lots" is not a number or a placeholder, at Testfile:4`},
		{"charge weight negative", tb + "\tcharge openai_usage weights cached -0.1\n}", `zone default: charge weight cached -0.1 must be between 0 and 1000000, at Testfile:4`},
		{"charge weight too large", tb + "\tcharge openai_usage weights completion 1000001\n}", `zone default: charge weight completion 1.000001e+06 must be between 0 and 1000000, at Testfile:4`},
		{"charge weights all 0", tb + "\tcharge anthropic_usage weights prompt 0 completion 0\n}", `zone default: charge weights are all 0: the zone would charge nothing, at Testfile:4`},
		{"charge weights then usage", tb + "\tcharge openai_usage weights prompt 1 total\n}", `charge openai_usage: unknown weight "total": prompt, completion, cached or cache_write, at Testfile:4`},
		{"charge usage then weights", tb + "\tcharge openai_usage total weights prompt 1\n}", `charge openai_usage: unexpected argument "weights", at Testfile:4`},
		{"charge anthropic usage bad", tb + "\tcharge anthropic_usage input\n}", `zone default: charge usage "input" must be total, prompt or completion, at Testfile:4`},
		{"charge usage bad", tb + "\tcharge openai_usage input\n}", `zone default: charge usage "input" must be total, prompt or completion, at Testfile:4`},
		{"charge usage extra", tb + "\tcharge openai_usage total x\n}", `charge openai_usage: unexpected argument "x", at Testfile:4`},
		{"charge missing no amount", tb + "\tcharge openai_usage total missing\n}", `charge openai_usage: missing needs the amount a response without usage is charged (missing 4000), at Testfile:4`},
		{"charge missing negative", tb + "\tcharge openai_usage missing -1\n}", `zone default: charge missing -1 must be between 0 and 9007199254740992, at Testfile:4`},
		{"charge missing not a number", tb + "\tcharge openai_usage missing lots\n}", `charge openai_usage: missing "lots" is not an integer, at Testfile:4`},
		{"charge missing then usage", tb + "\tcharge openai_usage missing 5 total\n}", `charge openai_usage: unexpected argument "total", at Testfile:4`},
		{"charge header missing", tb + "\tcharge header X missing 5\n}", `charge header: one response header field name is required, optionally with a scale (charge header X-Tokens-Used, charge header x-litellm-response-cost scale 1000000), at Testfile:4`},
		{"hold_max alone", tb + "\thold_max 1m\n}", `zone default: hold_max applies to a zone with count_status or charge, or of algorithm concurrency, at Testfile:4`},
		{"hold_max too long", tb + "\tcount_status 401\n\thold_max 2d\n}", `zone default: hold_max 2d is out of range (at most 1d), at Testfile:5`},
		{"hold_max zero", tb + "\tcount_status 401\n\thold_max 0s\n}", `hold_max: "0s" must be > 0, at Testfile:5`},
		{"charge sliding_window", "rate_limit_redis {\n\tzone z {\n\t\talgorithm sliding_window\n\t\tlimit 10\n\t\twindow 1m\n\t\tcharge openai_usage\n\t}\n}",
			`zone z: charge needs algorithm token_bucket, fixed_window or sliding_window_counter: a sliding_window zone stores one entry per unit of cost, so charging it what a response reports (thousands of tokens) would store thousands of entries per request; count_status works with sliding_window, at Testfile:6`},

		// ipv4_prefix
		{"ipv4_prefix zero", "rate_limit_redis {\n\tipv4_prefix 0\n}",
			`ipv4_prefix 0 must be between 1 and 32, at Testfile:2`},
		{"ipv4_prefix above 32", "rate_limit_redis {\n\tipv4_prefix 33\n}",
			`ipv4_prefix 33 must be between 1 and 32, at Testfile:2`},
		{"ipv4_prefix with a slash", "rate_limit_redis {\n\tipv4_prefix /24\n}",
			`ipv4_prefix: "/24" is not an integer, at Testfile:2`},
		{"ipv4_prefix in a zone, above 32", inZone("\t\tipv4_prefix 64\n"),
			`zone a: ipv4_prefix 64 must be between 1 and 32, at Testfile:3`},
		{"ipv4_prefix in a zone, repeated", inZone("\t\tipv4_prefix 24\n\t\tipv4_prefix 16\n"),
			`duplicate subdirective "ipv4_prefix", at Testfile:4`},

		// ipv6_prefix
		{"ipv6_prefix zero", "rate_limit_redis {\n\tipv6_prefix 0\n}",
			`ipv6_prefix 0 must be between 1 and 128, at Testfile:2`},
		{"ipv6_prefix above 128", "rate_limit_redis {\n\tipv6_prefix 129\n}",
			`ipv6_prefix 129 must be between 1 and 128, at Testfile:2`},
		{"ipv6_prefix not a number", "rate_limit_redis {\n\tipv6_prefix /64\n}",
			`ipv6_prefix: "/64" is not an integer, at Testfile:2`},
		{"ipv6_prefix in a zone, missing", inZone("\t\tipv6_prefix\n"),
			`wrong argument count or unexpected line ending after 'ipv6_prefix', at Testfile:3`},
		{"ipv6_prefix in a zone, negative", inZone("\t\tipv6_prefix -1\n"),
			`zone a: ipv6_prefix -1 must be between 1 and 128, at Testfile:3`},
		{"ipv6_prefix in a redis block", "rate_limit_redis {\n\tredis {\n\t\tipv6_prefix 64\n\t}\n}",
			`unrecognized subdirective "ipv6_prefix", at Testfile:3`},

		// jitter
		{"jitter not a duration", "rate_limit_redis {\n\tjitter some\n}",
			`jitter: "some" is not a duration, at Testfile:2`},
		{"jitter a bare number", "rate_limit_redis {\n\tjitter 5\n}",
			`jitter: "5" is not a duration, at Testfile:2`},
		{"jitter negative", "rate_limit_redis {\n\tjitter -1s\n}",
			`jitter -1s must be a whole number of seconds, >= 0, at Testfile:2`},
		{"jitter a fraction", "rate_limit_redis {\n\tjitter 1500ms\n}",
			`jitter 1.5s must be a whole number of seconds, >= 0, at Testfile:2`},
		{"jitter in a zone, a fraction", inZone("\t\tjitter 500ms\n"),
			`zone a: jitter 500ms must be a whole number of seconds, >= 0, at Testfile:3`},
		{"jitter in a zone, repeated", inZone("\t\tjitter 1s\n\t\tjitter 1s\n"),
			`duplicate subdirective "jitter", at Testfile:4`},
		{"jitter in a deny_cache block", "rate_limit_redis {\n\tdeny_cache {\n\t\tjitter 1s\n\t}\n}",
			`deny_cache: unrecognized subdirective "jitter", at Testfile:3`},

		// adaptive_concurrency
		{"min_limit on concurrency", "rate_limit_redis {\n\tzone z {\n\t\talgorithm concurrency\n\t\tlimit 10\n\t\tmin_limit 2\n\t}\n}",
			`zone z: min_limit, buffer, update_interval, probe_interval and probe_samples belong to algorithm adaptive_concurrency, not concurrency, at Testfile:5`},
		{"buffer on a token bucket", tb + "\tbuffer 10%\n}",
			`zone default: min_limit, buffer, update_interval, probe_interval and probe_samples belong to algorithm adaptive_concurrency, not token_bucket (the default when no algorithm is given), at Testfile:4`},
		{"min_limit above limit", "rate_limit_redis {\n\tzone z {\n\t\talgorithm adaptive_concurrency\n\t\tlimit 10\n" + "\t\tmin_limit 11\n\t}\n}", `zone z: min_limit 11 must be between 1 and limit 10, at Testfile:5`},
		{"min_limit 0", "rate_limit_redis {\n\tzone z {\n\t\talgorithm adaptive_concurrency\n\t\tlimit 10\n" + "\t\tmin_limit 0\n\t}\n}", `min_limit: "0" must be >= 1, at Testfile:5`},
		{"buffer above 1", "rate_limit_redis {\n\tzone z {\n\t\talgorithm adaptive_concurrency\n\t\tlimit 10\n" + "\t\tbuffer 150%\n\t}\n}", `zone z: buffer 1.5 must be above 0 and at most 1: a fraction of the minimum latency (0.25, or 25%), at Testfile:5`},
		{"update_interval too short", "rate_limit_redis {\n\tzone z {\n\t\talgorithm adaptive_concurrency\n\t\tlimit 10\n" + "\t\tupdate_interval 1ms\n\t}\n}", `zone z: update_interval 1ms must be between 10ms and 10s, at Testfile:5`},
		{"probe_interval too short", "rate_limit_redis {\n\tzone z {\n\t\talgorithm adaptive_concurrency\n\t\tlimit 10\n" + "\t\tprobe_interval 10ms\n\t}\n}", `zone z: probe_interval 10ms must be between 1s and 1d, at Testfile:5`},
		{"probe_samples too many", "rate_limit_redis {\n\tzone z {\n\t\talgorithm adaptive_concurrency\n\t\tlimit 10\n" + "\t\tprobe_samples 10001\n\t}\n}", `zone z: probe_samples 10001 must be between 1 and 10000, at Testfile:5`},
		{"adaptive limit from a placeholder", "rate_limit_redis {\n\tzone z {\n\t\talgorithm adaptive_concurrency\n\t\tlimit {http.vars.l} 10\n\t}\n}",
			`zone z: limit of algorithm adaptive_concurrency must be a literal: its learnt limit is one per client, within one ceiling, at Testfile:4`},
		{"adaptive with overrides", "rate_limit_redis {\n\tzone z {\n\t\talgorithm adaptive_concurrency\n\t\tlimit 10\n" + "\t\toverrides\n\t}\n}", `zone z: overrides exclude algorithm adaptive_concurrency: its limit is learnt (a lower limit in the configuration applies at once), at Testfile:5`},
		{"adaptive with cost", "rate_limit_redis {\n\tzone z {\n\t\talgorithm adaptive_concurrency\n\t\tlimit 10\n" + "\t\tcost 2\n\t}\n}", `zone z: cost does not apply to algorithm concurrency: a request takes one slot while it runs, at Testfile:5`},

		// no_retry_over
		{"no_retry_over not a duration", "rate_limit_redis {\n\tno_retry_over never\n}",
			`no_retry_over: "never" is not a duration, at Testfile:2`},
		{"no_retry_over negative", inZone("\t\tno_retry_over -1m\n"),
			`zone a: no_retry_over -1m0s must be > 0, or off, at Testfile:3`},
	}
	for _, tc := range append(table, subdirectiveRows()...) {
		t.Run(tc.name, func(t *testing.T) {
			var h Handler
			err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input))
			if err == nil {
				t.Fatalf("no error; want %q; got\n%s", tc.want, toJSON(t, &h))
			}
			if err.Error() != tc.want {
				t.Errorf("error\n got %q\nwant %q", err, tc.want)
			}
		})
	}
}

// TestAdaptCaddyfile runs the directive through the Caddyfile adapter: the directive is
// registered and ordered (no `order` line is needed), the matcher token is taken by Caddy, and
// errors name the file and line.
func TestAdaptCaddyfile(t *testing.T) {
	t.Parallel()
	adapter := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}

	out, warnings, err := adapter.Adapt([]byte(`:8080 {
	respond "ok"
	rate_limit_redis /api/* {
		zone api {
			key {client_ip}
			capacity 100
			refill_rate 10
		}
	}
}
`), nil)
	if err != nil {
		t.Fatalf("Adapt: %v", err)
	}
	if len(warnings) > 0 {
		t.Errorf("warnings: %v", warnings)
	}
	const want = `{"apps":{"http":{"servers":{"srv0":{"listen":[":8080"],"routes":[` +
		`{"match":[{"path":["/api/*"]}],"handle":[{"handler":"rate_limit_redis","zones":[{"capacity":100,"key":["{http.vars.client_ip}"],"name":"api","refill_rate":10}]}]},` +
		`{"handle":[{"body":"ok","handler":"static_response"}]}]}}}}}`
	if string(out) != want {
		t.Errorf("got  %s\nwant %s", out, want)
	}

	_, _, err = adapter.Adapt([]byte(`:8080 {
	rate_limit_redis {
		capacity 100
		refill_rate 10
		cost {http.request.header.X-Cost}
		cost 2
	}
}`), nil)
	const wantErr = `parsing caddyfile tokens for 'rate_limit_redis': duplicate subdirective "cost", at Caddyfile:6`
	if err == nil || err.Error() != wantErr {
		t.Errorf("error\n got %v\nwant %s", err, wantErr)
	}
}

// FuzzUnmarshalCaddyfile: any input is a config or an error, never a panic. A config the parser
// accepts is accepted by the JSON path too: marshalled as the adapter does, unmarshalled,
// provisioned and validated as Caddy does (the only errors allowed there are the matcher
// modules' own, TLS files that do not exist, a key_secret placeholder that resolves short, and a
// redis setting whose placeholder is empty). Seeds: Caddyfile.example and testdata/fuzz/FuzzUnmarshalCaddyfile; `make test`
// runs them, `make fuzz` explores.
func FuzzUnmarshalCaddyfile(f *testing.F) {
	if src, err := os.ReadFile("Caddyfile.example"); err == nil {
		f.Add(string(src))
	}
	f.Fuzz(func(t *testing.T, input string) {
		tokens, err := caddyfile.Tokenize([]byte(input), "Fuzzfile")
		if err != nil {
			return
		}
		var parsed Handler
		if err := parsed.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens)); err != nil {
			return
		}
		raw, err := json.Marshal(&parsed)
		if err != nil {
			t.Fatalf("marshalling the parsed config: %v", err)
		}
		var h Handler
		if err := json.Unmarshal(raw, &h); err != nil {
			t.Fatalf("unmarshalling %s: %v", raw, err)
		}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		defer cancel()
		err = h.Provision(ctx)
		defer func() { _ = h.Cleanup() }()
		if err == nil {
			err = h.Validate()
		}
		// The matcher modules' own errors, TLS files that are not there (the parser cannot
		// know what the file system holds), and a key_secret or redis setting given by a
		// placeholder (nor what the environment holds) are the JSON path's to report.
		placeholderSecret := err != nil && hasPlaceholder(h.KeySecret) && strings.HasPrefix(err.Error(), "key_secret ")
		emptyRedisSetting := err != nil && strings.HasPrefix(err.Error(), "redis ") &&
			(strings.Contains(err.Error(), ": empty placeholder {") || strings.Contains(err.Error(), `redis address "" is empty`))
		if err != nil && !strings.Contains(err.Error(), ": loading matchers: ") && !strings.Contains(err.Error(), "redis client: redis tls ") && !placeholderSecret && !emptyRedisSetting {
			t.Fatalf("the Caddyfile parser accepted %q, but the JSON path rejects %s: %v", input, raw, err)
		}
	})
}

// errorRow is a Caddyfile that the parser refuses, and its error exactly.
type errorRow struct{ name, input, want string }

// blockPlace is where a subdirective's line goes in a handler block: the Caddyfile around it,
// its indentation and its line number.
type blockPlace struct {
	open, close, indent string
	line                int
}

var (
	atTop       = blockPlace{"rate_limit_redis {\n\t", "\n}", "\t", 2}
	inZoneBlock = blockPlace{"rate_limit_redis {\n\tzone a {\n\t\t", "\n\t}\n}", "\t\t", 3}
	inRedis     = blockPlace{"rate_limit_redis {\n\tredis {\n\t\t", "\n\t}\n}", "\t\t", 3}
	inTLS       = blockPlace{"rate_limit_redis {\n\tredis {\n\t\ttls {\n\t\t\t", "\n\t\t}\n\t}\n}", "\t\t\t", 4}
	inDenyCache = blockPlace{"rate_limit_redis {\n\tdeny_cache {\n\t\t", "\n\t}\n}", "\t\t", 3}
)

// subdirectiveRows are the rows of TestUnmarshalCaddyfileErrors that every subdirective's
// syntax gives alike, each subdirective's named as "<label> missing", "<label> extra",
// "<label> repeated" and "<label> block" (the label is the subdirective's name unless given):
// its argument missing, one argument too many (the last of args), the subdirective twice (with
// first, then second), a block after its arguments (holding the line inside, if any).
func subdirectiveRows() []errorRow {
	type sub struct {
		label string // "": the name
		at    blockPlace
		name  string
	}
	withArgs := func(name, args string) string {
		if args == "" {
			return name
		}
		return name + " " + args
	}
	var rows []errorRow
	add := func(s sub, kind, input, want string) {
		label := s.label
		if label == "" {
			label = s.name
		}
		rows = append(rows, errorRow{label + " " + kind, s.at.open + input + s.at.close, want})
	}
	for _, s := range []sub{
		{"", atTop, "key_prefix"}, {"", atTop, "key_secret"}, {"", atTop, "timeout"}, {"", atTop, "fail_mode"},
		{"", atTop, "headers"}, {"", atTop, "clock"}, {"", atTop, "deny_cache"}, {"", atTop, "degraded_header"},
		{"", atTop, "grpc_status"}, {"", atTop, "ipv4_prefix"}, {"", atTop, "ipv6_prefix"}, {"", atTop, "jitter"},
		{"", atTop, "no_retry_over"}, {"zone no_retry_over", inZoneBlock, "no_retry_over"},
		{"zone fail_mode", inZoneBlock, "fail_mode"}, {"", inZoneBlock, "empty_key"}, {"", inZoneBlock, "key"},
		{"", inZoneBlock, "algorithm"}, {"", inZoneBlock, "capacity"}, {"", inZoneBlock, "refill_rate"},
		{"", inZoneBlock, "limit"}, {"", inZoneBlock, "window"}, {"", inZoneBlock, "cost"},
		{"", inZoneBlock, "fair_by"}, {"", inZoneBlock, "fair_tenants"},
		{"", inRedis, "address"}, {"", inRedis, "username"}, {"", inRedis, "password"}, {"", inRedis, "db"},
		{"", inRedis, "pool_size"}, {"", inRedis, "dial_timeout"}, {"", inRedis, "sentinel"},
		{"tls ca", inTLS, "ca"}, {"tls server_name", inTLS, "server_name"},
		{"deny_cache max_age", inDenyCache, "max_age"},
	} {
		add(s, "missing", s.name, fmt.Sprintf("wrong argument count or unexpected line ending after '%s', at Testfile:%d", s.name, s.at.line))
	}
	for _, e := range []struct {
		sub
		args string
	}{
		{sub{"", atTop, "key_prefix"}, "a b"}, {sub{"", atTop, "timeout"}, "1s 2s"},
		{sub{"", atTop, "fail_mode"}, "open closed"}, {sub{"", atTop, "headers"}, "ietf legacy"},
		{sub{"", atTop, "clock"}, "redis local"}, {sub{"", atTop, "deny_cache"}, "off on"},
		{sub{"", atTop, "degraded_header"}, "off on"}, {sub{"", atTop, "ipv4_prefix"}, "24 16"},
		{sub{"", atTop, "jitter"}, "1s 2s"}, {sub{"", atTop, "no_retry_over"}, "1m 2m"},
		{sub{"zone no_retry_over", inZoneBlock, "no_retry_over"}, "off on"},
		{sub{"zone fail_mode", inZoneBlock, "fail_mode"}, "closed open"}, {sub{"", inZoneBlock, "empty_key"}, "skip deny"},
		{sub{"", inZoneBlock, "algorithm"}, "token_bucket sliding_window"}, {sub{"", inZoneBlock, "capacity"}, "1 2"},
		{sub{"", inZoneBlock, "refill_rate"}, "1 2"}, {sub{"", inZoneBlock, "limit"}, "1 2"},
		{sub{"", inZoneBlock, "window"}, "1m 2m"}, {sub{"", inZoneBlock, "cost"}, "1 2"},
		{sub{"", inZoneBlock, "fair_by"}, "{a} {b}"}, {sub{"", inZoneBlock, "fair_tenants"}, "1 2"},
		{sub{"", inRedis, "username"}, "a b"}, {sub{"", inRedis, "db"}, "1 2"}, {sub{"", inRedis, "pool_size"}, "1 2"},
		{sub{"", inRedis, "dial_timeout"}, "1s 2s"}, {sub{"", inRedis, "sentinel"}, "a b"},
		{sub{"tls cert", inTLS, "cert"}, "a b"},
	} {
		extra := e.args[strings.LastIndexByte(e.args, ' ')+1:]
		add(e.sub, "extra", withArgs(e.name, e.args), fmt.Sprintf("%s: unexpected argument %q, at Testfile:%d", e.name, extra, e.at.line))
	}
	for _, r := range []struct {
		sub
		first, second string
	}{
		{sub{"", atTop, "key_prefix"}, "a", "b"}, {sub{"", atTop, "key_secret"}, "{env.A}", "{env.B}"},
		{sub{"", atTop, "timeout"}, "1s", "2s"}, {sub{"", atTop, "fail_mode"}, "open", "open"},
		{sub{"", atTop, "headers"}, "off", "ietf"}, {sub{"", atTop, "clock"}, "redis", "redis"},
		{sub{"", atTop, "dry_run"}, "", ""}, {sub{"", atTop, "log_key"}, "", ""},
		{sub{"", atTop, "deny_cache"}, "off", "on"}, {sub{"", atTop, "max_waiting"}, "1", "2"},
		{sub{"", atTop, "degraded_header"}, "off", "off"}, {sub{"", atTop, "grpc_status"}, "off", "on"},
		{sub{"", atTop, "ipv4_prefix"}, "24", "24"}, {sub{"", atTop, "ipv6_prefix"}, "64", "56"},
		{sub{"", atTop, "jitter"}, "1s", "2s"}, {sub{"shorthand", atTop, "capacity"}, "1", "1"},
		{sub{"", atTop, "no_retry_over"}, "off", "1m"}, {sub{"zone no_retry_over", inZoneBlock, "no_retry_over"}, "1m", "1m"},
		{sub{"zone fail_mode", inZoneBlock, "fail_mode"}, "closed", "closed"}, {sub{"", inZoneBlock, "empty_key"}, "skip", "deny"},
		{sub{"", inZoneBlock, "key"}, "{client_ip}", "{client_ip}"}, {sub{"", inZoneBlock, "algorithm"}, "token_bucket", "token_bucket"},
		{sub{"", inZoneBlock, "capacity"}, "1", "1"}, {sub{"", inZoneBlock, "refill_rate"}, "1", "1"},
		{sub{"", inZoneBlock, "limit"}, "1", "1"}, {sub{"", inZoneBlock, "window"}, "1m", "1m"},
		{sub{"", inZoneBlock, "cost"}, "1", "1"}, {sub{"", inZoneBlock, "match"}, "path /a", "path /b"},
		{sub{"", inRedis, "username"}, "a", "b"}, {sub{"", inRedis, "password"}, "a", "b"},
		{sub{"", inRedis, "db"}, "1", "1"}, {sub{"", inRedis, "pool_size"}, "1", "1"},
		{sub{"", inRedis, "dial_timeout"}, "1s", "1s"}, {sub{"", inRedis, "sentinel"}, "a", "a"},
		{sub{"", inRedis, "cluster"}, "", ""}, {sub{"", inRedis, "tls"}, "", ""},
		{sub{"tls key", inTLS, "key"}, "a", "a"},
		{sub{"deny_cache max_age", inDenyCache, "max_age"}, "1s", "2s"},
	} {
		add(r.sub, "repeated", withArgs(r.name, r.first)+"\n"+r.at.indent+withArgs(r.name, r.second),
			fmt.Sprintf("duplicate subdirective %q, at Testfile:%d", r.name, r.at.line+1))
	}
	for _, b := range []struct {
		sub
		args, inside string // inside: the line in the block ("": none)
	}{
		{sub{"", atTop, "key_prefix"}, "a", "b"}, {sub{"", atTop, "key_secret"}, "{env.A}", "b"},
		{sub{"", atTop, "dry_run"}, "", "on"}, {sub{"", atTop, "log_key"}, "", ""},
		{sub{"", atTop, "degraded_header"}, "off", ""}, {sub{"", atTop, "ipv4_prefix"}, "24", ""},
		{sub{"", atTop, "jitter"}, "1s", ""}, {sub{"", atTop, "no_retry_over"}, "off", ""},
		{sub{"zone no_retry_over", inZoneBlock, "no_retry_over"}, "2m", ""},
		{sub{"zone fail_mode", inZoneBlock, "fail_mode"}, "closed", ""}, {sub{"", inZoneBlock, "empty_key"}, "skip", ""},
		{sub{"", inZoneBlock, "key"}, "{client_ip}", ""},
		{sub{"", inRedis, "address"}, "a:1", "b"},
	} {
		block := " {\n"
		if b.inside != "" {
			block += b.at.indent + "\t" + b.inside + "\n"
		}
		add(b.sub, "block", withArgs(b.name, b.args)+block+b.at.indent+"}", fmt.Sprintf("%s: unexpected block, at Testfile:%d", b.name, b.at.line))
	}
	return rows
}
