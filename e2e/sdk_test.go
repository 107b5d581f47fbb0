package e2e_test

// The official OpenAI, Anthropic and Google Gen AI Node SDKs (npm openai, @anthropic-ai/sdk,
// @google/genai), at their defaults, through Caddy with the module: how they take a refusal,
// and the budgets of their usage. The SDKs are installed once per machine with npm, at the
// versions of sdkPackages.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/llmtest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// sdkPackages are the SDKs the tests run, at exact versions: openai 6.49.0 sleeps whatever
// Retry-After says before each retry (later releases cap it at a minute), and so does
// @anthropic-ai/sdk 1.14.0 (up to 24.8 days); @google/genai 2.32.0 retries nothing unless told
// to (httpOptions.retryOptions).
var sdkPackages = []string{"openai@6.49.0", "@anthropic-ai/sdk@1.14.0", "@google/genai@2.32.0"}

// sdkDeadline bounds one run of the SDK script: a call that sleeps through a long Retry-After
// is killed at it, and the test fails saying so.
const sdkDeadline = 60 * time.Second

// nodeSDKs returns a directory whose node_modules holds sdkPackages and the test's script
// (testdata/sdk.mjs), installed with npm once into the user's cache directory. It skips the
// test when node or npm is missing, node is older than 20 (the SDKs' oldest), or the install
// fails.
func nodeSDKs(t *testing.T) string {
	t.Helper()
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("SKIPPED: %s is not installed: the SDK tests need Node.js 20 or later and npm (Debian: apt-get install nodejs npm; .ci/run installs them)", tool)
		}
	}
	out, err := exec.Command("node", "-p", "process.versions.node.split('.')[0]").Output()
	if major, _ := strconv.Atoi(strings.TrimSpace(string(out))); err != nil || major < 20 {
		t.Skipf("SKIPPED: node %s is older than 20, the oldest the SDKs run on (%v)", strings.TrimSpace(string(out)), err)
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "caddy-rate-limit-redis", "npm-"+strings.NewReplacer("@", "", "/", "-").Replace(strings.Join(sdkPackages, "+")))
	if !sdksInstalled(dir) {
		if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
			t.Fatal(err)
		}
		tmp, err := os.MkdirTemp(filepath.Dir(dir), "installing-")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(tmp)
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
		defer cancel()
		npm := exec.CommandContext(ctx, "npm", append([]string{"install", "--no-audit", "--no-fund", "--no-save", "--prefix", tmp}, sdkPackages...)...)
		if out, err := npm.CombinedOutput(); err != nil {
			// A machine that cannot reach the npm registry cannot run these tests; that is not a
			// failure of the module, so they skip, saying why (go test -v shows it).
			t.Skipf("SKIPPED: npm install %s failed (is the npm registry reachable?): %v\n%s", strings.Join(sdkPackages, " "), err, out)
		}
		if err := os.Rename(tmp, dir); err != nil && !os.IsExist(err) {
			if _, statErr := os.Stat(dir); statErr != nil { // not another process's install
				t.Fatal(err)
			}
		}
	}
	script, err := os.ReadFile("e2e/testdata/sdk.mjs")
	if err != nil {
		t.Fatal(err)
	}
	// Beside its node_modules, where its imports resolve; one per test, as tests may run at once.
	if err := os.WriteFile(filepath.Join(dir, "sdk-"+t.Name()+".mjs"), script, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// sdksInstalled reports whether dir's node_modules holds every package of sdkPackages.
func sdksInstalled(dir string) bool {
	for _, p := range sdkPackages {
		name := p[:strings.LastIndexByte(p, '@')]
		if _, err := os.Stat(filepath.Join(dir, "node_modules", filepath.FromSlash(name), "package.json")); err != nil {
			return false
		}
	}
	return true
}

// sdkCall is one call of testdata/sdk.mjs.
type sdkCall struct {
	SDK      string            `json:"sdk"` // openai or anthropic
	Base     string            `json:"base"`
	Key      string            `json:"key"`
	Stream   bool              `json:"stream,omitempty"`
	Identity bool              `json:"identity,omitempty"` // Accept-Encoding: identity
	After    *int              `json:"after,omitempty"`    // start this many ms after the previous call started
	Headers  map[string]string `json:"headers,omitempty"`
}

// sdkResult is what a call of testdata/sdk.mjs got.
type sdkResult struct {
	OK     bool            `json:"ok"`
	Status int             `json:"status"`
	Ms     int64           `json:"ms"`
	Usage  json.RawMessage `json:"usage"`
	Text   string          `json:"text"`
	Error  string          `json:"error"`
}

// runSDK makes calls with the SDKs installed in dir and returns what each got; it fails the
// test when they are not done within sdkDeadline.
func runSDK(t *testing.T, dir string, calls ...sdkCall) []sdkResult {
	t.Helper()
	return runNode[sdkResult](t, dir, "sdk-"+t.Name()+".mjs", calls, len(calls))
}

// runNode runs the node script named script in dir with calls, n of them, as its JSON argument,
// and returns the n results it prints, one JSON line each; it fails the test when they are not
// done within sdkDeadline.
func runNode[R any](t *testing.T, dir, script string, calls any, n int) []R {
	t.Helper()
	arg, _ := json.Marshal(calls)
	ctx, cancel := context.WithTimeout(t.Context(), sdkDeadline)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", script, string(arg))
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if ctx.Err() != nil {
		t.Fatalf("the SDK calls were still under way after %v (asleep in the SDK's retry?): %s", sdkDeadline, out)
	}
	if err != nil {
		t.Fatalf("node: %v\n%s%s", err, out, stderr.Bytes())
	}
	var results []R
	for sc := bufio.NewScanner(bytes.NewReader(out)); sc.Scan(); {
		var r R
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("%v: %s", err, sc.Bytes())
		}
		results = append(results, r)
	}
	if len(results) != n {
		t.Fatalf("%d results for %d calls: %s", len(results), n, out)
	}
	return results
}

