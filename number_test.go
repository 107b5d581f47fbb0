package ratelimitredis

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// withExprs returns z with the given numbers given as text, as the Caddyfile parser and JSON
// set a placeholder number: field name, text as configured.
func withExprs(z *Zone, nameText ...string) *Zone {
	for i := 0; i+1 < len(nameText); i += 2 {
		f, ok := numFieldNamed(nameText[i])
		if !ok {
			panic("no number " + nameText[i])
		}
		*z.number(f) = NumberText(nameText[i+1])
	}
	return z
}

func TestUnmarshalCaddyfilePlaceholderNumbers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		input string
		want  *Zone
		json  string // json.Marshal of the zone: what `caddy adapt` prints
	}{
		{
			name: "token bucket from a map, with fallbacks",
			input: `rate_limit_redis {
				zone api {
					key {http.request.header.X-API-Key}
					capacity {plan_capacity} 100
					refill_rate {plan_rate} 10/1m
				}
			}`,
			want: withExprs(&Zone{Name: "api", Key: []string{"{http.request.header.X-API-Key}"}, Capacity: NumberOf(100), RefillRate: NumberOf(10.0 / 60)},
				"capacity", "{plan_capacity} 100", "refill_rate", "{plan_rate} 10/1m"),
			json: `{"name":"api","key":["{http.request.header.X-API-Key}"],"capacity":"{plan_capacity} 100","refill_rate":"{plan_rate} 10/1m"}`,
		},
		{
			name: "sliding window, no fallbacks, a literal beside",
			input: `rate_limit_redis {
				algorithm sliding_window
				limit {http.vars.plan_limit}
				window 1h
			}`,
			want: withExprs(&Zone{Name: "default", Algorithm: "sliding_window", Window: NumberOf(caddy.Duration(time.Hour))}, "limit", "{http.vars.plan_limit}"),
			json: `{"name":"default","algorithm":"sliding_window","limit":"{http.vars.plan_limit}","window":3600000000000}`,
		},
		{
			name: "fixed window, window from a placeholder",
			input: `rate_limit_redis {
				algorithm fixed_window
				limit 5
				window {plan_window} 1d
			}`,
			want: withExprs(&Zone{Name: "default", Algorithm: "fixed_window", Limit: NumberOf(5), Window: NumberOf(caddy.Duration(24 * time.Hour))}, "window", "{plan_window} 1d"),
			json: `{"name":"default","algorithm":"fixed_window","limit":5,"window":"{plan_window} 1d"}`,
		},
		{
			// The quota comes per request: a literal cost or max_cost above its fallback is not
			// an error (the cost is a 429 without Retry-After where the plan is too small).
			name: "cost and max_cost above a placeholder quota's fallback",
			input: `rate_limit_redis {
				capacity {plan_capacity} 3
				refill_rate 1
				cost 5
				max_cost 50
			}`,
			want: withExprs(&Zone{Name: "default", Capacity: NumberOf(3), RefillRate: NumberOf(1), Cost: "5", MaxCost: NumberOf(50)}, "capacity", "{plan_capacity} 3"),
			json: `{"name":"default","capacity":"{plan_capacity} 3","refill_rate":1,"cost":"5","max_cost":50}`,
		},
		{
			name: "max_cost from a placeholder on a sliding window with a placeholder cost",
			input: `rate_limit_redis {
				algorithm sliding_window
				limit 10
				window 1m
				cost {http.request.header.X-Cost}
				max_cost {plan_max_cost} 5000
			}`,
			want: withExprs(&Zone{Name: "default", Algorithm: "sliding_window", Limit: NumberOf(10), Window: NumberOf(caddy.Duration(time.Minute)),
				Cost: "{http.request.header.X-Cost}", MaxCost: NumberOf(5000)}, "max_cost", "{plan_max_cost} 5000"),
			json: `{"name":"default","algorithm":"sliding_window","limit":10,"window":60000000000,"cost":"{http.request.header.X-Cost}","max_cost":"{plan_max_cost} 5000"}`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h Handler
			if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.input)); err != nil {
				t.Fatal(err)
			}
			if len(h.Zones) != 1 || !reflect.DeepEqual(h.Zones[0], tc.want) {
				t.Fatalf("got\n%#v\nwant\n%#v", h.Zones[0], tc.want)
			}
			b, err := json.Marshal(h.Zones[0])
			if err != nil {
				t.Fatal(err)
			}
			if string(b) != tc.json {
				t.Fatalf("JSON\n got %s\nwant %s", b, tc.json)
			}
			// And back: the JSON path reads what it wrote.
			var back Zone
			if err := json.Unmarshal(b, &back); err != nil {
				t.Fatal(err)
			}
			if again, _ := json.Marshal(&back); string(again) != tc.json {
				t.Fatalf("JSON round trip\n got %s\nwant %s", again, tc.json)
			}
		})
	}
}

