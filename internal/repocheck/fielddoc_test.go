package repocheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// configStructs are the module's config types, by file: the structs whose JSON fields a user
// writes, and from whose doc comments caddyserver.com generates the module's JSON reference.
var configStructs = map[string][]string{
	"module.go":       {"Handler"},
	"zone.go":         {"Zone"},
	"redis_config.go": {"RedisConfig", "TLSConfig"},
	"charge.go":       {"Charge", "ChargeWeights"},
	"lease.go":        {"Lease"},
}

// defaultOrRequired is how a field's doc comment says what applies when the field is left out.
var defaultOrRequired = regexp.MustCompile(`\bDefault\b|\b[Rr]equired\b`)

// TestConfigFieldsDocumented: every exported field with a json tag of the config structs has a
// doc comment, and the comment says its default or that it is required.
func TestConfigFieldsDocumented(t *testing.T) {
	t.Parallel()
	fset := token.NewFileSet()
	for file, types := range configStructs {
		f, err := parser.ParseFile(fset, file, nil, parser.ParseComments)
		if err != nil {
			t.Fatal(err)
		}
		found := map[string]bool{}
		ast.Inspect(f, func(n ast.Node) bool {
			ts, ok := n.(*ast.TypeSpec)
			if !ok {
				return true
			}
			st, ok := ts.Type.(*ast.StructType)
			if !ok || !slices.Contains(types, ts.Name.Name) {
				return true
			}
			found[ts.Name.Name] = true
			for _, field := range st.Fields.List {
				if field.Tag == nil || len(field.Names) == 0 || !field.Names[0].IsExported() {
					continue
				}
				name, _, _ := strings.Cut(reflect.StructTag(strings.Trim(field.Tag.Value, "`")).Get("json"), ",")
				if name == "" || name == "-" {
					continue
				}
				where := fset.Position(field.Pos())
				switch doc := field.Doc.Text(); {
				case strings.TrimSpace(doc) == "":
					t.Errorf("%s: %s.%s (JSON %q) has no doc comment", where, ts.Name.Name, field.Names[0].Name, name)
				case !defaultOrRequired.MatchString(doc):
					t.Errorf("%s: the doc comment of %s.%s (JSON %q) says neither its default nor that it is required", where, ts.Name.Name, field.Names[0].Name, name)
				}
			}
			return false
		})
		for _, name := range types {
			if !found[name] {
				t.Errorf("%s declares no struct %s", file, name)
			}
		}
	}
}
