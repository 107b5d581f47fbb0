package e2e_test

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"strings"
	"testing"
	"unicode/utf16"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/llmtest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// The cap_output budget holds for every body a client can send: what the module cannot bound it
// refuses or bounds. Each test sends bodies through a cap_output zone (a budget of 10,000 tokens
// per X-API-Key and model, refilled over a day) to an upstream that reads them as laxly as real
// servers do (llmtest.Lax) and generates exactly what it reads. Lax reads a chat request's cap
// as llama.cpp does too (n_predict, else max_tokens), so the zones have insert_max_tokens.

// laxBudget is the budget of every key in these tests, and laxSlack the most its refill adds
// over a test (10,000 a day: 2 tokens in 17 s).
const laxBudget, laxSlack = 10_000, 2

// laxSite is a site with one cap_output zone (capArgs its arguments) for each of the three
// usage formats, keyed on the API key and the model, in front of upstream.
func laxSite(redisAddr, capArgs, upstream string) string {
	zone := func(name, path, source string) string {
		return fmt.Sprintf(`
		zone %s {
			match path %s
			key {http.request.header.X-API-Key}:{http.rate_limit_redis.request.model}
			capacity %d
			refill_rate %d/24h
			charge %s
			cap_output %s
			hold_max 1m
		}`, name, path, laxBudget, laxBudget, source, capArgs)
	}
	return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}%s%s%s
	}
	reverse_proxy %s`, redisAddr,
		zone("oai", "/v1/chat/completions /v1/completions /v1/responses", "openai_usage"),
		zone("ant", "/v1/messages", "anthropic_usage"),
		zone("gem", "/v1beta/*", "gemini_usage"), upstream)
}

const laxMsg = `"model":"m","messages":[{"role":"user","content":"hi"}]`

// utf16LE is s in UTF-16LE, as Python's json.loads reads it.
func utf16LE(s string) []byte {
	var b []byte
	for _, u := range utf16.Encode([]rune(s)) {
		b = append(b, byte(u), byte(u>>8))
	}
	return b
}

// gzipped is b compressed with gzip.
func gzipped(b []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	_, _ = zw.Write(b)
	_ = zw.Close()
	return buf.Bytes()
}

// TestCapOutputEveryBody: each body that once switched cap_output's bound off (a request from a
// fresh client asking for 50,000 output tokens against a budget of 10,000) is now bounded or
// refused. Bounded: what the lax upstream served is within the budget. Refused: the status and
// a reason that names what is wrong, and the upstream is not reached. A request with
// n_predict is capped in it too, and one without a cap gets both max_completion_tokens and
// max_tokens (insert_max_tokens; without it, max_completion_tokens alone).
func TestCapOutputEveryBody(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartLax(t)
	cs := caddytest.Start(t, laxSite(srv.Addr, "insert_max_tokens", up.URL))
	chat, ant, gem := "/v1/chat/completions", "/v1/messages", "/v1beta/models/g:generateContent"
	tool := `"tools":[{"type":"function","function":{"name":"save","parameters":{"type":"object","properties":{"file":{"type":"string"}}}}}]`
	for _, c := range []struct {
		name, path string
		body       []byte
		header     []string
		status     int    // 200: bounded, the upstream served within the budget
		reason     string // in a refusal's body
	}{
		{"plain", chat, []byte(`{` + laxMsg + `,"max_tokens":50000}`), nil, 200, ""},
		{"n 2", chat, []byte(`{` + laxMsg + `,"max_tokens":50000,"n":2}`), nil, 200, ""},
		{"n 1.0", chat, []byte(`{` + laxMsg + `,"max_tokens":50000,"n":1.0}`), nil, 200, ""},
		{`n "1"`, chat, []byte(`{` + laxMsg + `,"max_tokens":50000,"n":"1"}`), nil, 200, ""},
		{"n true", chat, []byte(`{` + laxMsg + `,"max_tokens":50000,"n":true}`), nil, 200, ""},
		{`n "2"`, chat, []byte(`{` + laxMsg + `,"max_tokens":50000,"n":"2"}`), nil, 200, ""},
		{"n 129", chat, []byte(`{` + laxMsg + `,"max_tokens":50000,"n":129}`), nil, 400, `\"n\" asks for more than 128`},
		{"n 1.5", chat, []byte(`{` + laxMsg + `,"max_tokens":50000,"n":1.5}`), nil, 400, `\"n\" is not a whole number`},
		{"a tool parameter named file (OpenAI)", chat, []byte(`{` + laxMsg + `,` + tool + `,"max_tokens":50000}`), nil, 200, ""},
		{"a tool parameter named image (Anthropic)", ant, []byte(`{` + laxMsg + `,"tools":[{"name":"t","input_schema":{"type":"object","properties":{"image":{"type":"string"}}}}],"max_tokens":50000}`), nil, 200, ""},
		{"a function parameter named document (Gemini)", gem, []byte(`{"contents":[],"tools":[{"functionDeclarations":[{"name":"t","parameters":{"type":"object","properties":{"document":{"type":"string"}}}}]}],"generationConfig":{"maxOutputTokens":50000}}`), nil, 200, ""},
		{"metadata image", chat, []byte(`{` + laxMsg + `,"metadata":{"image":"x"},"max_tokens":50000}`), nil, 200, ""},
		{"an image: its output capped still", chat, []byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/a.png"}}]}],"max_tokens":50000}`), nil, 200, ""},
		{"padded past 1 MiB", chat, []byte(`{` + laxMsg + `,"max_tokens":50000` + strings.Repeat(" ", 1<<20) + `}`), nil, 413, ""},
		{"a UTF-8 byte order mark", chat, append([]byte("\xef\xbb\xbf"), `{`+laxMsg+`,"max_tokens":50000}`...), nil, 400, "not one JSON object"},
		{"UTF-16LE", chat, utf16LE(`{` + laxMsg + `,"max_tokens":50000}`), nil, 400, "not one JSON object"},
		{"gzip Content-Encoding", chat, gzipped([]byte(`{` + laxMsg + `,"max_tokens":50000}`)), []string{"Content-Encoding", "gzip"}, 415, "Content-Encoding"},
		{"candidateCount 2.0 (Gemini)", gem, []byte(`{"contents":[],"generationConfig":{"maxOutputTokens":50000,"candidateCount":2.0}}`), nil, 200, ""},
		{"candidateCount 200 (Gemini)", gem, []byte(`{"contents":[],"generationConfig":{"maxOutputTokens":50000,"candidateCount":200}}`), nil, 400, `\"candidateCount\" asks for more`},
		{"n_predict over max_tokens (llama.cpp)", chat, []byte(`{` + laxMsg + `,"max_tokens":10,"n_predict":50000}`), nil, 200, ""},
		{"no cap", chat, []byte(`{` + laxMsg + `}`), nil, 200, ""},
		{"Model beside model", chat, []byte(`{` + laxMsg + `,"Model":"big","max_tokens":50000}`), nil, 400, `\"Model\"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			key := "k-" + strings.ReplaceAll(c.name, " ", "-")
			status, _, out := postJSON(t, cs.Base+c.path, key, string(c.body), c.header...)
			body := string(out)
			served := up.Served(key)
			if status != c.status || !strings.Contains(body, c.reason) {
				t.Fatalf("%d %.200s; want %d with %q", status, body, c.status, c.reason)
			}
			if c.status != 200 {
				if up.Last(key) != nil {
					t.Fatalf("refused, yet the upstream was reached")
				}
				return
			}
			if served > laxBudget {
				t.Fatalf("the upstream served %d tokens, over the budget of %d", served, laxBudget)
			}
			sent := string(up.Last(key))
			switch c.name {
			case "n_predict over max_tokens (llama.cpp)":
				if !strings.Contains(sent, `"max_tokens":10,`) || strings.Contains(sent, `"n_predict":50000`) {
					t.Fatalf("sent %s, want n_predict capped and max_tokens 10 as asked", sent)
				}
			case "no cap":
				if !strings.Contains(sent, `"max_completion_tokens":`) || !strings.Contains(sent, `"max_tokens":`) {
					t.Fatalf("sent %s, want both max_completion_tokens and max_tokens", sent)
				}
			}
		})
	}
	plain := caddytest.Start(t, laxSite(srv.Addr, "", up.URL))
	if status, _, _ := postJSON(t, plain.Base+chat, "without", `{`+laxMsg+`}`); status != 200 {
		t.Fatalf("without insert_max_tokens: %d, want 200", status)
	}
	if sent := string(up.Last("without")); !strings.HasPrefix(sent, `{"max_completion_tokens":`) || strings.Contains(sent, `"max_tokens"`) {
		t.Fatalf("without insert_max_tokens, sent %s; want max_completion_tokens alone", sent)
	}
}

// TestCapOutputUnreadablePass: with cap_output unreadable pass, a body the module cannot read
// (compressed) goes on as it came, reserved at max_cost: the client's whole budget, so it is
// charged at most that and a second request is refused while the first's reservation is held.
func TestCapOutputUnreadablePass(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartLax(t)
	up.NoCap = 100
	cs := caddytest.Start(t, laxSite(srv.Addr, "unreadable pass", up.URL))
	body := gzipped([]byte(`{` + laxMsg + `,"max_tokens":50}`))
	if status, _, b := postJSON(t, cs.Base+"/v1/chat/completions", "p", string(body), "Content-Encoding", "gzip"); status != 200 {
		t.Fatalf("%d %s, want 200: passed on", status, b)
	}
	if sent := string(up.Last("p")); !strings.Contains(sent, `"max_tokens":50}`) {
		t.Fatalf("the upstream read %s, want the body as it came", sent)
	}
	if used := tokensOf(t, srv, "p:m", "oai"); used > laxBudget {
		t.Fatalf("charged %.1f, want at most max_cost, %d", used, laxBudget)
	}
}

// laxShape is an API's request body asking for 50,000 output tokens: top is inserted as the
// first members of its object, config as the first of its Gemini generationConfig.
type laxShape struct {
	name, path string
	body       func(top, config string) string
}

// laxShapes are the body shapes of TestCapOutputGenerated.
var laxShapes = []laxShape{
	{"chat", "/v1/chat/completions", func(top, _ string) string { return `{` + top + laxMsg + `,"max_tokens":50000}` }},
	{"chat max_completion_tokens", "/v1/chat/completions", func(top, _ string) string {
		return `{` + top + laxMsg + `,"max_completion_tokens":50000}`
	}},
	{"chat no cap", "/v1/chat/completions", func(top, _ string) string { return `{` + top + laxMsg + `}` }},
	{"completions", "/v1/completions", func(top, _ string) string { return `{` + top + `"model":"m","prompt":"hi","max_tokens":50000}` }},
	{"responses", "/v1/responses", func(top, _ string) string { return `{` + top + `"model":"m","input":"hi","max_output_tokens":50000}` }},
	{"anthropic", "/v1/messages", func(top, _ string) string { return `{` + top + laxMsg + `,"max_tokens":50000}` }},
	{"gemini", "/v1beta/models/g:generateContent", func(top, config string) string {
		return `{` + top + `"contents":[{"parts":[{"text":"hi"}]}],"generationConfig":{` + config + `"maxOutputTokens":50000}}`
	}},
}

// laxMutation changes a shape's body: members at its top (top) or in its generationConfig
// (config), then the whole body (encode) and the request's header pairs.
type laxMutation struct {
	name, top, config string
	encode            func([]byte) []byte
	header            []string
}

// laxMutations are the changes of TestCapOutputGenerated: each once made a body unbounded or
// went past the module's reading.
var laxMutations = []laxMutation{
	{name: "as is"},
	{name: "n 1.0", top: `"n":1.0,`},
	{name: `n "1"`, top: `"n":"1",`},
	{name: "n true", top: `"n":true,`},
	{name: "n 129", top: `"n":129,`},
	{name: `n "2"`, top: `"n":"2",`},
	{name: "best_of 3.0", top: `"best_of":3.0,`},
	{name: "candidateCount 2.0", config: `"candidateCount":2.0,`, top: `"candidateCount":2.0,`},
	{name: `candidate_count "3"`, config: `"candidate_count":"3",`},
	{name: "n_predict", top: `"n_predict":50000,`},
	{name: "Max_Tokens", top: `"Max_Tokens":50000,`},
	{name: "a tool parameter named file", top: `"tools":[{"type":"function","function":{"name":"f","parameters":{"properties":{"file":{"type":"string"}}}}}],`},
	{name: "a tool parameter named image", top: `"tools":[{"name":"f","input_schema":{"properties":{"image":{"type":"string"}}}}],`},
	{name: "metadata image", top: `"metadata":{"image":"x"},`},
	{name: "an image", top: `"x":[{"type":"image_url","image_url":{"url":"u"}}],`},
	{name: "duplicate-case model", top: `"Model":"other",`},
	{name: "a BOM", encode: func(b []byte) []byte { return append([]byte("\xef\xbb\xbf"), b...) }},
	{name: "UTF-16LE", encode: func(b []byte) []byte { return utf16LE(string(b)) }},
	{name: "padded past 1 MiB", encode: func(b []byte) []byte {
		return append(append(b[:len(b)-1:len(b)-1], bytes.Repeat([]byte(" "), 1<<20)...), '}')
	}},
	{name: "gzip", encode: gzipped, header: []string{"Content-Encoding", "gzip"}},
}

// TestCapOutputGenerated: every body shape of the APIs cap_output knows, with every mutation,
// sent three times by one client through cap_output zones to an upstream that reads each body
// as laxly as real servers do and generates exactly what it reads: for every client, what the
// upstream served in total is at most the budget. Every answer is a 200, a 429, or a refusal
// (400, 413, 415), never a 5xx.
func TestCapOutputGenerated(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartLax(t)
	cs := caddytest.Start(t, laxSite(srv.Addr, "insert_max_tokens", up.URL))
	for _, s := range laxShapes {
		for _, m := range laxMutations {
			key := s.name + "/" + m.name
			body := []byte(s.body(m.top, m.config))
			if m.encode != nil {
				body = m.encode(body)
			}
			statuses := map[int]int{}
			for range 3 {
				status, _, _ := postJSON(t, cs.Base+s.path, key, string(body), m.header...)
				statuses[status]++
			}
			served := up.Served(key)
			for st := range statuses {
				if st != 200 && st != 429 && st != 400 && st != 413 && st != 415 {
					t.Errorf("%s: statuses %v, want 200, 429 or a refusal", key, statuses)
				}
			}
			if served > laxBudget+laxSlack {
				t.Errorf("%s: statuses %v, the upstream served %d tokens, over the budget of %d", key, statuses, served, laxBudget)
			}
		}
	}
}