func TestUnmarshalCaddyfilePlaceholderNumberErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		input string
		want  string
	}{
		{"fallback a placeholder", "rate_limit_redis {\n\trefill_rate 1\n\tcapacity {a} {b}\n}",
			`capacity: the fallback "{b}" must be a literal, not a placeholder, at Testfile:3`},
		{"two fallbacks", "rate_limit_redis {\n\trefill_rate 1\n\tcapacity {a} 5 6\n}",
			`capacity: unexpected argument "6", at Testfile:3`},
		{"a literal and another", "rate_limit_redis {\n\trefill_rate 1\n\tcapacity 5 {a}\n}",
			`capacity: unexpected argument "{a}", at Testfile:3`},
		{"capacity fallback 0", "rate_limit_redis {\n\trefill_rate 1\n\tcapacity {a} 0\n}",
			`zone default: capacity: fallback "0" is out of range (1 to 9007199254740992), at Testfile:3`},
		{"capacity fallback not an integer", "rate_limit_redis {\n\trefill_rate 1\n\tcapacity {a} 1.5\n}",
			`zone default: capacity: fallback "1.5" is not an integer, at Testfile:3`},
		{"capacity fallback NaN", "rate_limit_redis {\n\trefill_rate 1\n\tcapacity {a} NaN\n}",
			`zone default: capacity: fallback "NaN" is not an integer, at Testfile:3`},
		{"refill_rate fallback", "rate_limit_redis {\n\tcapacity 1\n\trefill_rate {a} fast\n}",
			`zone default: refill_rate: fallback "fast" is not a number of tokens, optionally per a duration (10, 100/1m), at Testfile:3`},
		{"refill_rate fallback 1e309", "rate_limit_redis {\n\tcapacity 1\n\trefill_rate {a} 1e309\n}",
			`zone default: refill_rate: fallback "1e309" is not a number of tokens, optionally per a duration (10, 100/1m), at Testfile:3`},
		{"window fallback", "rate_limit_redis {\n\talgorithm sliding_window\n\tlimit 1\n\twindow {a} 0s\n}",
			`zone default: window: fallback "0s" is out of range (1ms to 366d), at Testfile:4`},
		{"limit fallback of a sliding window", "rate_limit_redis {\n\talgorithm sliding_window\n\tlimit {a} 2000000\n\twindow 1m\n}",
			`zone default: limit: fallback "2000000" is out of range (1 to 1000000), at Testfile:3`},
		{"max_cost fallback", "rate_limit_redis {\n\tcapacity 1\n\trefill_rate 1\n\tmax_cost {a} -1\n}",
			`zone default: max_cost: fallback "-1" is out of range (1 to 9007199254740992), at Testfile:4`},
		{"placeholder capacity on a sliding window", "rate_limit_redis {\n\talgorithm sliding_window\n\tlimit 1\n\twindow 1m\n\tcapacity {a}\n}",
			`zone default: capacity belongs to algorithm token_bucket, not sliding_window, at Testfile:5`},
		{"placeholder window with a period", "rate_limit_redis {\n\talgorithm fixed_window\n\tlimit 1\n\twindow {a}\n\tperiod day\n}",
			`zone default: a fixed_window zone has a window or a period, not both, at Testfile:5`},
		// No capacity can make a bucket that slow refill within 366 days.
		{"refill too slow for any capacity", "rate_limit_redis {\n\tcapacity {a}\n\trefill_rate 1/400d\n}",
			`zone default: an empty bucket takes 34560000s to refill (capacity / refill_rate); at most 366d is supported, at Testfile:3`},
		// The fallbacks are what an empty placeholder gives: they must work together.
		{"fallbacks refill too slowly", "rate_limit_redis {\n\tcapacity {a} 1000\n\trefill_rate {b} 1/1d\n}",
			`zone default: an empty bucket takes 86400000s to refill (capacity / refill_rate); at most 366d is supported, at Testfile:3`},
		{"literal max_cost above 1000", "rate_limit_redis {\n\talgorithm sliding_window\n\tlimit {a}\n\twindow 1m\n\tcost {b}\n\tmax_cost 2000\n}",
			`zone default: max_cost 2000: a sliding_window zone stores one entry per unit of cost, so a cost from a placeholder (chosen per request) is bounded by max_cost 1000 at most; use token_bucket for larger costs, at Testfile:6`},
		{"no argument", "rate_limit_redis {\n\tcapacity\n}",
			`wrong argument count or unexpected line ending after 'capacity', at Testfile:2`},
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

// TestAdaptPlaceholderNumbers: through the Caddyfile adapter, a zone's numbers from placeholders
// are JSON strings, Caddyfile shorthands expanded as in every other token; literals stay numbers.
func TestAdaptPlaceholderNumbers(t *testing.T) {
	t.Parallel()
	adapter := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}
	out, warnings, err := adapter.Adapt([]byte(`:8080 {
	map {header.X-API-Key} {plan_capacity} {plan_rate} {
		key-123 10000 10000/1h
		default 100 100/1h
	}
	rate_limit_redis {
		zone api {
			key {header.X-API-Key}
			capacity {plan_capacity} 100
			refill_rate {plan_rate} 100/1h
		}
		zone ip {
			capacity 500
			refill_rate 50
		}
	}
}
`), nil)
	if err != nil || len(warnings) > 0 {
		t.Fatalf("Adapt: %v %v", err, warnings)
	}
	const want = `{"handler":"rate_limit_redis","zones":[` +
		`{"capacity":"{plan_capacity} 100","key":["{http.request.header.X-API-Key}"],"name":"api","refill_rate":"{plan_rate} 100/1h"},` +
		`{"capacity":500,"name":"ip","refill_rate":50}]}`
	if !strings.Contains(string(out), want) {
		t.Fatalf("adapted:\n%s\nwant it to hold\n%s", out, want)
	}
}

