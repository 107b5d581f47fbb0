package ratelimitredis

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestPlaceholderChecks: what Provision expands and warns about in key and cost placeholders,
// and the valid placeholders it leaves alone.
func TestPlaceholderChecks(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		key, readAs string
		warnings    []string // "msg prefix|placeholder|did_you_mean"
	}{
		// Valid: no warning, unchanged.
		{key: "{http.request.header.X-API-Key}"},
		{key: "{http.request.cookie.session}"},
		{key: "{http.vars.client_ip}"},
		{key: "{http.vars.tier}"},
		{key: "{env.TENANT}"},
		{key: "{http.request.remote.host}"},
		{key: "{http.request.remote.host/24,64}"},
		{key: "{http.request.host}"},
		{key: "{http.request.host.labels.1}"},
		{key: "{http.request.uri.path.0}"},
		{key: "{http.request.uri.query.key}"},
		{key: "{http.request.tls.client.fingerprint}"},
		{key: "{http.regexp.tenant.1}"},
		{key: "{tier}"},        // a `map` output
		{key: "{file.tenant}"}, // in JSON, Caddy's placeholder of a file's contents
		{key: "static-key"},
		// Caddyfile shorthands: expanded as the Caddyfile does.
		{key: "{client_ip}", readAs: "{http.vars.client_ip}", warnings: []string{"a key placeholder is Caddyfile shorthand||"}},
		{key: "{header.X-API-Key}", readAs: "{http.request.header.X-API-Key}", warnings: []string{"a key placeholder is Caddyfile shorthand||"}},
		{key: "{remote_host}", readAs: "{http.request.remote.host}", warnings: []string{"a key placeholder is Caddyfile shorthand||"}},
		{key: "user-{vars.user}", readAs: "user-{http.vars.user}", warnings: []string{"a key placeholder is Caddyfile shorthand||"}},
		// Never a value where the handler runs by default.
		{key: "{http.auth.user.id}", warnings: []string{authMsg + "|{http.auth.user.id}|"}},
		// Not placeholders Caddy provides.
		{key: "{http.request.headers.X-API-Key}", warnings: []string{"a key placeholder is not one Caddy provides|{http.request.headers.X-API-Key}|{http.request.header.X-API-Key}"}},
		{key: "{http.request.client_ip}", warnings: []string{"a key placeholder is not one Caddy provides|{http.request.client_ip}|{http.vars.client_ip}"}},
		{key: "{http.request.uri.path.first}", warnings: []string{"a key placeholder is not one Caddy provides|{http.request.uri.path.first}|"}},
		{key: "{http.request.header.}", warnings: []string{"a key placeholder is not one Caddy provides|{http.request.header.}|"}},
		// The handler's own: the model, set before the key is resolved; the others after.
		{key: "{http.auth.user.id}:{http.rate_limit_redis.request.model}", warnings: []string{authMsg + "|{http.auth.user.id}|"}},
		{key: "{http.rate_limit_redis.model}", warnings: []string{"a key placeholder is not one Caddy provides|{http.rate_limit_redis.model}|{http.rate_limit_redis.request.model}"}},
		{key: "{http.rate_limit_redis.zone}", warnings: []string{"a key placeholder is not one Caddy provides|{http.rate_limit_redis.zone}|"}},
	} {
		t.Run(tc.key, func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			z := &Zone{Name: "pc", Key: []string{tc.key}, Cost: "1", EmptyKey: EmptyKeyShared}
			z.checkPlaceholders(zap.New(core))
			want := tc.readAs
			if want == "" {
				want = tc.key
			}
			if z.Key[0] != want {
				t.Errorf("read as %q, want %q", z.Key[0], want)
			}
			var got []string
			for _, e := range logs.All() {
				m := e.ContextMap()
				got = append(got, fmt.Sprintf("%s|%v|%v", e.Message, orEmpty(m["placeholder"]), orEmpty(m["did_you_mean"])))
			}
			if len(got) != len(tc.warnings) {
				t.Fatalf("warnings %q, want %q", got, tc.warnings)
			}
			for i, w := range tc.warnings {
				prefix, rest, _ := strings.Cut(w, "|")
				if !strings.HasPrefix(got[i], prefix) || !strings.HasSuffix(got[i], "|"+rest) {
					t.Errorf("warning %q, want %q", got[i], w)
				}
			}
		})
	}
	// The cost is checked too: a shorthand there is expanded.
	core, logs := observer.New(zapcore.WarnLevel)
	z := &Zone{Name: "pc", Key: []string{"{http.vars.client_ip}"}, Cost: "{header.X-Cost}"}
	z.checkPlaceholders(zap.New(core))
	if z.Cost != "{http.request.header.X-Cost}" || logs.Len() != 1 {
		t.Errorf("cost read as %q with %d warnings, want {http.request.header.X-Cost} and 1", z.Cost, logs.Len())
	}
}

func orEmpty(v any) any {
	if v == nil {
		return ""
	}
	return v
}

// TestBlockSharedEmptyKeyWarning: a zone with block and empty_key shared whose key can be empty
// is warned about at load (every keyless client shares one block); a key with an IP candidate,
// another empty_key or no block is not.
func TestBlockSharedEmptyKeyWarning(t *testing.T) {
	t.Parallel()
	header, ip := "{http.request.header.X-API-Key}", "{http.vars.client_ip}"
	for _, tc := range []struct {
		name     string
		key      []string
		emptyKey string
		block    time.Duration
		warned   bool
	}{
		{"a header, shared, block", []string{header}, EmptyKeyShared, time.Minute, true},
		{"two headers, shared, block", []string{header, "{http.request.header.X-User}"}, EmptyKeyShared, time.Minute, true},
		{"a header, skip", []string{header}, EmptyKeySkip, time.Minute, false},
		{"a header, deny", []string{header}, EmptyKeyDeny, time.Minute, false},
		{"a header, then the IP", []string{header, ip}, EmptyKeyShared, time.Minute, false},
		{"the remote host", []string{"{http.request.remote.host}"}, EmptyKeyShared, time.Minute, false},
		{"no block", []string{header}, EmptyKeyShared, 0, false},
	} {
		core, logs := observer.New(zapcore.WarnLevel)
		z := &Zone{Name: "b", Key: tc.key, Cost: "1", EmptyKey: tc.emptyKey, Block: caddy.Duration(tc.block)}
		z.checkPlaceholders(zap.New(core))
		if got := logs.FilterMessageSnippet("a zone with block and empty_key shared").Len(); got != map[bool]int{true: 1}[tc.warned] {
			t.Errorf("%s: %d warnings, want warned=%v: %v", tc.name, got, tc.warned, logs.All())
		}
	}
}
