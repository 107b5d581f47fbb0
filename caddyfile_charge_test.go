package ratelimitredis

import (
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func TestUnmarshalCaddyfileCharge(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		input string
		want  *Zone
	}{
		{"count_status", "rate_limit_redis {\n\tzone login {\n\t\talgorithm sliding_window\n\t\tlimit 5\n\t\twindow 15m\n\t\tcount_status 401 403 5xx\n\t}\n}",
			&Zone{Name: "login", Algorithm: "sliding_window", Limit: NumberOf(5), Window: NumberOf(caddy.Duration(15 * time.Minute)), CountStatus: []string{"401", "403", "5xx"}}},
		{"charge header", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1000/1h\n\tcost 100\n\tcharge header X-Tokens-Used\n\thold_max 30m\n}",
			&Zone{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1000.0 / 3600), Cost: "100", Charge: &Charge{Source: "header", Header: "X-Tokens-Used"}, HoldMax: caddy.Duration(30 * time.Minute)}},
		{"charge openai_usage", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge openai_usage\n}",
			&Zone{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "openai_usage"}}},
		{"charge openai_usage completion with count_status", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge openai_usage completion\n\tcount_status 2xx\n}",
			&Zone{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "openai_usage", Usage: "completion"}, CountStatus: []string{"2xx"}}},
		{"charge openai_usage missing", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge openai_usage missing 0\n}",
			&Zone{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "openai_usage", Missing: new(int64(0))}}},
		{"charge openai_usage prompt missing", "rate_limit_redis {\n\tcapacity 1000\n\trefill_rate 1\n\tcharge openai_usage prompt missing 800\n}",
			&Zone{Name: "default", Capacity: NumberOf(1000), RefillRate: NumberOf(1), Charge: &Charge{Source: "openai_usage", Usage: "prompt", Missing: new(int64(800))}}},
		{"count_status fixed_window", "rate_limit_redis {\n\tzone z {\n\t\talgorithm fixed_window\n\t\tlimit 10\n\t\tperiod day\n\t\tcount_status 401\n\t}\n}",
			&Zone{Name: "z", Algorithm: "fixed_window", Limit: NumberOf(10), Period: "day", CountStatus: []string{"401"}}},
		{"charge fixed_window", "rate_limit_redis {\n\tzone z {\n\t\talgorithm fixed_window\n\t\tlimit 100000\n\t\twindow 1d\n\t\tcost 100\n\t\tcharge openai_usage\n\t}\n}",
			&Zone{Name: "z", Algorithm: "fixed_window", Limit: NumberOf(100000), Window: NumberOf(caddy.Duration(24 * time.Hour)), Cost: "100", Charge: &Charge{Source: "openai_usage"}}},
		{"charge sliding_window_counter", "rate_limit_redis {\n\tzone z {\n\t\talgorithm sliding_window_counter\n\t\tlimit 10\n\t\twindow 1m\n\t\tcharge header X\n\t\tcount_status 2xx\n\t}\n}",
			&Zone{Name: "z", Algorithm: "sliding_window_counter", Limit: NumberOf(10), Window: NumberOf(caddy.Duration(time.Minute)), Charge: &Charge{Source: "header", Header: "X"}, CountStatus: []string{"2xx"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h Handler
			if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input)); err != nil {
				t.Fatalf("UnmarshalCaddyfile: %v", err)
			}
			if len(h.Zones) != 1 || !reflect.DeepEqual(h.Zones[0], tc.want) {
				t.Errorf("got\n%s\nwant\n%s", toJSON(t, h.Zones), toJSON(t, tc.want))
			}
		})
	}
}

