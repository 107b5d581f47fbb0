package ratelimitredis

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// The Caddyfile subdirectives ipv4_prefix, ipv6_prefix and jitter (issue 19), at the top level
// (every zone) and in a zone block (that zone).

func TestUnmarshalCaddyfilePrefixesAndJitter(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		input string
		want  *Handler
	}{
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
				IPv4Prefix: 24, IPv6Prefix: 56, Jitter: caddy.Duration(5 * time.Second),
				Zones: []*Zone{
					{Name: "a", Capacity: NumberOf(5), RefillRate: NumberOf(1)},
					{Name: "b", Capacity: NumberOf(5), RefillRate: NumberOf(1), IPv4Prefix: 32, IPv6Prefix: 128, Jitter: new(caddy.Duration(0))},
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
				IPv6Prefix: 48, Jitter: caddy.Duration(time.Minute),
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
				IPv4Prefix: 1, IPv6Prefix: 1,
				Zones: []*Zone{{
					Name: "a", Algorithm: "sliding_window", Limit: NumberOf(1), Window: NumberOf(caddy.Duration(time.Second)),
					IPv4Prefix: 32, IPv6Prefix: 128, Jitter: new(caddy.Duration(time.Second)),
				}},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got Handler
			if err := got.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input)); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(&got, tc.want) {
				t.Errorf("got\n%s\nwant\n%s", toJSON(t, &got), toJSON(t, tc.want))
			}
		})
	}
}

