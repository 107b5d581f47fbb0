package repocheck

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// markdownLink is a Markdown link's target: [text](target).
var markdownLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// TestDocLinks: every relative link in README.md and docs/*.md names a file that exists, and
// every #anchor a heading of that file (GitHub's anchors: lower case, punctuation dropped,
// spaces as hyphens, -1, -2 … for repeated headings). Links to other sites are not followed.
func TestDocLinks(t *testing.T) {
	t.Parallel()
	files, _ := filepath.Glob("docs/*.md")
	files = append([]string{"README.md"}, files...)
	anchors := map[string]map[string]bool{}
	for _, f := range files {
		anchors[filepath.Clean(f)] = headingAnchors(t, f)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		inFence := false
		for n, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "```") {
				inFence = !inFence
			}
			if inFence {
				continue
			}
			for _, m := range markdownLink.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				path, anchor, _ := strings.Cut(target, "#")
				file := filepath.Clean(f)
				if path != "" {
					file = filepath.Clean(filepath.Join(filepath.Dir(f), path))
					if _, err := os.Stat(file); err != nil {
						t.Errorf("%s:%d: link %q: no file %s", f, n+1, target, file)
						continue
					}
				}
				if anchor == "" {
					continue
				}
				as, ok := anchors[file]
				if !ok {
					as = headingAnchors(t, file)
					anchors[file] = as
				}
				if !as[anchor] {
					t.Errorf("%s:%d: link %q: %s has no heading #%s", f, n+1, target, file, anchor)
				}
			}
		}
	}
}

// headingAnchors returns the GitHub anchors of the headings of a Markdown file (none for a file
// of another kind).
func headingAnchors(t *testing.T, file string) map[string]bool {
	t.Helper()
	as := map[string]bool{}
	if !strings.HasSuffix(file, ".md") {
		return as
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	inFence := false
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
		}
		if inFence || !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var slug strings.Builder
		for _, r := range strings.ToLower(h) {
			switch {
			case r == ' ':
				slug.WriteRune('-')
			case r == '-' || r == '_' || ('a' <= r && r <= 'z') || ('0' <= r && r <= '9') || r > 127:
				slug.WriteRune(r)
			}
		}
		a := slug.String()
		if n := seen[a]; n > 0 {
			as[a+"-"+strconv.Itoa(n)] = true
		} else {
			as[a] = true
		}
		seen[a]++
	}
	return as
}

