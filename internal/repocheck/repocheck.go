// Package repocheck checks the repository's files in its tests: the documentation's links and
// examples, the README's install recipe, Caddyfile.example's adapted JSON, the request path's
// code shape. The tests run from the repository's root (TestMain). DocBlocks reads the
// documentation's code blocks for them and for the module's tests.
package repocheck

import (
	"fmt"
	"os"
	"path/filepath"
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
