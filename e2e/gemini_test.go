package e2e_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/llmtest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestChargeGeminiUsage: charge gemini_usage charges the usageMetadata of a generateContent
// response and of a streamGenerateContent stream (alt=sse), gzip-compressed or not, to the
// budget of the client and of the model the path names (the body's "model" is not read).
func TestChargeGeminiUsage(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartCapped(t)
	cs := caddytest.Start(t, zoneSite(srv.Addr, "gemini", `key "{http.request.header.X-API-Key}:{http.rate_limit_redis.request.model}"
			capacity 100000
			refill_rate 100000/24h
			cost 100
			charge gemini_usage`, up.URL))
	body := `{"model":"big","contents":[{"role":"user","parts":[{"text":"hi"}]}],"generationConfig":{"maxOutputTokens":50}}`
	want := float64(len(body)/4 + 50) // a quarter of the body's bytes as prompt, and the cap
	for i, c := range []struct {
		method string
		header []string
	}{
		{"generateContent", nil},
		{"generateContent", []string{"Accept-Encoding", "gzip"}},
		{"streamGenerateContent?alt=sse", nil},
		{"streamGenerateContent?alt=sse", []string{"Accept-Encoding", "gzip"}},
	} {
		key := fmt.Sprint("g", i)
		status, _, out := postJSON(t, cs.Base+"/v1beta/models/small:"+c.method, key, body, c.header...)
		if status != 200 || !strings.Contains(string(out), "MAX_TOKENS") {
			t.Fatalf("%s %v: %d %s", c.method, c.header, status, out)
		}
		if used := tokensOf(t, srv, key+":small", "gemini"); used > want || used < want-1 {
			t.Fatalf("%s %v: the budget of model small was charged %.1f, want %v", c.method, c.header, used, want)
		}
	}
}

// TestChargeWeightsFromPlaceholders: a weight may be a placeholder, here a map of the model,
// so that one route prices each model: the output of model small is charged 1 per token, of
// model big 10; a model the map prices with a value that is not a decimal is charged missing,
// never a wrong amount. With cap_output the bound uses the same weights: model big's cap is
// what its budget leaves at 10 units a token.
func TestChargeWeightsFromPlaceholders(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartCapped(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	map {http.rate_limit_redis.request.model} {price_out} {
		small 1
		big 10
		default lots
	}
	rate_limit_redis {
		redis {
			address %s
		}
		zone tokens {
			match path /v1/chat/completions
			key {http.request.header.X-API-Key}
			capacity 100000
			refill_rate 100000/24h
			cost 100
			charge openai_usage weights prompt 1 completion {price_out} missing 777
		}
		zone capped {
			match path /capped/v1/chat/completions
			key {http.request.header.X-API-Key}
			capacity 10000
			refill_rate 10000/24h
			charge openai_usage weights prompt 1 completion {price_out}
			cap_output
		}
	}
	reverse_proxy %s`, srv.Addr, up.URL))
	for _, c := range []struct {
		model string
		price int
	}{{"small", 1}, {"big", 10}, {"unpriced", -1}} {
		body := `{"model":"` + c.model + `","messages":[{"role":"user","content":"hi"}],"max_tokens":50}`
		if status, _, _ := postJSON(t, cs.Base+"/v1/chat/completions", c.model, body); status != 200 {
			t.Fatalf("%s: status %d, want 200", c.model, status)
		}
		want := float64(len(body)/4 + 50*c.price)
		if c.price < 0 {
			want = 777 // missing
		}
		if used := tokensOf(t, srv, c.model, "tokens"); used > want || used < want-1 {
			t.Fatalf("model %s: charged %.1f, want %v", c.model, used, want)
		}
	}
	body := `{"model":"big","messages":[{"role":"user","content":"hi"}],"max_tokens":4000}`
	if status, _, _ := postJSON(t, cs.Base+"/capped/v1/chat/completions", "cap", body); status != 200 {
		t.Fatalf("capped: status %d, want 200", status)
	}
	_, caps := up.Reported()
	if want := int64((10000 - len(body)) / 10); caps[len(caps)-1] != want {
		t.Fatalf("capped: cap %d, want (10000 − %d) / 10 = %d", caps[len(caps)-1], len(body), want)
	}
}