// TestZoneJSONNumbers: the JSON forms of the numbers. A number; a string with a placeholder,
// optionally and a fallback; a string literal in the Caddyfile's syntax. Each is written back as
// it was given (a string's spaces collapsed) and provisioned to its value; errors name the zone
// and the field; and a zone is still decoded strictly, as Caddy decodes a module.
func TestZoneJSONNumbers(t *testing.T) {
	t.Parallel()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
	defer cancel()
	for _, tc := range []struct{ in, want, values, err string }{
		// values: capacity, refill_rate, limit, window and max_cost as provisioned.
		{in: `{"name":"a","capacity":5,"refill_rate":0.5}`, want: `{"name":"a","capacity":5,"refill_rate":0.5}`, values: "5 0.5 0 0s 0"},
		{in: `{"name":"a","capacity":"5","refill_rate":"30/1m"}`, want: `{"name":"a","capacity":"5","refill_rate":"30/1m"}`, values: "5 0.5 0 0s 0"},
		{in: `{"name":"a","capacity":" {x}   7 ","refill_rate":"{y}"}`, want: `{"name":"a","capacity":"{x} 7","refill_rate":"{y}"}`, values: "7 0 0 0s 0"},
		{in: `{"name":"a","algorithm":"sliding_window","limit":"{x}","window":"1m"}`, want: `{"name":"a","algorithm":"sliding_window","limit":"{x}","window":"1m"}`, values: "0 0 0 1m0s 0"},
		{in: `{"name":"a","algorithm":"sliding_window","limit":1,"window":60000000000}`, want: `{"name":"a","algorithm":"sliding_window","limit":1,"window":60000000000}`, values: "0 0 1 1m0s 0"},
		{in: `{"name":"a","algorithm":"sliding_window","limit":1,"window":"{x} 1m"}`, want: `{"name":"a","algorithm":"sliding_window","limit":1,"window":"{x} 1m"}`, values: "0 0 1 1m0s 0"},
		{in: `{"name":"a","capacity":null}`, want: `{"name":"a"}`, values: "0 0 0 0s 0"},
		{in: `{"name":"a","capacity":"{x} {y}"}`, err: `zone a: capacity: the fallback "{y}" must be a literal, not a placeholder`},
		{in: `{"name":"a","capacity":"5 6"}`, err: `zone a: capacity: unexpected argument "6"`},
		{in: `{"name":"a","capacity":""}`, err: `zone a: capacity: empty`},
		{in: `{"name":"a","capacity":"-1"}`, err: `zone a: capacity: "-1" is out of range (1 to 9007199254740992)`},
		{in: `{"name":"a","refill_rate":"0"}`, err: `zone a: refill_rate: "0" must be > 0`},
		{in: `{"name":"a","capacity":true}`, err: `json: cannot unmarshal bool into Go struct field Zone.capacity of type ratelimitredis.Number`},
		{in: `{"name":"a","capacity":1,"capacty":2}`, err: `json: unknown field "capacty"`},
	} {
		var z Zone
		err := caddy.StrictUnmarshalJSON([]byte(tc.in), &z)
		if err == nil {
			if b, _ := json.Marshal(&z); tc.want != "" && string(b) != tc.want {
				t.Errorf("%s:\n got %s\nwant %s", tc.in, b, tc.want)
			}
			err = z.provision(ctx, ctx.Logger(), inherited{})
		}
		if tc.err != "" {
			if err == nil || err.Error() != tc.err {
				t.Errorf("%s: error %v, want %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.in, err)
			continue
		}
		lz := z.lz
		if got := fmt.Sprintf("%d %g %d %v %d", lz.Capacity, lz.RefillRate, lz.Limit, lz.Window, lz.MaxCost); got != tc.values {
			t.Errorf("%s: provisioned %s, want %s", tc.in, got, tc.values)
		}
	}
}

// TestPlaceholderNumbersAtLoad: the JSON path (Provision and Validate) checks what the Caddyfile
// parser checks, and provisions the fallbacks as the zone's numbers.
func TestPlaceholderNumbersAtLoad(t *testing.T) {
	t.Parallel()
	load := func(zone string) (*Handler, error) {
		var h Handler
		if err := json.Unmarshal([]byte(`{"redis":{"addresses":["127.0.0.1:1"]},"zones":[`+zone+`]}`), &h); err != nil {
			return nil, err
		}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
		defer cancel()
		err := h.Provision(ctx)
		t.Cleanup(func() { _ = h.Cleanup() })
		if err == nil {
			err = h.Validate()
		}
		return &h, err
	}
	h, err := load(`{"name":"a","capacity":"{x} 5","refill_rate":"{y} 30/1m","max_cost":"{z}"}`)
	if err != nil {
		t.Fatal(err)
	}
	if z := h.Zones[0]; len(z.dyn) != 3 || z.lz.Capacity != 5 || z.lz.RefillRate != 0.5 || z.lz.MaxCost != 0 {
		t.Fatalf("provisioned %+v, want the fallbacks as numbers", z)
	}
	for _, tc := range []struct{ zone, want string }{
		{`{"name":"a","capacity":"{x} abc","refill_rate":1}`, `zone a: capacity: fallback "abc" is not an integer`},
		{`{"name":"a","algorithm":"sliding_window","limit":"{x} 2000000","window":"1m"}`, `zone a: limit: fallback "2000000" is out of range (1 to 1000000)`},
		{`{"name":"a","capacity":"{x}","refill_rate":"1/400d"}`, `zone a: an empty bucket takes 34560000s to refill (capacity / refill_rate); at most 366d is supported`},
		{`{"name":"a","algorithm":"sliding_window","limit":1,"window":"1m","capacity":"{x}"}`, `zone a: capacity belongs to algorithm token_bucket, not sliding_window`},
		{`{"name":"a","capacity":"5","refill_rate":1,"cost":"6"}`, `zone a: cost 6 is larger than capacity 5: no request could ever be admitted`},
	} {
		if _, err := load(tc.zone); err == nil || err.Error() != tc.want {
			t.Errorf("%s: error %v, want %q", tc.zone, err, tc.want)
		}
	}
	// What the Caddyfile accepts beside a quota from a placeholder, the JSON path accepts.
	for _, zone := range []string{
		`{"name":"a","capacity":"{x} 3","refill_rate":1,"cost":"5","max_cost":50}`,
		`{"name":"a","capacity":"{x}","refill_rate":"{y}"}`,
		`{"name":"a","capacity":5,"refill_rate":1,"max_cost":"{m} 50"}`,
		`{"name":"a","algorithm":"sliding_window","limit":"{x} 10","window":"1m","cost":"{c}","max_cost":"{m} 5000"}`,
	} {
		if _, err := load(zone); err != nil {
			t.Errorf("%s: %v", zone, err)
		}
	}
}

// dynZone is a provisioned zone of the algorithm whose every number of the algorithm comes from
// the placeholder {n} without a fallback, and whose max_cost from {m}, with the fallback 2^53
// (which every quota bounds).
func dynZone(t testing.TB, algorithm string, placeholderCost bool) *Zone {
	t.Helper()
	z := &Zone{Name: "z", Algorithm: algorithm, Key: []string{"{k}"}, Cost: "1"}
	if placeholderCost {
		z.Cost = "{c}"
	}
	if algorithm == "token_bucket" {
		withExprs(z, "capacity", "{n}", "refill_rate", "{n}", "max_cost", "{m} 9007199254740992")
	} else {
		withExprs(z, "limit", "{n}", "window", "{n}", "max_cost", "{m} 9007199254740992")
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
	t.Cleanup(cancel)
	if err := z.provision(ctx, ctx.Logger(), inherited{}); err != nil {
		t.Fatal(err)
	}
	return z
}

// FuzzZoneNumber: any text, as the value of any zone number from a placeholder, is a number the
// limiter accepts (limiter.Zone.Validate) or an error: never a panic, never a number that would
// make Redis fail, never an error longer than 400 bytes (a client's 100 kB header is quoted by
// its first 32 bytes). Seeds: testdata/fuzz/FuzzZoneNumber and hostile values.
func FuzzZoneNumber(f *testing.F) {
	f.Add(uint8(0), strings.Repeat("9", 100<<10))
	for _, s := range []string{"-1", "0", "NaN", "1e309", "", "10000", "9007199254740993", "100/1m", "1e-300", "1h", "367d", "{x}"} {
		for field := range uint8(numFields) {
			f.Add(field, s)
		}
	}
	zones := []*Zone{dynZone(f, "token_bucket", false), dynZone(f, "token_bucket", true), dynZone(f, "sliding_window", true),
		dynZone(f, "fixed_window", false), dynZone(f, "sliding_window_counter", false)}
	valid := map[numField]string{numCapacity: "10", numRefillRate: "1", numLimit: "10", numWindow: "1m", numMaxCost: "5"}
	f.Fuzz(func(t *testing.T, field uint8, s string) {
		fld := numField(field % uint8(numFields))
		v, err := parseNumber(fld, s, limiter.MaxCapacity)
		if err != nil {
			if len(err.Error()) > 400 {
				t.Fatalf("error of %d bytes: %.300s", len(err.Error()), err)
			}
		} else {
			switch fld {
			case numRefillRate:
				if !(v.rate > 0) || math.IsInf(v.rate, 0) {
					t.Fatalf("%q: refill_rate %v", s, v.rate)
				}
			case numWindow:
				if v.dur < limiter.MinWindow || v.dur > limiter.MaxWindow {
					t.Fatalf("%q: window %v", s, v.dur)
				}
			default:
				if v.n < 1 || v.n > limiter.MaxCapacity {
					t.Fatalf("%q: %s %d", s, fld, v.n)
				}
			}
		}
		for _, z := range zones {
			lz, err := z.resolve(func(dn *dynNumber) string {
				if dn.field == fld {
					return s
				}
				return valid[dn.field]
			})
			if err != nil {
				if len(err.Error()) > 400 {
					t.Fatalf("error of %d bytes: %.300s", len(err.Error()), err)
				}
				continue
			}
			if err := lz.Validate(); err != nil {
				t.Fatalf("%s %s %q: resolved %+v, which the limiter rejects: %v", z.Algorithm, fld, s, lz, err)
			}
			if lz.Algorithm == limiter.SlidingWindow && z.fixedCost == 0 && (lz.MaxCost < 1 || lz.MaxCost > MaxSlidingWindowCost) {
				t.Fatalf("%q: a sliding window with a placeholder cost resolved max_cost %d", s, lz.MaxCost)
			}
		}
	})
}

// TestLiteralNumbersCostNothing: a zone of literal numbers takes its own parameters per request,
// with no allocation; one with placeholder numbers a copy per request.
func TestLiteralNumbersCostNothing(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
	defer cancel()
	lit := &Zone{Name: "a", Capacity: NumberOf(10), RefillRate: NumberOf(1)}
	if err := lit.provision(ctx, ctx.Logger(), inherited{}); err != nil {
		t.Fatal(err)
	}
	repl := caddy.NewReplacer()
	if n := testing.AllocsPerRun(100, func() {
		if lz, err := lit.numbers(repl); err != nil || lz != &lit.lz {
			t.Fatalf("literal zone: %v %p", err, lz)
		}
	}); n != 0 {
		t.Fatalf("%.0f allocations per request for a zone of literal numbers, want 0", n)
	}
	dyn := dynZone(t, "token_bucket", false)
	repl.Set("n", "10")
	repl.Set("m", "5")
	lz, err := dyn.numbers(repl)
	if err != nil || lz == &dyn.lz || lz.Capacity != 10 || lz.RefillRate != 10 || lz.MaxCost != 5 {
		t.Fatalf("dynamic zone: %+v %v", lz, err)
	}
}

// TestResolveNumbers: each number per request, with its fallback, the checks between them and
// max_cost bounded.
func TestResolveNumbers(t *testing.T) {
	t.Parallel()
	values := func(kv map[string]string) func(*dynNumber) string {
		return func(dn *dynNumber) string { return kv[dn.field.String()] }
	}
	tb := dynZone(t, "token_bucket", false)
	for _, tc := range []struct {
		kv       map[string]string
		capacity int64
		rate     float64
		maxCost  int64
		err      string
	}{
		{kv: map[string]string{"capacity": "3", "refill_rate": "3/1h"}, capacity: 3, rate: 3.0 / 3600, maxCost: 3},
		{kv: map[string]string{"capacity": "+10", "refill_rate": "0.5", "max_cost": "4"}, capacity: 10, rate: 0.5, maxCost: 4},
		{kv: map[string]string{"capacity": "10", "refill_rate": "1", "max_cost": "50"}, capacity: 10, rate: 1, maxCost: 10},
		{kv: map[string]string{"refill_rate": "1"}, err: `zone z: capacity {n}: the placeholder is empty and capacity has no fallback (write one after the placeholder: capacity {n} <n>)`},
		{kv: map[string]string{"capacity": "10", "refill_rate": "1e-300"}, err: `zone z: capacity 10 and refill_rate 1e-300: an empty bucket would take 1e+301s to refill; at most 366d is supported`},
		{kv: map[string]string{"capacity": "10", "refill_rate": "1", "max_cost": "0"}, err: `zone z: max_cost {m}: "0" is out of range (1 to 9007199254740992)`},
	} {
		lz, err := tb.resolve(values(tc.kv))
		switch {
		case tc.err != "":
			if err == nil || err.Error() != tc.err {
				t.Errorf("%v: error %v, want %q", tc.kv, err, tc.err)
			}
		case err != nil:
			t.Errorf("%v: %v", tc.kv, err)
		case lz.Capacity != tc.capacity || lz.RefillRate != tc.rate || lz.MaxCost != tc.maxCost:
			t.Errorf("%v: resolved capacity %d, refill_rate %g, max_cost %d", tc.kv, lz.Capacity, lz.RefillRate, lz.MaxCost)
		}
	}
	sw := dynZone(t, "sliding_window", true)
	for limit, maxCost := range map[string]int64{"5": 5, "5000": 1000, "1000000": 1000} {
		lz, err := sw.resolve(values(map[string]string{"limit": limit, "window": "1m"}))
		if err != nil || lz.MaxCost != maxCost {
			t.Errorf("sliding window, placeholder cost, limit %s: %+v (%v), want max_cost %d", limit, lz, err, maxCost)
		}
	}
	if _, err := sw.resolve(values(map[string]string{"limit": "1000001", "window": "1m"})); err == nil ||
		err.Error() != `zone z: limit {n}: "1000001" is out of range (1 to 1000000)` {
		t.Errorf("sliding window limit above 1,000,000: %v", err)
	}
	fw := dynZone(t, "fixed_window", false)
	if _, err := fw.resolve(values(map[string]string{"limit": "9007199254740992", "window": "1h"})); err != nil {
		t.Errorf("fixed window limit 2^53: %v", err)
	}
}

// benchPlan runs the allowed path of h, whose zone is keyed on X-Client, with a `map`-like
// provider of {plan_capacity} and {plan_rate} on every request's replacer, as Caddy's map
// handler adds one.
func benchPlan(b *testing.B, zone *Zone) {
	srv := redistest.Start(b)
	zone.Name, zone.Key = "a", []string{"{http.request.header.X-Client}"}
	h := provisioned(b, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Zones: []*Zone{zone}})
	h.logger = h.logger.WithOptions(zap.IncreaseLevel(zapcore.InfoLevel))
	plan := func(key string) (any, bool) {
		switch key {
		case "plan_capacity", "plan_rate":
			return "1099511627776", true
		}
		return nil, false
	}
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	w := httptest.NewRecorder()
	for b.Loop() {
		repl := caddy.NewReplacer()
		repl.Map(plan)
		if err := h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)), next); err != nil {
			b.Fatal(err)
		}
	}
}

// The same zone with literal numbers and with numbers from placeholders, under the same load:
// go test -run XXX -bench ServeHTTPPlan -benchmem .
func BenchmarkServeHTTPPlanLiteral(b *testing.B) {
	benchPlan(b, &Zone{Capacity: NumberOf(1 << 40), RefillRate: NumberOf(1 << 40)})
}

func BenchmarkServeHTTPPlanPlaceholders(b *testing.B) {
	benchPlan(b, withExprs(&Zone{}, "capacity", "{plan_capacity} 100", "refill_rate", "{plan_rate} 10"))
}

// BenchmarkZoneNumbersPerRequest is the work a zone with placeholder numbers adds to a request
// (three numbers looked up and parsed, the copy of the zone's parameters), without Redis:
// go test -run XXX -bench ZoneNumbersPerRequest -benchmem .
func BenchmarkZoneNumbersPerRequest(b *testing.B) {
	z := dynZone(b, "token_bucket", false)
	repl := caddy.NewReplacer()
	repl.Set("n", "1000000000")
	repl.Set("m", "1000")
	for b.Loop() {
		if _, err := z.numbers(repl); err != nil {
			b.Fatal(err)
		}
	}
}
