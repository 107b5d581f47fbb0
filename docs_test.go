package ratelimitredis

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// markdownLink is a Markdown link's target: [text](target).
var markdownLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// TestDocLinks: every relative link in README.md and docs/*.md names a file that exists, and
// every #anchor a heading of that file (GitHub's anchors: lower case, punctuation dropped,
// spaces as hyphens, -1, -2 … for repeated headings). Links to other sites are not followed.
func TestDocLinks(t *testing.T) {
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

// TestDocCaddyfilesAdapt: every Caddyfile example of README.md and docs/*.md adapts, so an
// example copied from the manual parses. A block that is a site's contents (it does not start
// with a site address) is adapted inside a site; the syntax summary (rate_limit_redis
// [<matcher>]) is not a Caddyfile.
func TestDocCaddyfilesAdapt(t *testing.T) {
	files, _ := filepath.Glob("docs/*.md")
	files = append([]string{"README.md"}, files...)
	n := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var block []string
		indent, start := "", 0
		for i, line := range strings.Split(string(b), "\n") {
			trimmed := strings.TrimSpace(line)
			switch {
			case block == nil && trimmed == "```caddyfile":
				indent = line[:len(line)-len(strings.TrimLeft(line, " \t"))]
				block, start = []string{}, i+2
			case block != nil && trimmed == "```":
				n++
				src := strings.Join(block, "\n") + "\n"
				block = nil
				first := strings.Fields(src)[0]
				if strings.HasPrefix(src, "rate_limit_redis [<matcher>]") {
					continue
				}
				if !strings.ContainsAny(first, ".:") {
					src = "example.com {\n" + src + "}\n"
				}
				if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), map[string]any{"filename": f}); err != nil {
					t.Errorf("%s:%d: the Caddyfile example does not adapt: %v\n%s", f, start, err, src)
				}
			case block != nil:
				block = append(block, strings.TrimPrefix(line, indent))
			}
		}
	}
	if n < 10 {
		t.Fatalf("found %d Caddyfile examples in README.md and docs/*.md, expected more", n)
	}
}

// TestDocumentedACL: the ACL docs/security.md tells operators to give the limiter is redisACL's,
// line for line (each on a line of its own), and no other: the one derived from redisUses, which
// TestRedisACL, TestRedisACLCluster and TestTLSAndACL prove sufficient.
func TestDocumentedACL(t *testing.T) {
	b, err := os.ReadFile("docs/security.md")
	if err != nil {
		t.Fatal(err)
	}
	var documented []string
	for _, line := range strings.Split(string(b), "\n") {
		if line = strings.TrimSpace(line); strings.HasPrefix(line, "ACL SETUSER") {
			documented = append(documented, line)
		}
	}
	if want := redisACL("limiter", "password", "rl:"); !slices.Equal(documented, want) {
		t.Errorf("docs/security.md gives the ACL\n%s\nwant, derived from redisUses (acl.go):\n%s",
			strings.Join(documented, "\n"), strings.Join(want, "\n"))
	}
}

// TestReadmeCaddyfilesAreTheReferences: the README's Caddyfile blocks (the example and the
// syntax) are copies of those of docs/caddyfile.md, so a change to the directive updated in the
// reference cannot leave a stale summary on the front page.
func TestReadmeCaddyfilesAreTheReferences(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	reference, err := os.ReadFile("docs/caddyfile.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := strings.Split(string(readme), "```caddyfile\n")[1:]
	if len(blocks) == 0 {
		t.Fatal("README.md has no Caddyfile block")
	}
	for _, b := range blocks {
		block, _, _ := strings.Cut(b, "```\n")
		if !strings.Contains(string(reference), "```caddyfile\n"+block+"```\n") {
			t.Errorf("this Caddyfile block of README.md is not in docs/caddyfile.md:\n%s", block)
		}
	}
}
