package ratelimitredis

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func TestZZScratch(t *testing.T) {
	files, _ := filepath.Glob("docs/*.md")
	files = append([]string{"README.md"}, files...)
	for _, f := range files {
		b, _ := os.ReadFile(f)
		var block []string
		indent, start := "", 0
		for i, line := range strings.Split(string(b), "\n") {
			trimmed := strings.TrimSpace(line)
			switch {
			case block == nil && trimmed == "```caddyfile":
				indent = line[:len(line)-len(strings.TrimLeft(line, " \t"))]
				block, start = []string{}, i+2
			case block != nil && trimmed == "```":
				src := strings.Join(block, "\n") + "\n"
				block = nil
				if out := caddyfile.Format([]byte(src)); !bytes.Equal(out, []byte(src)) {
					t.Errorf("%s:%d: fmt differs:\n--- in\n%s--- out\n%s", f, start, src, out)
				}
				first := strings.Fields(src)[0]
				if !strings.ContainsAny(first, ".:") {
					var sb strings.Builder
					sb.WriteString("example.com {\n")
					for _, l := range strings.SplitAfter(src, "\n") {
						if strings.TrimSpace(l) != "" {
							sb.WriteString("\t")
						}
						sb.WriteString(l)
					}
					sb.WriteString("}\n")
					src = sb.String()
				}
				_, w, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), map[string]any{"filename": f})
				if err != nil || len(w) > 0 {
					t.Errorf("%s:%d: adapt %v %v", f, start, err, w)
				}
			case block != nil:
				block = append(block, strings.TrimPrefix(line, indent))
			}
		}
	}
}
