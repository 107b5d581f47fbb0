// Package repocheck checks the repository's files in its tests: the documentation's links and
// examples, the README's install recipe, Caddyfile.example's adapted JSON, the request path's
// code shape. The tests run from the repository's root (TestMain). DocBlocks reads the
// documentation's code blocks for them and for the module's tests.
package repocheck

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// DocBlock is a fenced code block of the documentation.
type DocBlock struct {
	Where string // file:line of its first line
	Text  string // its lines, the list indentation of its fence removed, each ending in \n
}

// DocBlocks returns the code blocks of README.md and docs/*.md, relative to the working
// directory (the repository's root), fenced as ```lang, in the files' order; it fails t when a
// file cannot be read.
func DocBlocks(t testing.TB, lang string) []DocBlock {
	t.Helper()
	files, _ := filepath.Glob("docs/*.md")
	files = append([]string{"README.md"}, files...)
	var blocks []DocBlock
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var lines []string
		inBlock, indent, start := false, "", 0
		for i, line := range strings.Split(string(b), "\n") {
			trimmed := strings.TrimSpace(line)
			switch {
			case !inBlock && trimmed == "```"+lang:
				indent = line[:len(line)-len(strings.TrimLeft(line, " \t"))]
				inBlock, lines, start = true, nil, i+2
			case inBlock && trimmed == "```":
				inBlock = false
				blocks = append(blocks, DocBlock{Where: fmt.Sprintf("%s:%d", f, start), Text: strings.Join(lines, "\n") + "\n"})
			case inBlock:
				lines = append(lines, strings.TrimPrefix(line, indent))
			}
		}
	}
	return blocks
}

// Cookbook is the page of complete recipes, one per "## " heading.
const Cookbook = "docs/cookbook.md"

// Recipe is one recipe of the cookbook: its heading (without the "## ") and its ```caddyfile
// blocks (DocBlocks' form, Where naming the cookbook's line).
type Recipe struct {
	Heading string
	Blocks  []DocBlock
}

// Recipes returns the recipes of docs/cookbook.md in the page's order: each "## " heading and
// the ```caddyfile blocks under it, before the next heading. It fails t when the page cannot be
// read.
func Recipes(t testing.TB) []Recipe {
	t.Helper()
	b, err := os.ReadFile(Cookbook)
	if err != nil {
		t.Fatal(err)
	}
	var headings []int // the line (1-based) of each "## " heading
	var recipes []Recipe
	inFence := false
	for i, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
		}
		if !inFence && strings.HasPrefix(line, "## ") {
			headings = append(headings, i+1)
			recipes = append(recipes, Recipe{Heading: strings.TrimPrefix(line, "## ")})
		}
	}
	for _, block := range DocBlocks(t, "caddyfile") {
		file, at, _ := strings.Cut(block.Where, ":")
		line, err := strconv.Atoi(at)
		if file != Cookbook || err != nil {
			continue
		}
		for i := len(headings) - 1; i >= 0; i-- {
			if headings[i] < line {
				recipes[i].Blocks = append(recipes[i].Blocks, block)
				break
			}
		}
	}
	return recipes
}
