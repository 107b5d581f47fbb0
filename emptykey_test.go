package ratelimitredis

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestEmptyKeyWarnCharging: a charge zone that decides requests under its shared empty key
// (empty_key shared) logs one warning, naming the zone and its key, for any number of such
// decisions within a minute; a zone without charge logs none (empty_key_total counts both).
func TestEmptyKeyWarnCharging(t *testing.T) {
	srv := redistest.Start(t)
	zone := func(name string, charge *Charge) *Zone {
		return &Zone{Name: name, Key: []string{"{http.request.header.X-Api-Key}"}, Capacity: NumberOf(1000000),
			RefillRate: NumberOf(1000000.0 / 3600), Cost: "1", Charge: charge}
	}
	h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}},
		Zones: []*Zone{zone("charged", &Charge{Source: ChargeOpenAIUsage}), zone("plain", nil)}})
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	for i := range 50 {
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil) // no X-Api-Key
		caddyhttp.NewTestReplacer(r)
		w := httptest.NewRecorder()
		err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
			w.Header().Set("Content-Type", "application/json")
			_, err := io.WriteString(w, `{"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
			return err
		}))
		if err != nil || w.Code != http.StatusOK {
			t.Fatalf("request %d: %d, %v; want 200", i, w.Code, err)
		}
	}
	got := logs.FilterMessageSnippet("decided with an empty key").All()
	if len(got) != 1 {
		t.Fatalf("%d empty-key warnings for 50 decisions, want 1: %v", len(got), got)
	}
	if f := got[0].ContextMap(); f["zone"] != "charged" {
		t.Fatalf("warning names zone %v, want charged: %v", f["zone"], f)
	}
}
