// Package e2e_test runs Caddy with the module in this process, configured only as a user would
// (a Caddyfile or JSON), against real redis-server processes (internal/redistest): limits,
// costs and keys through real HTTP, Redis failures and reloads under load, a Redis Cluster, the
// shipped examples and the cookbook's recipes, and the scripts of `make run` and `make smoke`. The tests run from the
// repository's root (TestMain).
package e2e_test

import (
	"fmt"
	"os"
	"testing"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/rate-limit-redis/caddy-rate-limit-redis"
)

// TestMain runs the tests from the repository's root, where the files some of them read are.
func TestMain(m *testing.M) {
	if err := os.Chdir(".."); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}
