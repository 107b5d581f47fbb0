package repocheck

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// machinePhrase is the words with which a test excuses a bound it widened for a slow machine
// (written in two parts so that this file does not hold it).
const machinePhrase = "loaded" + " machine"

// machineTolerances are the test files that may still use machinePhrase, how many times, and
// why none of those uses races an assertion against the wall clock that a fake clock could
// drive. A count here never grows: a new test drives Handler.now or limiter Options.Clock (or
// Options.Now for the scripts), or states the bound it needs; a fixed one lowers its count.
var machineTolerances = map[string]struct {
	n      int
	reason string
}{
	"concurrency_test.go":           {2, "decision timeouts of 5s, so that no decision fails open: not bounds asserted"},
	"events_test.go":                {1, "a decision timeout of 10s, so that no decision fails open: not a bound asserted"},
	"redis_client_test.go":          {1, "a decision timeout of 1s for the bystander zone: not a bound asserted"},
	"redis_config_test.go":          {1, "a decision timeout of 2s: not a bound asserted"},
	"resolve_test.go":               {3, "two decision timeouts of 2s; Redis's cron shrinks its tables at its own pace, which no Go clock drives"},
	"e2e/headers_test.go":           {1, "a decision timeout of 2s in a Caddy config: not a bound asserted"},
	"e2e/reload_test.go":            {1, "a decision timeout of 2s in a Caddy config: not a bound asserted"},
	"e2e/sdk_test.go":               {2, "decision timeouts of 2s in Caddy configs: not bounds asserted"},
	"e2e/budget_test.go":            {1, "a decision timeout of 2s in a Caddy config: not a bound asserted"},
	"list_test.go":                  {1, "a dial timeout of 5s: not a bound asserted"},
	"lease_test.go":                 {1, "the grants a lease asks depend on the rate a real client shows through Caddy, which no fake clock sets"},
	"deploy/prometheus_e2e_test.go": {1, "Prometheus and Redis run as processes on their own clocks"},
	"waiting_test.go": {6, "the waiting room holds requests on real timers (Handler.now drives no timer): decision " +
		"timeouts, and upper bounds that catch a hold twice too long, not speed"},
}

// TestNoNewMachineTolerance: no test file uses machinePhrase more often than machineTolerances
// allows, and every count there is exact (a fixed tolerance lowers it).
func TestNoNewMachineTolerance(t *testing.T) {
	t.Parallel()
	got := map[string]int{}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata" || d.Name() == "bin") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if n := strings.Count(strings.ToLower(string(b)), machinePhrase); n > 0 {
			got[filepath.ToSlash(path)] = n
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for f, n := range got {
		if allowed := machineTolerances[f].n; n > allowed {
			t.Errorf("%s says %q %d times, %d allowed: drive the test with a fake clock (Handler.now, limiter Options.Clock) or state the bound it needs",
				f, machinePhrase, n, allowed)
		}
	}
	for f, a := range machineTolerances {
		if got[f] < a.n {
			t.Errorf("%s says %q %d times, machineTolerances allows %d: lower its count", f, machinePhrase, got[f], a.n)
		}
	}
}
