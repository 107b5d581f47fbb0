package ratelimitredis

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

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
