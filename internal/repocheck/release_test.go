package repocheck

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestReleaseCheck runs scripts/release-check.sh (`make release-check`) on a copy of the tree,
// where it must pass, and on copies with one defect each, where it must fail and name it.
func TestReleaseCheck(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go is not on PATH: the release check runs go mod tidy")
	}
	out, err := exec.Command("git", "ls-files", "-co", "--exclude-standard").Output()
	if err != nil {
		t.Skipf("git ls-files: %v: the tree to copy is not a git checkout", err)
	}
	files := strings.Fields(string(out))
	script, err := filepath.Abs("scripts/release-check.sh")
	if err != nil {
		t.Fatal(err)
	}
	edit := func(file string, change func(string) string) func(t *testing.T, dir string) {
		return func(t *testing.T, dir string) {
			p := filepath.Join(dir, file)
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			after := change(string(b))
			if after == string(b) {
				t.Fatalf("the defect changed nothing in %s", file)
			}
			if err := os.WriteFile(p, []byte(after), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	cases := []struct {
		name   string
		defect func(t *testing.T, dir string)
		want   string // in the output when it fails; empty when it must pass
	}{
		{name: "tree as it stands"},
		{
			name: "no CHANGELOG entry for the version",
			defect: func(t *testing.T, dir string) {
				edit("CHANGELOG.md", func(s string) string {
					// An empty section for 9.9.9 between Unreleased (and its entries) and the
					// newest release.
					u := strings.Index(s, "\n## [Unreleased]\n") + 1
					next := u + strings.Index(s[u+1:], "\n## [") + 1
					return s[:next] + "\n## [9.9.9] - 2030-01-01\n" + s[next:]
				})(t, dir)
			},
			want: "no entry for v9.9.9",
		},
		{
			name: "a replace directive in go.mod",
			defect: edit("go.mod", func(s string) string {
				return s + "\nreplace github.com/redis/go-redis/v9 => ../go-redis\n"
			}),
			want: "replace directive",
		},
		{
			name: "go.mod not tidy",
			defect: edit("go.mod", func(s string) string {
				return strings.Replace(s, "\tdario.cat/mergo v1.0.2 // indirect\n", "", 1)
			}),
			want: "go mod tidy would change",
		},
		{
			name: "no LICENSE",
			defect: func(t *testing.T, dir string) {
				if err := os.Remove(filepath.Join(dir, "LICENSE")); err != nil {
					t.Fatal(err)
				}
			},
			want: "LICENSE is missing",
		},
		{
			name: "docs saying the version is not published",
			defect: edit("README.md", func(s string) string {
				return s + "\nv0.1.0 is not published on the module proxy yet.\n"
			}),
			want: "README.md says v0.1.0 is not published",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			for _, f := range files {
				b, err := os.ReadFile(f)
				if err != nil {
					if os.IsNotExist(err) {
						continue // deleted in the work tree, still in the index
					}
					t.Fatal(err)
				}
				p := filepath.Join(dir, f)
				if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(p, b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if c.defect != nil {
				c.defect(t, dir)
			}
			cmd := exec.Command("bash", script)
			cmd.Dir = dir
			cmd.Env = append(os.Environ(), "VERSION=")
			out, err := cmd.CombinedOutput()
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("release-check fails on the tree: %v\n%s", err, out)
			case c.want != "" && err == nil:
				t.Fatalf("release-check passes with %s:\n%s", c.name, out)
			case c.want != "" && !strings.Contains(string(out), c.want):
				t.Fatalf("release-check fails without naming %q:\n%s", c.want, out)
			}
		})
	}
}

// TestReadmeFrontPage: README.md stays under 15,000 bytes, and its first screen (40 lines) names
// the licence, links LICENSE and gives the xcaddy build of a release.
func TestReadmeFrontPage(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if len(b) >= 15000 {
		t.Errorf("README.md is %d bytes, want under 15,000: move detail to docs/", len(b))
	}
	lines := strings.SplitN(string(b), "\n", 41)
	first := strings.Join(lines[:min(40, len(lines))], "\n")
	for _, want := range []string{"Apache License 2.0", "](LICENSE)", "xcaddy build --with\ngithub.com/rate-limit-redis/caddy-rate-limit-redis@v"} {
		if !strings.Contains(first, want) {
			t.Errorf("the first 40 lines of README.md do not contain %q", want)
		}
	}
}
