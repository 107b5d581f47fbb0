package ratelimitredis

import (
	"os"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// FuzzUnmarshalCaddyfile: any input is a config or an error, never a panic. The seeds (f.Add
// and testdata/fuzz/FuzzUnmarshalCaddyfile) run with every `go test`; `make fuzz` explores.
func FuzzUnmarshalCaddyfile(f *testing.F) {
	if src, err := os.ReadFile("Caddyfile.example"); err == nil {
		f.Add(string(src))
	}
	for _, seed := range []string{
		"rate_limit_redis {\n\tcapacity 10\n\trefill_rate 100/1m\n}",
		"rate_limit_redis {\n\tzone a {\n\t\tmatch path /login\n\t\talgorithm sliding_window\n\t\tlimit 5\n\t\twindow 1m\n\t}\n}",
		"rate_limit_redis {\n\tredis {\n\t\taddress a:1 b:2\n\t\ttls {\n\t\t\tca x\n\t\t}\n\t}\n\tcapacity 1\n\trefill_rate 1\n}",
		"rate_limit_redis {\n\tkey {http.request.header.X} {client_ip}\n\tcost {http.request.header.C}\n\tcapacity 9007199254740992\n\trefill_rate 1e-300/1ns\n}",
		"rate_limit_redis {\n\tzone {\n\t}\n}",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, input string) {
		tokens, err := caddyfile.Tokenize([]byte(input), "Fuzzfile")
		if err != nil {
			return
		}
		var h Handler
		_ = h.UnmarshalCaddyfile(caddyfile.NewDispenser(tokens))
	})
}
