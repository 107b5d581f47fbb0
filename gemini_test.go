package ratelimitredis

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
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone gemini {
			key "{http.request.header.X-API-Key}:{http.rate_limit_redis.request.model}"
			capacity 100000
			refill_rate 100000/24h
			cost 100
			charge gemini_usage
		}
	}
	reverse_proxy %s`, srv.Addr, up.URL))
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