func TestUnmarshalCaddyfileChargeErrors(t *testing.T) {
	t.Parallel()
	const tb = "rate_limit_redis {\n\tcapacity 10\n\trefill_rate 1\n"
	for _, tc := range []struct{ name, input, want string }{
		{"count_status empty", tb + "\tcount_status\n}", `wrong argument count or unexpected line ending after 'count_status', at Testfile:4`},
		{"count_status bad code", tb + "\tcount_status 401 999\n}", `zone default: count_status: "999" is not a status code (100 to 599) or a class such as 4xx, at Testfile:4`},
		{"count_status bad class", tb + "\tcount_status 6xx\n}", `zone default: count_status: "6xx" is not a status code (100 to 599) or a class such as 4xx, at Testfile:4`},
		{"count_status twice", tb + "\tcount_status 401\n\tcount_status 403\n}", `duplicate subdirective "count_status", at Testfile:5`},
		{"charge no source", tb + "\tcharge\n}", `charge: a source is required: header <field> or openai_usage [total|prompt|completion] [missing <n>], at Testfile:4`},
		{"charge bad source", tb + "\tcharge body\n}", `zone default: charge source "body" must be header or openai_usage, at Testfile:4`},
		{"charge header no field", tb + "\tcharge header\n}", `charge header: one response header field name is required (charge header X-Tokens-Used), at Testfile:4`},
		{"charge header two fields", tb + "\tcharge header A B\n}", `charge header: one response header field name is required (charge header X-Tokens-Used), at Testfile:4`},
		{"charge usage bad", tb + "\tcharge openai_usage input\n}", `zone default: charge usage "input" must be total, prompt or completion, at Testfile:4`},
		{"charge usage extra", tb + "\tcharge openai_usage total x\n}", `charge openai_usage: unexpected argument "x", at Testfile:4`},
		{"charge missing no amount", tb + "\tcharge openai_usage total missing\n}", `charge openai_usage: missing needs the amount a response without usage is charged (missing 4000), at Testfile:4`},
		{"charge missing negative", tb + "\tcharge openai_usage missing -1\n}", `zone default: charge missing -1 must be between 0 and 9007199254740992, at Testfile:4`},
		{"charge missing not a number", tb + "\tcharge openai_usage missing lots\n}", `charge openai_usage: missing "lots" is not an integer, at Testfile:4`},
		{"charge missing then usage", tb + "\tcharge openai_usage missing 5 total\n}", `charge openai_usage: unexpected argument "total", at Testfile:4`},
		{"charge header missing", tb + "\tcharge header X missing 5\n}", `charge header: one response header field name is required (charge header X-Tokens-Used), at Testfile:4`},
		{"hold_max alone", tb + "\thold_max 1m\n}", `zone default: hold_max applies to a zone with count_status or charge, or of algorithm concurrency, at Testfile:4`},
		{"hold_max too long", tb + "\tcount_status 401\n\thold_max 2d\n}", `zone default: hold_max 2d is out of range (at most 1d), at Testfile:5`},
		{"hold_max zero", tb + "\tcount_status 401\n\thold_max 0s\n}", `hold_max: "0s" must be > 0, at Testfile:5`},
		{"charge sliding_window", "rate_limit_redis {\n\tzone z {\n\t\talgorithm sliding_window\n\t\tlimit 10\n\t\twindow 1m\n\t\tcharge openai_usage\n\t}\n}",
			`zone z: charge needs algorithm token_bucket, fixed_window or sliding_window_counter: a sliding_window zone stores one entry per unit of cost, so charging it what a response reports (thousands of tokens) would store thousands of entries per request; count_status works with sliding_window, at Testfile:6`},
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

// TestValidateCharging: the JSON config's count_status, charge and hold_max are checked as the
// Caddyfile's are (Zone.validate, which the parser runs when a zone ends).
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
		{"bad source", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "body"} }), `zone z: charge source "body" must be header or openai_usage`},
		{"header without field", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "header"} }), `zone z: charge header needs a header field name`},
		{"bad usage", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "openai_usage", Usage: "input"} }), `zone z: charge usage "input" must be total, prompt or completion`},
		{"missing", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "openai_usage", Missing: new(int64(0))} }), ""},
		{"missing negative", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "openai_usage", Missing: new(int64(-1))} }), `zone z: charge missing -1 must be between 0 and 9007199254740992`},
		{"missing with header", with(tbz, func(z *Zone) { z.Charge = &Charge{Source: "header", Header: "X", Missing: new(int64(1))} }), `zone z: charge missing belongs to source openai_usage`},
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
