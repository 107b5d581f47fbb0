package repocheck

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestScriptsNoEarlyExitUnderPipefail: no shell script that sets pipefail pipes a command into
// `grep -q` (or through `head`), since grep exits at its first match and the writer's SIGPIPE
// then fails the pipeline at random: CI once failed on `bin/caddy list-modules | grep -qx ...`
// after caddy-l4 made the list long. Read the output into a variable and grep a here-string.
func TestScriptsNoEarlyExitUnderPipefail(t *testing.T) {
	t.Parallel()
	files, _ := filepath.Glob("scripts/*.sh")
	files = append(files, ".ci/run")
	early := regexp.MustCompile(`\|\s*(grep\s+-\w*q|head\b)`)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), "pipefail") {
			continue
		}
		for i, line := range strings.Split(string(b), "\n") {
			code := strings.TrimSpace(line)
			if !strings.HasPrefix(code, "#") && !strings.HasPrefix(code, "head -1 <<<") && early.MatchString(code) {
				t.Errorf("%s:%d pipes into an early exit under pipefail: %s", f, i+1, strings.TrimSpace(line))
			}
		}
	}
}
