package repocheck

import (
	"fmt"
	"os"
	"testing"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
	_ "github.com/mholt/caddy-l4" // every caddy-l4 module, as make build has them

	_ "github.com/rate-limit-redis/caddy-rate-limit-redis"
	_ "github.com/rate-limit-redis/caddy-rate-limit-redis/l4"
)

// TestMain runs the tests from the repository's root, where the files they check are.
func TestMain(m *testing.M) {
	if err := os.Chdir("../.."); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}
