package repocheck

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// adaptMu makes one adaptLogged run at a time, so the lines Caddy's default logger takes in are
// those of the Caddyfile being adapted.
var adaptMu sync.Mutex

// adaptLogged adapts a Caddyfile as `caddy adapt` does and returns its JSON, the adapter's
// warnings, and the lines at WARN or above that adapting logged through Caddy's default logger
// (as `caddy adapt` and `caddy run` print them), each as "level: message".
func adaptLogged(src []byte, filename string) (cfg []byte, warnings []caddyconfig.Warning, logged []string, err error) {
	adaptMu.Lock()
	defer adaptMu.Unlock()
	_, orig, buffer := caddy.BufferedLog()
	cfg, warnings, err = caddyconfig.GetAdapter("caddyfile").Adapt(src, map[string]any{"filename": filename})
	core, lines := observer.New(zapcore.WarnLevel)
	buffer.FlushTo(zap.New(core))
	caddy.UnbufferDefaultLogger(orig)
	for _, e := range lines.All() {
		logged = append(logged, e.Level.String()+": "+e.Message)
	}
	return cfg, warnings, logged, err
}

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

// TestAdaptExample checks that Caddyfile.example adapts, with no warning returned or logged, to the JSON in
// testdata/Caddyfile.example.json (what `make adapt` prints). Run `go test ./internal/repocheck
// -run AdaptExample -update` after changing either on purpose.
func TestAdaptExample(t *testing.T) {
	t.Setenv("REDIS_ADDR", "") // restored when the test ends
	os.Unsetenv("REDIS_ADDR")  // so the example's {$REDIS_ADDR:127.0.0.1:6379} takes its default
	src, err := os.ReadFile("Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	cfg, warnings, logged, err := adaptLogged(src, "Caddyfile.example")
	if err != nil {
		t.Fatalf("adapting Caddyfile.example: %v", err)
	}
	if len(warnings) > 0 || len(logged) > 0 {
		t.Fatalf("adapter warnings: %v; logged: %v", warnings, logged)
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
