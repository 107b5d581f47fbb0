package e2e_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/llmtest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// budgetCall is one call of testdata/budget.mjs.
type budgetCall struct {
	SDK       string `json:"sdk"` // openai, anthropic or gemini
	Base      string `json:"base"`
	Key       string `json:"key"`
	Stream    bool   `json:"stream,omitempty"`
	Identity  bool   `json:"identity,omitempty"` // Accept-Encoding: identity
	MaxTokens int    `json:"maxTokens"`
}

// budgetResult is what a call of testdata/budget.mjs got.
type budgetResult struct {
	OK     bool   `json:"ok"`
	Status int    `json:"status"`
	Ms     int64  `json:"ms"`
	Finish string `json:"finish"`
	Error  string `json:"error"`
}

// runBudget makes calls with the SDKs installed in dir, all at once, and returns what each got.
func runBudget(t *testing.T, dir string, calls []budgetCall) []budgetResult {
	t.Helper()
	script, err := os.ReadFile("e2e/testdata/budget.mjs")
	if err != nil {
		t.Fatal(err)
	}
	name := "budget-" + strings.ReplaceAll(t.Name(), "/", "-") + ".mjs"
	if err := os.WriteFile(filepath.Join(dir, name), script, 0o644); err != nil {
		t.Fatal(err)
	}
	return runNode[budgetResult](t, dir, name, calls, len(calls))
}

// TestSDKBudgetNeverOverdrawn: with the official OpenAI, Anthropic and Google Gen AI SDKs at
// their defaults, 30 concurrent calls per SDK, each asking for 4,000 output tokens, over three
// instances (each its own handler) against a budget of 10,000 tokens per key (cap_output), to
// upstreams that generate exactly the cap they receive: what each upstream reports in total is
// at most the budget and its refill over the run; every call that succeeded is a complete
// response stopped by its cap; every other is a 429 that the SDK surfaced at once (its
// Retry-After is hours: X-Should-Retry false). Streaming and not, compressed and not.
func TestSDKBudgetNeverOverdrawn(t *testing.T) {
	dir := nodeSDKs(t)
	srv := redistest.Start(t)
	ups := map[string]*llmtest.Capped{"openai": llmtest.StartCapped(t), "anthropic": llmtest.StartCapped(t), "gemini": llmtest.StartCapped(t)}
	zone := func(name, match, key, source string) string {
		return fmt.Sprintf(`
		zone %s {
			match %s
			key %s
			capacity 10000
			refill_rate 10000/24h
			charge %s
			cap_output
			hold_max 1m
		}`, name, match, key, source)
	}
	var site strings.Builder
	for i := 1; i <= 3; i++ {
		fmt.Fprintf(&site, `
	handle_path /i%d/* {
		rate_limit_redis {
			redis {
				address %s
			}
			timeout 2s # a loaded machine must not fail a decision or a settlement
			%s
			%s
			%s
		}
		@openai path /v1/chat/completions
		reverse_proxy @openai %s
		@anthropic path /v1/messages
		reverse_proxy @anthropic %s
		reverse_proxy %s
	}`, i, srv.Addr,
			zone("openai", "path /v1/chat/completions", "{http.request.header.Authorization}", "openai_usage"),
			zone("anthropic", "path /v1/messages", "{http.request.header.X-Api-Key}", "anthropic_usage"),
			zone("gemini", `path_regexp :(generateContent|streamGenerateContent)$`, "{http.request.header.X-Goog-Api-Key}", "gemini_usage"),
			ups["openai"].URL, ups["anthropic"].URL, ups["gemini"].URL)
	}
	cs := caddytest.Start(t, site.String())
	want := map[string]string{"openai": "length", "anthropic": "max_tokens", "gemini": "MAX_TOKENS"}
	for _, sdk := range []string{"openai", "anthropic", "gemini"} {
		t.Run(sdk, func(t *testing.T) {
			calls := make([]budgetCall, 30)
			for i := range calls {
				calls[i] = budgetCall{SDK: sdk, Base: fmt.Sprintf("%s/i%d", cs.Base, 1+i%3), Key: "key-" + sdk,
					Stream: i%2 == 1, Identity: i%3 == 2, MaxTokens: 4000}
			}
			start := time.Now()
			res := runBudget(t, dir, calls)
			refill := int64(time.Since(start).Seconds()*10000/86400) + 1
			ok := 0
			for i, r := range res {
				switch {
				case r.OK && r.Finish == want[sdk]:
					ok++
				case r.OK:
					t.Errorf("call %d: a response that stopped with %q, want %q (complete, stopped by its cap)", i, r.Finish, want[sdk])
				case r.Status != 429 || r.Ms > 5000:
					t.Errorf("call %d: %d after %d ms (%s), want a 429 surfaced at once", i, r.Status, r.Ms, r.Error)
				}
			}
			reported, caps := ups[sdk].Reported()
			t.Logf("%d of 30 served, the upstream reported %d tokens, caps received %v", ok, reported, caps)
			if reported > 10_000+refill {
				t.Fatalf("the upstream reported %d tokens in total, want at most the budget of 10000 and %d of refill", reported, refill)
			}
			if ok < 2 {
				t.Fatalf("%d calls served, want at least 2 (each reserves 4000 and its prompt of 10000)", ok)
			}
		})
	}
}