// TestReadmeListsEveryDocPage: the README is the manual's front door, so it links every page of
// docs/.
func TestReadmeListsEveryDocPage(t *testing.T) {
	t.Parallel()
	pages, err := filepath.Glob("docs/*.md")
	if err != nil || len(pages) == 0 {
		t.Fatalf("no docs/*.md (%v)", err)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pages {
		if !strings.Contains(string(readme), "]("+filepath.ToSlash(p)+")") {
			t.Errorf("README.md does not link %s", p)
		}
	}
}

// TestDocCaddyfilesFormatAndAdapt: every ```caddyfile block of README.md and docs/*.md, and
// Caddyfile.example and deploy/Caddyfile, is as
// `caddy fmt` writes it (caddyfile.Format, what `caddy fmt` runs, changes nothing) and adapts as
// `caddy adapt` would, with no error, no warning returned and no line logged at WARN or above, so an example copied from the manual
// parses, and `caddy run` does not warn that it is not formatted. A block that is a site's
// contents (it does not start with a site address or the global options) is adapted indented
// inside a site. The directive's syntax summary is not a Caddyfile: it is a ```text block.
func TestDocCaddyfilesFormatAndAdapt(t *testing.T) {
	t.Parallel()
	blocks := DocBlocks(t, "caddyfile")
	if len(blocks) < 10 {
		t.Fatalf("found %d Caddyfile examples in README.md and docs/*.md, expected more", len(blocks))
	}
	for _, f := range []string{"Caddyfile.example", "deploy/Caddyfile"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		blocks = append(blocks, DocBlock{Where: f, Text: string(b)})
	}
	for _, b := range blocks {
		if formatted := string(caddyfile.Format([]byte(b.Text))); formatted != b.Text {
			t.Errorf("%s: the Caddyfile example is not as `caddy fmt` writes it; it would be:\n%s", b.Where, formatted)
		}
		src := b.Text
		if first := firstToken(src); first != "{" && !strings.ContainsAny(first, ".:") {
			var site strings.Builder
			site.WriteString("example.com {\n")
			for _, line := range strings.SplitAfter(src, "\n") {
				if strings.TrimSpace(line) != "" {
					site.WriteString("\t")
				}
				site.WriteString(line)
			}
			site.WriteString("}\n")
			src = site.String()
		}
		_, warnings, logged, err := adaptLogged([]byte(src), b.Where)
		if err != nil {
			t.Errorf("%s: the Caddyfile example does not adapt: %v\n%s", b.Where, err, src)
		}
		for _, w := range warnings {
			t.Errorf("%s: adapting the Caddyfile example warns: %s\n%s", b.Where, w, src)
		}
		for _, l := range logged {
			t.Errorf("%s: adapting the Caddyfile example logs %s\n%s", b.Where, l, src)
		}
	}
}

// firstToken returns the first word of a Caddyfile that is not in a comment.
func firstToken(src string) string {
	for line := range strings.SplitSeq(src, "\n") {
		if f := strings.Fields(line); len(f) > 0 && !strings.HasPrefix(f[0], "#") {
			return f[0]
		}
	}
	return ""
}

// TestReadmeCaddyfilesAreTheReferences: the README's Caddyfile blocks (the example, and a syntax
// summary in a ```text block if it has one) are copies of those of docs/caddyfile.md, so a change
// to the directive updated in the reference cannot leave a stale summary on the front page.
func TestReadmeCaddyfilesAreTheReferences(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	reference, err := os.ReadFile("docs/caddyfile.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, lang := range []string{"caddyfile", "text"} {
		blocks := strings.Split(string(readme), "```"+lang+"\n")[1:]
		if len(blocks) == 0 && lang == "caddyfile" {
			t.Fatalf("README.md has no %s block", lang)
		}
		for _, b := range blocks {
			block, _, _ := strings.Cut(b, "```\n")
			if !strings.Contains(string(reference), "```"+lang+"\n"+block+"```\n") {
				t.Errorf("this %s block of README.md is not in docs/caddyfile.md:\n%s", lang, block)
			}
		}
	}
}

// TestReadmeInstall: the README's from-checkout build command is the recipe of `make build`
// (which `make test` and .ci/run run), the Dockerfile builds with the same --with, and the
// published-module form of xcaddy, which cannot work before a release, appears only in a block
// that says so. With CADDY_BINARY (the bin/caddy `make build` wrote), it lists the modules the
// README says it lists.
func TestReadmeInstall(t *testing.T) {
	t.Parallel()
	makefile, err := os.ReadFile("Makefile")
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^([A-Z0-9_]+)\s*[?:]=\s*(\S+)\s*$`).FindAllStringSubmatch(string(makefile), -1) {
		vars[m[1]] = m[2]
	}
	recipe := regexp.MustCompile(`(?m)^bin/caddy:.*\n\t(.*)$`).FindStringSubmatch(string(makefile))
	if recipe == nil {
		t.Fatal("Makefile has no bin/caddy rule with a recipe")
	}
	expand := func(s string) string {
		return regexp.MustCompile(`\$\(([A-Z0-9_]+)\)`).ReplaceAllStringFunc(s, func(v string) string {
			val, ok := vars[v[2:len(v)-1]]
			if !ok {
				t.Fatalf("Makefile: %s is not set by an assignment", v)
			}
			return val
		})
	}
	build := expand(recipe[1])

	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, install, _ := strings.Cut(string(readme), "\n## Install\n")
	install, _, _ = strings.Cut(install, "\n## ")
	if !strings.Contains(install, "```sh\nmake build ") {
		t.Error("README.md's Install does not begin the from-checkout build with make build")
	}
	found := false
	for _, b := range DocBlocks(t, "sh") {
		for line := range strings.SplitSeq(b.Text, "\n") {
			switch {
			case strings.HasPrefix(line, "go tool xcaddy build") || strings.Contains(line, "' go tool xcaddy build"):
				found = true
				if line != build {
					t.Errorf("%s: the from-checkout command is not what make build runs:\n%s\nMakefile:\n%s", b.Where, line, build)
				}
			case strings.HasPrefix(line, "xcaddy build --with "+vars["MODULE"]) && !strings.HasPrefix(b.Text, "# the published-module form: it works only after a release"):
				t.Errorf("%s: %q needs the module on the module proxy: mark its block as the published-module form", b.Where, line)
			}
		}
	}
	if !found {
		t.Error("README.md gives no `go tool xcaddy build` command")
	}
	dockerfile, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	if with := "--with \"" + vars["MODULE"] + "@" + vars["LOCAL_VERSION"] + "=/src\""; !strings.Contains(string(dockerfile), with) {
		t.Errorf("the Dockerfile does not build with %s", with)
	}

	caddyBin := os.Getenv("CADDY_BINARY")
	if caddyBin == "" {
		t.Log("CADDY_BINARY is not set: bin/caddy list-modules not checked (make test sets it)")
		return
	}
	out, err := exec.Command(caddyBin, "list-modules").Output()
	if err != nil {
		t.Fatalf("%s list-modules: %v", caddyBin, err)
	}
	for _, m := range []string{"http.handlers.rate_limit_redis", "admin.api.rate_limit_redis", "layer4.handlers.rate_limit_redis"} {
		if !slices.Contains(strings.Split(string(out), "\n"), m) {
			t.Errorf("%s list-modules does not list %s", caddyBin, m)
		}
	}
}

