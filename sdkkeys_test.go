package ratelimitredis

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/repocheck"
)

// docExample returns the first Caddyfile example of page ("docs/charging.md") for which has
// is true; it fails t when there is none.
func docExample(t *testing.T, page string, has func(text string) bool) string {
	t.Helper()
	var found string
	for _, b := range repocheck.DocBlocks(t, "caddyfile") {
		if found == "" && strings.HasPrefix(b.Where, page+":") && has(b.Text) {
			found = b.Text
		}
	}
	if found == "" {
		t.Fatalf("%s has no such Caddyfile example", page)
	}
	return found
}

// docSite returns the body of site address's block (inside its braces) in docs/charging.md's
// Caddyfile examples, with the test's Redis at redisAddr and its upstream.
func docSite(t *testing.T, address, redisAddr, upstream string) string {
	t.Helper()
	for _, b := range repocheck.DocBlocks(t, "caddyfile") {
		if !strings.HasPrefix(b.Where, "docs/charging.md:") {
			continue
		}
		i := strings.Index(b.Text, address+" {\n")
		if i < 0 || (i > 0 && b.Text[i-1] != '\n') {
			continue
		}
		site := b.Text[i+len(address)+3:]
		site = site[:strings.Index(site, "\n}")]
		site = strings.Replace(site, "rate_limit_redis {", "rate_limit_redis {\n\t\tredis {\n\t\t\taddress "+redisAddr+"\n\t\t}", 1)
		j := strings.Index(site, "reverse_proxy ")
		return site[:j] + "reverse_proxy " + upstream + "\n"
	}
	t.Fatalf("docs/charging.md has no Caddyfile example of site %s", address)
	return ""
}

// capUpstream answers Anthropic Messages and Gemini generateContent requests with the output cap
// the request carries as the output tokens used, and 10 input tokens.
func capUpstream(t *testing.T) *httptest.Server {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			MaxTokens        int64 `json:"max_tokens"`
			GenerationConfig struct {
				MaxOutputTokens int64 `json:"maxOutputTokens"`
			} `json:"generationConfig"`
		}
		body, _ := io.ReadAll(r.Body)
		if json.Unmarshal(body, &req) != nil {
			http.Error(w, "bad JSON", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		if strings.HasPrefix(r.URL.Path, "/v1/messages") {
			_, _ = io.WriteString(w, `{"type":"message","stop_reason":"max_tokens","usage":{"input_tokens":10,"output_tokens":`+strconv.FormatInt(req.MaxTokens, 10)+`}}`)
			return
		}
		n := req.GenerationConfig.MaxOutputTokens
		_, _ = io.WriteString(w, `{"candidates":[],"usageMetadata":{"promptTokenCount":10,"candidatesTokenCount":`+strconv.FormatInt(n, 10)+`,"totalTokenCount":`+strconv.FormatInt(n+10, 10)+`}}`)
	}))
	t.Cleanup(up.Close)
	return up
}

// post sends body to url with the header name/value pairs given and returns the status.
func post(t *testing.T, url, body string, header ...string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := caddytest.Client(30 * time.Second).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// TestKeyDocsCapOutputSDKHeaders: docs/charging.md's cap_output examples for Anthropic and Gemini,
// as written there, with the key where each SDK sends it. Two customers of the Anthropic Node SDK
// (Authorization: Bearer, no X-Api-Key) have budgets of their own: B is admitted after A spent
// all of A's; so do a Python SDK customer (X-Api-Key) and Gemini REST clients with ?key=. A
// request with no key is refused (empty_key deny), sharing nothing.
func TestKeyDocsCapOutputSDKHeaders(t *testing.T) {
	srv := redistest.Start(t)
	up := capUpstream(t)
	sites := caddytest.StartSites(t, "",
		docSite(t, "anthropic.example.com", srv.Addr, up.URL),
		docSite(t, "gemini.example.com", srv.Addr, up.URL))
	anthropic, gemini := sites[0].Base+"/v1/messages", sites[1].Base+"/v1beta/models/gemini-2.5-flash:generateContent"
	const msg = `{"model":"claude-sonnet-4-5","max_tokens":8000,"messages":[{"role":"user","content":"hi"}]}`
	const gen = `{"contents":[{"parts":[{"text":"hi"}]}],"generationConfig":{"maxOutputTokens":8000}}`

	spend := func(name string, send func() int) {
		t.Helper()
		for i := 0; ; i++ {
			st := send()
			if st == http.StatusTooManyRequests {
				if i == 0 {
					t.Fatalf("%s: refused at its first request", name)
				}
				return
			}
			if st != http.StatusOK || i > 20 {
				t.Fatalf("%s: request %d: status %d, want 200 until its budget is spent", name, i+1, st)
			}
		}
	}
	spend("anthropic node customer A", func() int { return post(t, anthropic, msg, "Authorization", "Bearer sk-ant-customer-a") })
	if st := post(t, anthropic, msg, "Authorization", "Bearer sk-ant-customer-b"); st != http.StatusOK {
		t.Fatalf("anthropic node customer B after A spent its budget: %d, want 200 (a budget of its own)", st)
	}
	if st := post(t, anthropic, msg, "X-Api-Key", "sk-ant-customer-c"); st != http.StatusOK {
		t.Fatalf("anthropic python customer C: %d, want 200", st)
	}
	if st := post(t, anthropic, msg); st != http.StatusForbidden {
		t.Fatalf("anthropic request with no key: %d, want 403 (empty_key deny)", st)
	}
	spend("gemini ?key=gk-a", func() int { return post(t, gemini+"?key=gk-a", gen) })
	if st := post(t, gemini+"?key=gk-b", gen); st != http.StatusOK {
		t.Fatalf("gemini ?key=gk-b after gk-a spent its budget: %d, want 200", st)
	}
	if st := post(t, gemini, gen, "X-Goog-Api-Key", "gk-c"); st != http.StatusOK {
		t.Fatalf("gemini X-Goog-Api-Key gk-c: %d, want 200", st)
	}
	if st := post(t, gemini, gen); st != http.StatusForbidden {
		t.Fatalf("gemini request with no key: %d, want 403 (empty_key deny)", st)
	}
	if keys, _ := srv.Do("KEYS", "*~empty*").([]any); len(keys) != 0 {
		t.Fatalf("a shared empty key was stored: %v", keys)
	}
}

// TestKeyDocsChargingZoneNamesApart: no two of docs/charging.md's Caddyfile examples name a zone
// alike, so that a user who copies two of them into one config (two sites on one Redis) does
// not get one shared state under two sets of numbers.
func TestKeyDocsChargingZoneNamesApart(t *testing.T) {
	seen := map[string]string{}
	for _, b := range repocheck.DocBlocks(t, "caddyfile") {
		if !strings.HasPrefix(b.Where, "docs/charging.md:") {
			continue
		}
		for l := range strings.SplitSeq(b.Text, "\n") {
			name, ok := strings.CutPrefix(strings.TrimSpace(l), "zone ")
			if !ok {
				continue
			}
			name = strings.TrimSuffix(name, " {")
			if w, dup := seen[name]; dup {
				t.Errorf("zone %s is in the examples at %s and %s", name, w, b.Where)
			}
			seen[name] = b.Where
		}
	}
}
