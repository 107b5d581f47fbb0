package ratelimitredis

import (
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// TestMholtSubdirectiveErrors: each of mholt/caddy-ratelimit's subdirectives that this directive
// lacks gets an error naming what to write instead, in a zone block and at the top level, exactly.
func TestMholtSubdirectiveErrors(t *testing.T) {
	t.Parallel()
	// zone is mholt's zone translated, valid here, for lines whose error lies at the top level.
	const zone = "\tzone z {\n\t\tkey {remote_host}\n\t\talgorithm sliding_window\n\t\tlimit 3\n\t\twindow 1m\n\t}\n"
	top := func(line string) string { return "rate_limit_redis {\n\t" + line + "\n" + zone + "}" }
	inZone := func(lines string) string {
		return "rate_limit_redis {\n\tzone z {\n\t\tkey {remote_host}\n" + lines + "\t}\n}"
	}
	const events3 = "unrecognized subdirective \"events\" (caddy-ratelimit's): use `algorithm sliding_window` and `limit 3`; `window` stays as it is"
	const distributed = "unrecognized subdirective \"distributed\" (caddy-ratelimit's): distribution is built in: " +
		"every decision is made in Redis, so all instances enforce one limit; remove the line"
	const sweep = "unrecognized subdirective \"sweep_interval\" (caddy-ratelimit's): not needed: every Redis key expires, " +
		"so Redis frees an idle client's state; remove the line"
	const storage = "unrecognized subdirective \"storage\" (caddy-ratelimit's): Caddy's storage is not used: " +
		"give the Redis in a `redis { address <host:port> }` block"
	const jitter = "is caddy-ratelimit's fraction of the wait; here jitter is a duration, the most added to Retry-After at random, in whole seconds: "
	table := []errorRow{
		{"events in a zone, after window", inZone("\t\twindow 1m\n\t\tevents 3\n"), events3 + ", at Testfile:5"},
		{"events in a zone, before window", inZone("\t\tevents 3\n\t\twindow 1m\n"), events3 + ", at Testfile:4"},
		{"events the number given", inZone("\t\tevents 250\n"),
			"unrecognized subdirective \"events\" (caddy-ratelimit's): use `algorithm sliding_window` and `limit 250`; `window` stays as it is, at Testfile:4"},
		{"events without a number", inZone("\t\tevents\n"),
			"unrecognized subdirective \"events\" (caddy-ratelimit's): use `algorithm sliding_window` and `limit <n>`; `window` stays as it is, at Testfile:4"},
		{"events at the top level", top("events 3"), events3 + ", at Testfile:2"},
		{"window without events", inZone("\t\twindow 1m\n"),
			"zone z: window belongs to algorithm sliding_window, not token_bucket (the default when no algorithm is given); " +
				"caddy-ratelimit's window and events are `algorithm sliding_window`, `window` and `limit <events>` here, at Testfile:4"},
		{"window beside a token bucket", inZone("\t\tcapacity 3\n\t\trefill_rate 1\n\t\twindow 1m\n"),
			"zone z: window belongs to algorithm sliding_window, not token_bucket (the default when no algorithm is given), at Testfile:6"},
		{"distributed", top("distributed"), distributed + ", at Testfile:2"},
		{"distributed with a block", top("distributed {\n\t\tread_interval 2s\n\t\twrite_interval 2s\n\t}"), distributed + ", at Testfile:2"},
		{"distributed in a zone", inZone("\t\tdistributed\n"), distributed + ", at Testfile:4"},
		{"sweep_interval", top("sweep_interval 5m"), sweep + ", at Testfile:2"},
		{"storage", top("storage file_system /tmp"), storage + ", at Testfile:2"},
		{"storage with a block", top("storage redis {\n\t\thost localhost\n\t}"), storage + ", at Testfile:2"},
		{"disable_metrics", top("disable_metrics"),
			"unrecognized subdirective \"disable_metrics\" (caddy-ratelimit's): the metrics are always in Caddy's metrics registry; remove the line, at Testfile:2"},
		{"jitter a fraction", top("jitter 0.2"), `jitter: "0.2" ` + jitter + "0.2 of a 1m window is `jitter 12s`, at Testfile:2"},
		{"jitter a fraction, rounded up", top("jitter 0.01"), `jitter: "0.01" ` + jitter + "0.01 of a 1m window is `jitter 1s`, at Testfile:2"},
		{"jitter 1", top("jitter 1"), `jitter: "1" ` + jitter + "1 of a 1m window is `jitter 60s`, at Testfile:2"},
		{"jitter a fraction in a zone", inZone("\t\tjitter .5\n"), `jitter: ".5" ` + jitter + ".5 of a 1m window is `jitter 30s`, at Testfile:4"},
		// Not fractions: the duration's own errors.
		{"jitter above 1", top("jitter 5"), `jitter: "5" is not a duration, at Testfile:2`},
		{"jitter an exponent", top("jitter 1e-1"), `jitter: "1e-1" is not a duration, at Testfile:2`},
		{"jitter negative", top("jitter -0.2"), `jitter: "-0.2" is not a duration, at Testfile:2`},
		// Not caddy-ratelimit's: no hint.
		{"unknown", inZone("\t\tmax_events 3\n"), `unrecognized subdirective "max_events", at Testfile:4`},
	}
	for _, tc := range table {
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

// TestMholtJitterZeroAndDurations: a duration, and 0, are this directive's jitter, not a fraction.
func TestMholtJitterZeroAndDurations(t *testing.T) {
	t.Parallel()
	for _, v := range []string{"0", "12s", "1m"} {
		var h Handler
		in := "rate_limit_redis {\n\tjitter " + v + "\n\tcapacity 1\n\trefill_rate 1\n}"
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil {
			t.Errorf("jitter %s: %v", v, err)
		}
	}
}
