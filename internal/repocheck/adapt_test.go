package repocheck

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

// TestAdaptExample checks that Caddyfile.example adapts, with no warning, to the JSON in
// testdata/Caddyfile.example.json (what `make adapt` prints). Run `go test ./internal/repocheck
// -run AdaptExample -update` after changing either on purpose.
func TestAdaptExample(t *testing.T) {
	t.Setenv("REDIS_ADDR", "") // restored when the test ends
	os.Unsetenv("REDIS_ADDR")  // so the example's {$REDIS_ADDR:127.0.0.1:6379} takes its default
	src, err := os.ReadFile("Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	cfg, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt(src, map[string]any{"filename": "Caddyfile.example"})
	if err != nil {
		t.Fatalf("adapting Caddyfile.example: %v", err)
	}
	if len(warnings) > 0 {
		t.Fatalf("adapter warnings: %v", warnings)
	}
	var pretty bytes.Buffer
	if err := json.Indent(&pretty, cfg, "", "\t"); err != nil {
		t.Fatal(err)
	}
	pretty.WriteByte('\n')
	const golden = "testdata/Caddyfile.example.json"
	if *update {
		if err := os.WriteFile(golden, pretty.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run go test ./internal/repocheck -run AdaptExample -update to create it)", err)
	}
	if !bytes.Equal(pretty.Bytes(), want) {
		t.Fatalf("Caddyfile.example adapts to\n%s\nwant (%s)\n%s", pretty.Bytes(), golden, want)
	}
}
