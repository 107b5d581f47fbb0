package ratelimitredis

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
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
