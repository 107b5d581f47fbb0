package repocheck

import (
	"fmt"
	"os"
	"testing"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/rate-limit-redis/caddy-rate-limit-redis"
)

// TestMain runs the tests from the repository's root, where the files they check are.
func TestMain(m *testing.M) {
	if err := os.Chdir("../.."); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}
