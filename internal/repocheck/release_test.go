package repocheck

import (
	"cmp"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// releaseTree copies the files of the checkout (tracked and untracked, not ignored) into a new
// directory and makes it the tree of a release 9.9.9: CHANGELOG.md's Unreleased entries, if any,
// move into a section "## [9.9.9] - 2030-01-01" with one entry of its own. defect, when not nil,
// then changes the copy; with git set, the copy is then a git repository on main with one commit.
func releaseTree(t *testing.T, defect func(t *testing.T, dir string), git bool) string {
	t.Helper()
	out, err := exec.Command("git", "ls-files", "-co", "--exclude-standard").Output()
	if err != nil {
		t.Skipf("git ls-files: %v: the tree to copy is not a git checkout", err)
	}
	dir := t.TempDir()
	for _, f := range strings.Fields(string(out)) {
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
	editFile(t, dir, "CHANGELOG.md", func(s string) string {
		return strings.Replace(s, "## [Unreleased]\n", "## [Unreleased]\n\n## [9.9.9] - 2030-01-01\n\n### Added\n\n- A release made by a test.\n", 1)
	})
	if defect != nil {
		defect(t, dir)
	}
	if git {
		for _, args := range [][]string{{"init", "-q", "-b", "main"}, {"add", "-A"}, {"commit", "-q", "-m", "the release 9.9.9"}} {
			gitIn(t, dir, args...)
		}
	}
	return dir
}

// gitIn runs git with args in dir, as a committer of its own, and returns its output; it fails t
// when git fails.
func gitIn(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=release test", "GIT_AUTHOR_EMAIL=release@test",
		"GIT_COMMITTER_NAME=release test", "GIT_COMMITTER_EMAIL=release@test", "GIT_CONFIG_GLOBAL=/dev/null")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// editFile replaces the content of file in dir by change's result; it fails t when that changes
// nothing (the defect would not be there).
func editFile(t *testing.T, dir, file string, change func(string) string) {
	t.Helper()
	p := filepath.Join(dir, file)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	after := change(string(b))
	if after == string(b) {
		t.Fatalf("the change changed nothing in %s", file)
	}
	if err := os.WriteFile(p, []byte(after), 0o644); err != nil {
		t.Fatal(err)
	}
}

// runScript runs the script of scripts/ named in dir with the environment pairs env added and
// returns its combined output and error.
func runScript(t *testing.T, dir, name string, env ...string) (string, error) {
	t.Helper()
	script, err := filepath.Abs(filepath.Join("scripts", name))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", script)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), append([]string{"VERSION=", "GIT_CONFIG_GLOBAL=/dev/null",
		"GIT_AUTHOR_NAME=release test", "GIT_AUTHOR_EMAIL=release@test",
		"GIT_COMMITTER_NAME=release test", "GIT_COMMITTER_EMAIL=release@test"}, env...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestReleaseCheck runs scripts/release-check.sh (`make release-check`) on the tree of a dated
// release 9.9.9 in git (releaseTree), where it must pass, and on copies with one defect each,
// where it must fail and name it. Two of the defects are those of the tree before v0.1.0: its
// heading "not yet tagged" and the README's "until that tag exists" over two lines. The tests
// the check runs last are RELEASE_TEST_CMD, here `true` (or `false`, to see it fail).
func TestReleaseCheck(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go is not on PATH: the release check runs go mod tidy")
	}
	edit := func(file string, change func(string) string) func(t *testing.T, dir string) {
		return func(t *testing.T, dir string) { editFile(t, dir, file, change) }
	}
	cases := []struct {
		name   string
		defect func(t *testing.T, dir string)
		noGit  bool
		tests  string // RELEASE_TEST_CMD; true when empty
		want   string // in the output when it fails; empty when it must pass
	}{
		{name: "the dated release tree"},
		{
			name: "an undated heading",
			defect: edit("CHANGELOG.md", func(s string) string {
				return strings.Replace(s, "## [9.9.9] - 2030-01-01", "## [9.9.9] - not yet tagged", 1)
			}),
			want: "heading of v9.9.9 is not dated",
		},
		{
			name: "an entry left under Unreleased",
			defect: edit("CHANGELOG.md", func(s string) string {
				return strings.Replace(s, "## [Unreleased]\n", "## [Unreleased]\n\n### Fixed\n\n- A fix after the release.\n", 1)
			}),
			want: "1 entries under Unreleased",
		},
		{
			name: "no CHANGELOG entry for the version",
			defect: edit("CHANGELOG.md", func(s string) string {
				return strings.Replace(s, "## [9.9.9] - 2030-01-01\n\n### Added\n\n- A release made by a test.\n",
					"## [9.9.9] - 2030-01-01\n\n## [9.9.8] - 2029-01-01\n\n### Added\n\n- A release made by a test.\n", 1)
			}),
			want: "no entry for v9.9.9",
		},
		{
			name: "the README saying the release is still to come, over two lines",
			defect: edit("README.md", func(s string) string {
				return s + "\nxcaddy builds v9.9.9 with the module, and until that\ntag exists Caddy is built from a checkout.\n"
			}),
			want: "README.md says a release is still to come",
		},
		{
			name: "docs saying the version is not published",
			defect: edit("docs/operations.md", func(s string) string {
				return s + "\nv9.9.9 is not published on the module proxy yet.\n"
			}),
			want: "docs/operations.md says a release is still to come",
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
		{name: "not a git tree", noGit: true, want: "not a git work tree"},
		{name: "red tests", tests: "false", want: "the tests failed (false)"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dir := releaseTree(t, c.defect, !c.noGit)
			tests := cmp.Or(c.tests, "true")
			out, err := runScript(t, dir, "release-check.sh", "RELEASE_TEST_CMD="+tests)
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("release-check fails on the tree: %v\n%s", err, out)
			case c.want != "" && err == nil:
				t.Fatalf("release-check passes with %s:\n%s", c.name, out)
			case c.want != "" && !strings.Contains(out, c.want):
				t.Fatalf("release-check fails without naming %q:\n%s", c.want, out)
			}
		})
	}
	t.Run("the tag already there", func(t *testing.T) {
		t.Parallel()
		dir := releaseTree(t, nil, true)
		gitIn(t, dir, "tag", "v9.9.9")
		out, err := runScript(t, dir, "release-check.sh", "RELEASE_TEST_CMD=true")
		if err == nil || !strings.Contains(out, "the tag v9.9.9 already exists") {
			t.Fatalf("release-check with the tag there: %v, want it to fail naming the tag:\n%s", err, out)
		}
	})
}

