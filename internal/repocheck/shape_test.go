package repocheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"testing"
)

// requestPathFiles are the files of a request's way through ServeHTTP, in the order of its
// stages (see ServeHTTP), with what they call on the way.
var requestPathFiles = []string{"handler.go", "resolve.go", "decide.go", "headers.go", "admit.go", "deny.go",
	"charge.go", "waiting.go", "placeholders.go", "number.go", "breaker.go", "internal/clientip/clientip.go",
	"internal/limiter/limiter.go", "internal/limiter/batcher.go", "internal/limiter/script.go", "internal/limiter/deadline.go", "internal/limiter/lease.go"}

// TestRequestPathFunctionsAreShort: every function of the request path can be taken in at a
// glance, 60 lines at most.
func TestRequestPathFunctionsAreShort(t *testing.T) {
	t.Parallel()
	const maxLines = 60
	fset := token.NewFileSet()
	for _, name := range requestPathFiles {
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range f.Decls {
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
