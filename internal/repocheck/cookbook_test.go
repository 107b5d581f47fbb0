package repocheck

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// zoneName is a zone's name in a Caddyfile: `zone <name> {`.
var zoneName = regexp.MustCompile(`(?m)^\s*zone (\S+) \{`)

// TestCookbookRecipes: docs/cookbook.md has exactly ten recipes (its "## " headings), each with
// exactly one ```caddyfile block, which adapts with no warning (TestDocCaddyfilesFormatAndAdapt
// adapts it as written; here it is adapted as a whole Caddyfile, since a recipe is complete),
// whose zone names no other recipe uses, listed in the page's contents, and the README links the
// cookbook before any other page of docs/ and first in its table of pages.
func TestCookbookRecipes(t *testing.T) {
	t.Parallel()
	recipes := Recipes(t)
	if len(recipes) != 10 {
		t.Errorf("%s has %d recipes (## headings), want 10", Cookbook, len(recipes))
	}
	page, err := os.ReadFile(Cookbook)
	if err != nil {
		t.Fatal(err)
	}
	anchors := headingAnchors(t, Cookbook)
	zones := map[string]string{} // zone name → the recipe that uses it
	for _, r := range recipes {
		if len(r.Blocks) != 1 {
			t.Errorf("recipe %q has %d caddyfile blocks, want 1", r.Heading, len(r.Blocks))
			continue
		}
		b := r.Blocks[0]
		if first := firstToken(b.Text); first != "{" && !strings.ContainsAny(first, ".:") {
			t.Errorf("%s: recipe %q is not a complete Caddyfile (it starts with %q, not a site address)", b.Where, r.Heading, first)
		}
		_, warnings, logged, err := adaptLogged([]byte(b.Text), b.Where)
		if err != nil || len(warnings) > 0 || len(logged) > 0 {
			t.Errorf("%s: recipe %q: adapting: %v; warnings %v; logged %v", b.Where, r.Heading, err, warnings, logged)
		}
		names := zoneName.FindAllStringSubmatch(b.Text, -1)
		if len(names) == 0 {
			t.Errorf("%s: recipe %q has no zone", b.Where, r.Heading)
		}
		for _, m := range names {
			if other, ok := zones[m[1]]; ok && other != r.Heading {
				t.Errorf("%s: zone %s of recipe %q is also a zone of recipe %q", b.Where, m[1], r.Heading, other)
			}
			zones[m[1]] = r.Heading
		}
		var anchor string
		for a := range headingAnchors(t, writeHeading(t, r.Heading)) {
			anchor = a
		}
		if !anchors[anchor] || !strings.Contains(string(page), "](#"+anchor+")") {
			t.Errorf("%s's contents do not link recipe %q (#%s)", Cookbook, r.Heading, anchor)
		}
	}

	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if first := regexp.MustCompile(`\]\((docs/[^)#]+)`).FindSubmatch(readme); first == nil || string(first[1]) != Cookbook {
		t.Errorf("the first page of docs/ that README.md links is %q, want %s", first, Cookbook)
	}
	_, docs, _ := strings.Cut(string(readme), "\n## Documentation\n")
	if firstRow := regexp.MustCompile(`(?m)^\| \[[^]]+\]\(([^)]+)\)`).FindStringSubmatch(docs); firstRow == nil || firstRow[1] != Cookbook {
		t.Errorf("the first row of README.md's Documentation table is %v, want a link to %s", firstRow, Cookbook)
	}
}

// writeHeading writes a Markdown file of the one heading h and returns its path, so that
// headingAnchors gives h's anchor.
func writeHeading(t *testing.T, h string) string {
	t.Helper()
	f := t.TempDir() + "/h.md"
	if err := os.WriteFile(f, []byte("## "+h+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return f
}