// attempt is one request the SDK sent, as the counting proxy saw it.
type attempt struct {
	call                           string // its X-Call header
	status                         int
	retryAfter, shouldRetry, model string
}

// countingProxy forwards to target every request it gets and records each one, in order.
type countingProxy struct {
	*httptest.Server
	mu       sync.Mutex
	attempts []attempt
}

func startCountingProxy(t *testing.T, target string) *countingProxy {
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	p := &countingProxy{}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ModifyResponse = func(resp *http.Response) error {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.attempts = append(p.attempts, attempt{resp.Request.Header.Get("X-Call"), resp.StatusCode,
			resp.Header.Get("Retry-After"), resp.Header.Get("X-Should-Retry"), resp.Header.Get("X-Model")})
		return nil
	}
	p.Server = httptest.NewServer(rp)
	t.Cleanup(p.Close)
	return p
}

// of returns the attempts of the call named call.
func (p *countingProxy) of(call string) []attempt {
	p.mu.Lock()
	defer p.mu.Unlock()
	var a []attempt
	for _, at := range p.attempts {
		if at.call == call {
			a = append(a, at)
		}
	}
	return a
}

// openAIUpstream is a chat completions upstream reporting 100 tokens (40 prompt, 60
// completion), as JSON, or as a stream whose last chunk has the usage when the request asks
// for it (stream_options.include_usage), as OpenAI's API does.
func openAIUpstream(t *testing.T) *httptest.Server {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Stream        bool `json:"stream"`
			StreamOptions struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		const usage = `{"prompt_tokens":40,"completion_tokens":60,"total_tokens":100}`
		if !req.Stream {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"c1","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],"usage":`+usage+`}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":null}]}`+"\n\n")
		if req.StreamOptions.IncludeUsage {
			_, _ = io.WriteString(w, `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4o","choices":[],"usage":`+usage+`}`+"\n\n")
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(up.Close)
	return up
}