func TestUnmarshalCaddyfilePrefixesAndJitterJSON(t *testing.T) {
	t.Parallel()
	var h Handler
	in := "rate_limit_redis {\n\tipv6_prefix 56\n\tjitter 3s\n\tzone a {\n\t\tjitter 0\n\t\tipv4_prefix 24\n\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n}"
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(&h)
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"ipv6_prefix":56,"jitter":3000000000,"zones":[{"name":"a","capacity":1,"refill_rate":1,"ipv4_prefix":24,"jitter":0}]}`
	if string(b) != want {
		t.Errorf("got  %s\nwant %s", b, want)
	}
}

func TestUnmarshalCaddyfilePrefixesAndJitterErrors(t *testing.T) {
	t.Parallel()
	zone := func(lines string) string {
		return "rate_limit_redis {\n\tzone a {\n" + lines + "\t\tcapacity 1\n\t\trefill_rate 1\n\t}\n}"
	}
	for _, tc := range []struct {
		name  string
		input string
		want  string
	}{
		// ipv4_prefix
		{"ipv4_prefix missing", "rate_limit_redis {\n\tipv4_prefix\n}",
			`wrong argument count or unexpected line ending after 'ipv4_prefix', at Testfile:2`},
		{"ipv4_prefix extra", "rate_limit_redis {\n\tipv4_prefix 24 16\n}",
			`ipv4_prefix: unexpected argument "16", at Testfile:2`},
		{"ipv4_prefix zero", "rate_limit_redis {\n\tipv4_prefix 0\n}",
			`ipv4_prefix 0 must be between 1 and 32, at Testfile:2`},
		{"ipv4_prefix above 32", "rate_limit_redis {\n\tipv4_prefix 33\n}",
			`ipv4_prefix 33 must be between 1 and 32, at Testfile:2`},
		{"ipv4_prefix with a slash", "rate_limit_redis {\n\tipv4_prefix /24\n}",
			`ipv4_prefix: "/24" is not an integer, at Testfile:2`},
		{"ipv4_prefix repeated", "rate_limit_redis {\n\tipv4_prefix 24\n\tipv4_prefix 24\n}",
			`duplicate subdirective "ipv4_prefix", at Testfile:3`},
		{"ipv4_prefix block", "rate_limit_redis {\n\tipv4_prefix 24 {\n\t}\n}",
			`ipv4_prefix: unexpected block, at Testfile:2`},
		{"ipv4_prefix in a zone, above 32", zone("\t\tipv4_prefix 64\n"),
			`zone a: ipv4_prefix 64 must be between 1 and 32, at Testfile:3`},
		{"ipv4_prefix in a zone, repeated", zone("\t\tipv4_prefix 24\n\t\tipv4_prefix 16\n"),
			`duplicate subdirective "ipv4_prefix", at Testfile:4`},

		// ipv6_prefix
		{"ipv6_prefix missing", "rate_limit_redis {\n\tipv6_prefix\n}",
			`wrong argument count or unexpected line ending after 'ipv6_prefix', at Testfile:2`},
		{"ipv6_prefix zero", "rate_limit_redis {\n\tipv6_prefix 0\n}",
			`ipv6_prefix 0 must be between 1 and 128, at Testfile:2`},
		{"ipv6_prefix above 128", "rate_limit_redis {\n\tipv6_prefix 129\n}",
			`ipv6_prefix 129 must be between 1 and 128, at Testfile:2`},
		{"ipv6_prefix not a number", "rate_limit_redis {\n\tipv6_prefix /64\n}",
			`ipv6_prefix: "/64" is not an integer, at Testfile:2`},
		{"ipv6_prefix repeated", "rate_limit_redis {\n\tipv6_prefix 64\n\tipv6_prefix 56\n}",
			`duplicate subdirective "ipv6_prefix", at Testfile:3`},
		{"ipv6_prefix in a zone, missing", zone("\t\tipv6_prefix\n"),
			`wrong argument count or unexpected line ending after 'ipv6_prefix', at Testfile:3`},
		{"ipv6_prefix in a zone, negative", zone("\t\tipv6_prefix -1\n"),
			`zone a: ipv6_prefix -1 must be between 1 and 128, at Testfile:3`},
		{"ipv6_prefix in a redis block", "rate_limit_redis {\n\tredis {\n\t\tipv6_prefix 64\n\t}\n}",
			`unrecognized subdirective "ipv6_prefix", at Testfile:3`},

		// jitter
		{"jitter missing", "rate_limit_redis {\n\tjitter\n}",
			`wrong argument count or unexpected line ending after 'jitter', at Testfile:2`},
		{"jitter extra", "rate_limit_redis {\n\tjitter 1s 2s\n}",
			`jitter: unexpected argument "2s", at Testfile:2`},
		{"jitter not a duration", "rate_limit_redis {\n\tjitter some\n}",
			`jitter: "some" is not a duration, at Testfile:2`},
		{"jitter a bare number", "rate_limit_redis {\n\tjitter 5\n}",
			`jitter: "5" is not a duration, at Testfile:2`},
		{"jitter negative", "rate_limit_redis {\n\tjitter -1s\n}",
			`jitter -1s must be a whole number of seconds, >= 0, at Testfile:2`},
		{"jitter a fraction", "rate_limit_redis {\n\tjitter 1500ms\n}",
			`jitter 1.5s must be a whole number of seconds, >= 0, at Testfile:2`},
		{"jitter repeated", "rate_limit_redis {\n\tjitter 1s\n\tjitter 2s\n}",
			`duplicate subdirective "jitter", at Testfile:3`},
		{"jitter block", "rate_limit_redis {\n\tjitter 1s {\n\t}\n}",
			`jitter: unexpected block, at Testfile:2`},
		{"jitter in a zone, a fraction", zone("\t\tjitter 500ms\n"),
			`zone a: jitter 500ms must be a whole number of seconds, >= 0, at Testfile:3`},
		{"jitter in a zone, repeated", zone("\t\tjitter 1s\n\t\tjitter 1s\n"),
			`duplicate subdirective "jitter", at Testfile:4`},
		{"jitter in a deny_cache block", "rate_limit_redis {\n\tdeny_cache {\n\t\tjitter 1s\n\t}\n}",
			`deny_cache: unrecognized subdirective "jitter", at Testfile:3`},
	} {
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

// TestConfigPrefixesAndJitterAtLoad: the JSON config's values out of range are errors when it
// loads, naming the field.
func TestConfigPrefixesAndJitterAtLoad(t *testing.T) {
	zone := func(fields string) string {
		return `{"zones":[{"name":"a","capacity":1,"refill_rate":1` + fields + `}]}`
	}
	for name, tc := range map[string]struct{ json, want string }{
		"ipv4_prefix above 32":       {`{"ipv4_prefix":33,` + zone("")[1:], "ipv4_prefix 33 must be between 1 and 32"},
		"ipv4_prefix negative":       {`{"ipv4_prefix":-1,` + zone("")[1:], "ipv4_prefix -1 must be between 1 and 32"},
		"ipv6_prefix above 128":      {`{"ipv6_prefix":129,` + zone("")[1:], "ipv6_prefix 129 must be between 1 and 128"},
		"zone ipv6_prefix above 128": {zone(`,"ipv6_prefix":200`), "zone a: ipv6_prefix 200 must be between 1 and 128"},
		"zone ipv4_prefix negative":  {zone(`,"ipv4_prefix":-8`), "zone a: ipv4_prefix -8 must be between 1 and 32"},
		"jitter negative":            {`{"jitter":"-1s",` + zone("")[1:], "jitter -1s must be a whole number of seconds, >= 0"},
		"jitter a fraction":          {`{"jitter":"1.5s",` + zone("")[1:], "jitter 1.5s must be a whole number of seconds, >= 0"},
		"zone jitter a fraction":     {zone(`,"jitter":"10ms"`), "zone a: jitter 10ms must be a whole number of seconds, >= 0"},
	} {
		t.Run(name, func(t *testing.T) {
			err := loadHandlerJSON(t, tc.json)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one saying %q", err, tc.want)
			}
		})
	}
}

// loadHandlerJSON loads a config whose one route has the handler of handlerJSON (without its
// "handler" key), and returns the load's error; Caddy is stopped if it loaded.
func loadHandlerJSON(t *testing.T, handlerJSON string) error {
	t.Helper()
	var handler map[string]any
	if err := json.Unmarshal([]byte(handlerJSON), &handler); err != nil {
		t.Fatal(err)
	}
	handler["handler"] = "rate_limit_redis"
	cfg, _ := json.Marshal(map[string]any{
		"admin": map[string]any{"disabled": true},
		"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"s": map[string]any{
			"listen": []string{"127.0.0.1:0"},
			"routes": []any{map[string]any{"handle": []any{handler}}},
		}}}},
	})
	err := caddy.Load(cfg, true)
	if err == nil {
		_ = caddy.Stop()
	}
	return err
}
