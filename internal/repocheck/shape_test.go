package repocheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"testing"
)

// longFunctionFiles are the files whose functions may be longer than 60 lines, with the reason.
// Every other non-test Go file of the root, of internal/* and of adminapi is held to 60 lines.
var longFunctionFiles = map[string]string{
	"adminapi/override.go":            "handleOverride answers every method of the overrides endpoint",
	"module.go":                       "Handler.Provision sets up every part of the handler in turn",
	"zone.go":                         "Zone.provision resolves every option of a zone",
	"internal/limiter/charge.go":      "Settle settles every kind of hold in one pass",
	"internal/limiter/cluster.go":     "allowSlots sends the calls of every hash slot and merges their replies",
	"internal/limiter/concurrency.go": "refreshLive renews every live slot in batches",
	"internal/limiter/local.go":       "Local.Allow decides every algorithm under one lock",
	"internal/limiter/state.go":       "counterState reads both window counters",
	"internal/usage/scanner.go":       "scanJSON is the JSON scanner's state machine",
	"internal/caddytest/caddytest.go": "a test helper: LoadServing loads a config and waits for it to serve alone",
	"internal/redistest/dropproxy.go": "a test helper: serve relays a connection and drops its replies on demand",
}

// TestFunctionsAreShort: every function of the root package, of internal/* and of adminapi,
// outside longFunctionFiles, can be taken in at a glance, 60 lines at most.
func TestFunctionsAreShort(t *testing.T) {
	t.Parallel()
	const maxLines = 60
	dirs, err := filepath.Glob("internal/*")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	for _, dir := range append([]string{".", "adminapi"}, dirs...) {
		for _, f := range goFiles(t, dir) {
			name := filepath.Join(dir, f)
			if _, ok := longFunctionFiles[name]; ok {
				continue
			}
			file, err := parser.ParseFile(fset, name, nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			for _, decl := range file.Decls {
				fn, ok := decl.(*ast.FuncDecl)
				if !ok || fn.Body == nil {
					continue
				}
				if n := fset.Position(fn.End()).Line - fset.Position(fn.Pos()).Line + 1; n > maxLines {
					t.Errorf("%s: %s is %d lines, more than %d", name, fn.Name.Name, n, maxLines)
				}
			}
		}
	}
}