// TestOpenAISDKRefusals: the official OpenAI Node SDK at its defaults (two retries, each after
// the Retry-After it is given). Over a token budget spent for half an hour, its call fails with
// the 429 at once, after one request: the refusal says X-Should-Retry: false, which it obeys
// (it would otherwise sleep 30 minutes, twice). Over a budget that refills within a second,
// its call succeeds: it waits out the 429's Retry-After of 1 (no X-Should-Retry) and retries.
func TestOpenAISDKRefusals(t *testing.T) {
	dir := nodeSDKs(t)
	srv := redistest.Start(t)
	up := openAIUpstream(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		timeout 2s # a loaded machine must not fail a decision or a settlement (fail_mode open)
		zone spent {
			match path /spent/*
			key {http.request.header.Authorization}
			capacity 100
			refill_rate 100/1h
			cost 50
			charge openai_usage total
		}
		zone fast {
			match path /fast/*
			key {http.request.header.Authorization}
			capacity 1
			refill_rate 1
		}
	}
	handle_path /spent/* {
		reverse_proxy %s
	}
	handle_path /fast/* {
		reverse_proxy %[2]s
	}`, srv.Addr, up.URL))
	proxy := startCountingProxy(t, cs.Base)

	spent := func(call string, stream bool) sdkCall {
		return sdkCall{SDK: "openai", Base: proxy.URL + "/spent/v1", Key: "sk-alice", Stream: stream, Headers: map[string]string{"X-Call": call}}
	}
	res := runSDK(t, dir, spent("1", true), spent("2", false))
	if !res[0].OK || !strings.Contains(string(res[0].Usage), `"total_tokens":100`) {
		t.Fatalf("the first call, a stream (asked for its usage by the module): %+v", res[0])
	}
	if res[1].OK || res[1].Status != 429 {
		t.Fatalf("the call over the spent budget: %+v, want a 429", res[1])
	}
	a := proxy.of("2")
	if ra, _ := strconv.Atoi(a[0].retryAfter); len(a) != 1 || a[0].status != 429 || a[0].shouldRetry != "false" || ra < 1700 {
		t.Fatalf("the call over the spent budget sent %+v; want one request, refused with X-Should-Retry: false and a Retry-After of about 1800", a)
	}
	t.Logf("over the spent budget, the SDK failed after %d ms, Retry-After %s", res[1].Ms, a[0].retryAfter)

	// Two calls, the second 50 ms after the first: one of them is refused (unless the machine
	// took a second between them: then the pair runs again).
	for round := 1; ; round++ {
		key := "sk-fast-" + strconv.Itoa(round)
		fast := func(call string, after *int) sdkCall {
			return sdkCall{SDK: "openai", Base: proxy.URL + "/fast/v1", Key: key, After: after, Headers: map[string]string{"X-Call": key + call}}
		}
		res := runSDK(t, dir, fast("a", nil), fast("b", new(50)))
		if !res[0].OK || !res[1].OK {
			t.Fatalf("round %d: %+v", round, res)
		}
		for i, call := range []string{"a", "b"} {
			a := proxy.of(key + call)
			if len(a) == 1 && a[0].status == 200 {
				continue
			}
			if len(a) != 2 || a[0].status != 429 || a[0].retryAfter != "1" || a[0].shouldRetry != "" || a[1].status != 200 {
				t.Fatalf("round %d, call %s: %+v; want a 429 with Retry-After 1 and no X-Should-Retry, then its retry admitted", round, call, a)
			}
			t.Logf("round %d: call %s refused, retried by the SDK, admitted; it took %d ms", round, call, res[i].Ms)
			return
		}
		if round == 5 {
			t.Fatal("5 rounds of two calls 50 ms apart, and no call was refused")
		}
	}
}

// TestAnthropicSDKUsage: the official Anthropic Node SDK at its defaults, through a zone that
// charges anthropic_usage, in front of an upstream speaking the Messages API: a message and a
// stream, compressed (the SDK asks for gzip) or not, each read by the SDK in full and charged
// every token its usage reports; over the spent budget, its call fails with the 429 after one
// request (X-Should-Retry: false), where it would sleep through Retry-After.
func TestAnthropicSDKUsage(t *testing.T) {
	dir := nodeSDKs(t)
	srv := redistest.Start(t)
	usage := llmtest.AnthropicUsage{Input: 100, CacheWrite: 20, CacheRead: 300, Output: 50}
	up := llmtest.StartAnthropic(t, usage)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		timeout 2s # a loaded machine must not fail a decision or a settlement (fail_mode open)
		zone tokens {
			key {http.request.header.X-Api-Key} {http.request.header.Authorization}
			capacity 2000
			refill_rate 2000/24h
			cost 500
			charge anthropic_usage total
		}
	}
	reverse_proxy %s`, srv.Addr, up.URL))
	proxy := startCountingProxy(t, cs.Base)
	call := func(name string, stream, identity bool) sdkCall {
		return sdkCall{SDK: "anthropic", Base: proxy.URL, Key: "sk-ant-alice", Stream: stream, Identity: identity, Headers: map[string]string{"X-Call": name}}
	}
	res := runSDK(t, dir, call("message", false, false), call("message, identity", false, true),
		call("stream", true, false), call("stream, identity", true, true), call("over the budget", false, false))
	for i, r := range res[:4] {
		var u struct {
			Input      int64 `json:"input_tokens"`
			CacheWrite int64 `json:"cache_creation_input_tokens"`
			CacheRead  int64 `json:"cache_read_input_tokens"`
			Output     int64 `json:"output_tokens"`
		}
		if err := json.Unmarshal(r.Usage, &u); !r.OK || err != nil || (llmtest.AnthropicUsage{Input: u.Input, CacheWrite: u.CacheWrite, CacheRead: u.CacheRead, Output: u.Output}) != usage || !strings.HasPrefix(r.Text, "Hello") {
			t.Fatalf("call %d: %+v", i+1, r)
		}
	}
	if _, enc := up.Received(); strings.Join(enc, ",") != "gzip,,gzip," {
		t.Fatalf("the upstream answered with the codings %q, want gzip, identity, gzip, identity", enc)
	}
	// 4 × 470 charged once settled, less a day's refill of 2000 over the test's seconds. The SDK
	// sends its key as Authorization: Bearer, a key with a space, kept as a digest.
	keys := srv.Keys(t)
	if len(keys) != 1 {
		t.Fatalf("keys %v, want the one client's", keys)
	}
	redistest.WaitFor(t, 5*time.Second, "the charges settled", func() bool { return srv.Do("HEXISTS", keys[0], "h").(int64) == 0 })
	used, _ := strconv.ParseFloat(fmt.Sprint(srv.Do("HGET", keys[0], "u")), 64)
	if want := float64(4 * usage.Total()); used > want || used < want-2 {
		t.Fatalf("charged %v, want %v", used, want)
	}
	last := res[4]
	a := proxy.of("over the budget")
	if last.OK || last.Status != 429 || len(a) != 1 || a[0].shouldRetry != "false" {
		t.Fatalf("the call over the budget: %+v, sent %+v; want a 429 after one request, with X-Should-Retry: false", last, a)
	}
}