// trackerCitations are the ways a page could cite what its readers cannot see: the project's
// issues (issue 31, issue #31, #31 not after a repository's name), its reviews and their
// findings (finding 3, F10, S3), and its design document.
var trackerCitations = regexp.MustCompile(`(?i)\bissues?\s+#?\d+|(^|[^\w/.-])#\d+\b|\breview(s|'s|ed)?\b|\bfindings?\s+#?\d+|\b[FS]\d{1,2}\b|(?-i:\bDESIGN\b)`)

// TestDocsCiteNoTrackers: README.md and the pages under docs/ speak to the module's users, who
// cannot see the project's issues, reviews or design document: no page cites one.
func TestDocsCiteNoTrackers(t *testing.T) {
	files, _ := filepath.Glob("docs/*.md")
	for _, f := range append([]string{"README.md"}, files...) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for n, line := range strings.Split(string(b), "\n") {
			if m := trackerCitations.FindString(line); m != "" {
				t.Errorf("%s:%d cites %q, which a reader cannot see: say what it stands for instead:\n\t%s", f, n+1, strings.TrimSpace(m), line)
			}
		}
	}
}

// testNames are the ways a page could name the project's tests: a Go test, fuzz target or
// benchmark (TestXxx, FuzzXxx, BenchmarkXxx), a test file (xxx_test.go), or "the test".
var testNames = regexp.MustCompile(`\b(Test|Fuzz|Benchmark)[A-Z]\w*|\w+_test\.go\b|(?i:\bthe test\b)`)

// TestDocsNameNoTests: README.md and the pages under docs/ speak to the module's users, so they
// say what the module does, not which test checks it: test names belong in docs/development.md,
// which lists the tests behind the other pages' claims.
func TestDocsNameNoTests(t *testing.T) {
	t.Parallel()
	files, _ := filepath.Glob("docs/*.md")
	for _, f := range append([]string{"README.md"}, files...) {
		if f == "docs/development.md" {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for n, line := range strings.Split(string(b), "\n") {
			if m := testNames.FindString(line); m != "" {
				t.Errorf("%s:%d names the test %q: say what it shows, and list the test in docs/development.md:\n\t%s", f, n+1, m, line)
			}
		}
	}
}

// TestDevelopmentNamesRealTests: every test, fuzz target or benchmark that docs/development.md
// names is a function of a _test.go file of the repository (a name ending in "…" is the prefix
// of a family of them), so the list of the tests behind the docs cannot name one that is gone.
func TestDevelopmentNamesRealTests(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("docs/development.md")
	if err != nil {
		t.Fatal(err)
	}
	var funcs strings.Builder
	err = filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return err
		}
		b, err := os.ReadFile(path)
		funcs.Write(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile(`\b((?:Test|Fuzz|Benchmark)[A-Z]\w*)(…?)`).FindAllStringSubmatch(string(doc), -1) {
		name := "func " + m[1]
		if m[2] == "" {
			name += "("
		}
		if !strings.Contains(funcs.String(), name) {
			t.Errorf("docs/development.md names %s%s, which no _test.go file defines", m[1], m[2])
		}
	}
}
