package repocheck

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestLayoutNamesEveryFile: docs/development.md's "Layout" section names every non-test Go
// file of the root package as `name.go`, and every one of internal/<pkg> and adminapi as
// `name.go` in a paragraph or list item that names `internal/<pkg>/` (`adminapi/`).
func TestLayoutNamesEveryFile(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("docs/development.md")
	if err != nil {
		t.Fatal(err)
	}
	layout := section(t, string(doc), "## Layout")
	blocks := regexp.MustCompile(`\n(?:\s*\n|- )`).Split(layout, -1)
	for _, f := range goFiles(t, ".") {
		if !strings.Contains(layout, "`"+f+"`") {
			t.Errorf("docs/development.md (Layout) does not name the root's %s", f)
		}
	}
	dirs, err := filepath.Glob("internal/*")
	if err != nil {
		t.Fatal(err)
	}
	for _, dir := range append(dirs, "adminapi") {
		for _, f := range goFiles(t, dir) {
			named := false
			for _, b := range blocks {
				named = named || strings.Contains(b, "`"+dir+"/`") && strings.Contains(b, "`"+f+"`")
			}
			if !named {
				t.Errorf("docs/development.md (Layout) does not name %s/%s beside `%s/`", dir, f, dir)
			}
		}
	}
}

// section returns the text of doc from the heading to the next heading of its level.
func section(t *testing.T, doc, heading string) string {
	t.Helper()
	_, rest, ok := strings.Cut(doc, "\n"+heading+"\n")
	if !ok {
		t.Fatalf("no %q heading", heading)
	}
	level := heading[:strings.Index(heading, " ")+1]
	if i := strings.Index(rest, "\n"+level); i >= 0 {
		rest = rest[:i]
	}
	return rest
}

// goFiles lists the non-test Go files of dir.
func goFiles(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if n := e.Name(); !e.IsDir() && strings.HasSuffix(n, ".go") && !strings.HasSuffix(n, "_test.go") {
			out = append(out, n)
		}
	}
	return out
}