// TestRelease runs scripts/release.sh (`make release`) on the release tree 9.9.9 on main: it
// makes the annotated tag v9.9.9 whose message is the version's CHANGELOG section. On a tree with
// uncommitted changes, or on another branch, it fails and makes no tag.
func TestRelease(t *testing.T) {
	t.Parallel()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go is not on PATH: the release check runs go mod tidy")
	}
	t.Run("clean main", func(t *testing.T) {
		t.Parallel()
		dir := releaseTree(t, nil, true)
		out, err := runScript(t, dir, "release.sh", "RELEASE_TEST_CMD=true")
		if err != nil {
			t.Fatalf("release: %v\n%s", err, out)
		}
		if typ := strings.TrimSpace(gitIn(t, dir, "cat-file", "-t", "v9.9.9")); typ != "tag" {
			t.Fatalf("v9.9.9 is a %q, want an annotated tag", typ)
		}
		msg := gitIn(t, dir, "tag", "-l", "--format=%(contents)", "v9.9.9")
		if !strings.HasPrefix(msg, "## [9.9.9] - 2030-01-01\n") || !strings.Contains(msg, "- A release made by a test.") ||
			strings.Contains(msg, "## [0.1.0]") {
			t.Fatalf("the tag's message is not the 9.9.9 section of CHANGELOG.md:\n%s", msg)
		}
		if !strings.Contains(out, "git push origin v9.9.9") {
			t.Errorf("release does not print the push to run:\n%s", out)
		}
	})
	for _, c := range []struct {
		name, want string
		change     func(t *testing.T, dir string)
	}{
		{"uncommitted changes", "not committed", func(t *testing.T, dir string) {
			editFile(t, dir, "README.md", func(s string) string { return s + "\nA change.\n" })
		}},
		{"another branch", "tagged on main", func(t *testing.T, dir string) { gitIn(t, dir, "checkout", "-q", "-b", "topic") }},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dir := releaseTree(t, nil, true)
			c.change(t, dir)
			out, err := runScript(t, dir, "release.sh", "RELEASE_TEST_CMD=true")
			if err == nil || !strings.Contains(out, c.want) {
				t.Fatalf("release with %s: %v, want it to fail naming %q:\n%s", c.name, err, c.want, out)
			}
			if tags := gitIn(t, dir, "tag"); tags != "" {
				t.Fatalf("release with %s made tags %q", c.name, tags)
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
