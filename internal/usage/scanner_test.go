package usage

import (
	"bytes"
	"encoding/json"
	"io"
	"math"
	"math/big"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// usageCase is a body, and the counts the scanner must read from it: -1 where none can be
// charged (no usage object, or a bad one).
type usageCase struct {
	name                      string
	sse                       bool
	body                      string
	total, prompt, completion int64
}

var usageCases = []usageCase{
	{"chat completion", false, `{"id":"x","choices":[{"message":{"content":"the \"usage\": {\"total_tokens\": 9}"}}],"usage": {"prompt_tokens":100,"completion_tokens":200,"total_tokens":300,"prompt_tokens_details":{"cached_tokens":0}}}`, 300, 100, 200},
	{"stream", true, "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":5,\"total_tokens\":12}}\n\ndata: [DONE]\n\n", 12, 7, 5},
	{"stream, CRLF", true, "data: {\"usage\":null}\r\n\r\ndata: {\"choices\":[],\"usage\":{\"total_tokens\":12}}\r\n\r\ndata: [DONE]\r\n\r\n", 12, -1, -1},
	{"stream, one event on two data lines", true, "data: {\"choices\":[],\ndata: \"usage\":{\"total_tokens\":12}}\n\n", 12, -1, -1},
	{"responses completed", true, "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"status\":\"completed\",\"usage\":{\"input_tokens\":40,\"output_tokens\":2,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":42}}}\n\n", 42, 40, 2},
	{"responses JSON", false, `{"object":"response","output":[{"content":[{"text":"{\"usage\":{\"total_tokens\":1}}"}]}],"usage":{"input_tokens":40,"output_tokens":2,"total_tokens":42}}`, 42, 40, 2},
	{"no total", false, `{"usage":{"prompt_tokens":1,"completion_tokens":2}}`, 3, 1, 2},
	{"sum too large", false, `{"usage":{"prompt_tokens":9223372036854775807,"completion_tokens":1}}`, math.MaxInt64, math.MaxInt64, 1},
	{"none", false, `{"choices":[],"usage":null}`, -1, -1, -1},
	{"too big", false, `{"usage":{"x":"` + strings.Repeat("a", maxUsageBytes) + `","total_tokens":5}}`, -1, -1, -1},
	{"escaped key usage", false, `{"us\u0061ge":{"total_tokens":7}}`, 7, -1, -1},

	// Reflected client data cannot set the charge.
	{"reflected JSON after the usage (t_charge d)", false, `{"usage":{"total_tokens":5000},"echo":{"usage":{"total_tokens":0}}}`, 5000, -1, -1},
	{"reflected JSON in an array", false, `{"usage":{"total_tokens":5000},"messages":[{"usage":{"total_tokens":0}}]}`, 5000, -1, -1},
	{"a key a\"usage, nested (t_charge e)", false, `{"usage":{"total_tokens":5000},"meta":{"a\"usage":{"total_tokens":0}}}`, 5000, -1, -1},
	{"a key a\"usage, top level", false, `{"usage":{"total_tokens":5000},"a\"usage":{"total_tokens":0}}`, 5000, -1, -1},
	{"usage only in a string (t_charge f)", false, `{"usage":{"total_tokens":5000},"c":"\"usage\":{\"total_tokens\":0}"}`, 5000, -1, -1},
	{"a string ending in a backslash", false, `{"usage":{"total_tokens":5000},"c":"\\","d":"\"usage\":{\"total_tokens\":0}"}`, 5000, -1, -1},
	{"negative parts (t_charge g)", false, `{"usage":{"prompt_tokens":-100000,"completion_tokens":100001}}`, -1, -1, -1},
	{"a fraction", false, `{"usage":{"total_tokens":1.5}}`, -1, -1, -1},
	{"an exponent", false, `{"usage":{"total_tokens":5e3}}`, -1, -1, -1},
	{"a string count", false, `{"usage":{"total_tokens":"5000"}}`, -1, -1, -1},
	{"a count above 2^63 − 1", false, `{"usage":{"total_tokens":9223372036854775808}}`, -1, -1, -1},
	{"a top-level array", false, `[{"usage":{"total_tokens":1}}]`, -1, -1, -1},
	{"stream: usage in a chunk's choices", true, "data: {\"choices\":[{\"usage\":{\"total_tokens\":1}}]}\n\n", -1, -1, -1},
	{"stream: usage in a comment or another field", true, ": {\"usage\":{\"total_tokens\":1}}\nevent: {\"usage\":{\"total_tokens\":1}}\n\ndata: {\"x\":1}\n\n", -1, -1, -1},
	{"stream: a response's nested usage", true, "data: {\"response\":{\"output\":{\"usage\":{\"total_tokens\":1}}}}\n\n", -1, -1, -1},
	{"stream: an event cut short does not carry into the next", true, "data: {\"a\":{\"b\":\"\n\ndata: {\"usage\":{\"total_tokens\":3}}\n\n", 3, -1, -1},
}

// anthropicCases are bodies of Anthropic's Messages API, and the counts the scanner must read
// from them.
var anthropicCases = []usageCase{
	{"message", false, `{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"the \"usage\": {\"input_tokens\": 1}"}],"usage":{"input_tokens":100,"cache_creation_input_tokens":20,"cache_read_input_tokens":30,"output_tokens":50}}`, 200, 150, 50},
	{"message without cache counts", false, `{"type":"message","usage":{"input_tokens":100,"output_tokens":50}}`, 150, 100, 50},
	{"message, cache counts null", false, `{"type":"message","usage":{"input_tokens":7,"cache_creation_input_tokens":null,"cache_read_input_tokens":null,"output_tokens":5,"cache_creation":{"ephemeral_5m_input_tokens":0},"service_tier":"standard"}}`, 12, 7, 5},
	{"stream", true, "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"content\":[],\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":10,\"output_tokens\":1}}}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n", 50, 35, 15},
	{"stream, cumulative input in message_delta", true, "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":40,\"output_tokens\":9}}\n\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n", 55, 40, 15},
	{"stream cut short before message_delta", true, "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hi\"}}\n\n", -1, -1, -1},
	{"stream without message_start", true, "data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n", -1, -1, 15},
	{"a bad count anywhere", true, "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":-25}}}\n\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n", -1, -1, -1},
	{"a fraction", false, `{"usage":{"input_tokens":1.5,"output_tokens":1}}`, -1, -1, -1},
	{"OpenAI's response object is not read", true, "data: {\"response\":{\"usage\":{\"input_tokens\":1,\"output_tokens\":1}}}\n\n", -1, -1, -1},
	{"OpenAI's counts are not read", false, `{"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`, -1, -1, -1},
	{"reflected usage nested", false, `{"usage":{"input_tokens":9,"output_tokens":1},"content":[{"usage":{"input_tokens":0}}],"meta":{"usage":{"output_tokens":0}}}`, 10, 9, 1},
	{"a message's nested usage", true, "data: {\"message\":{\"content\":{\"usage\":{\"input_tokens\":1}}}}\n\ndata: {\"usage\":{\"input_tokens\":3,\"output_tokens\":4}}\n\n", 7, 3, 4},
	{"sum too large", false, `{"usage":{"input_tokens":9223372036854775807,"cache_read_input_tokens":5,"output_tokens":1}}`, math.MaxInt64, math.MaxInt64, 1},
}

// geminiCases are Gemini's usageMetadata: input is promptTokenCount (cached included) and
// toolUsePromptTokenCount, output candidatesTokenCount and thoughtsTokenCount, a count left out
// is 0; in a JSON body, an SSE stream (the last chunk's decides) and a JSON array of chunks.
var geminiCases = []usageCase{
	{"generateContent", false, `{"candidates":[{"content":{"parts":[{"text":"the \"usageMetadata\": {}"}],"role":"model"},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":10,"candidatesTokenCount":20,"totalTokenCount":30},"modelVersion":"gemini-2.5-flash"}`, 30, 10, 20},
	{"thoughts and tools", false, `{"usageMetadata":{"promptTokenCount":10,"cachedContentTokenCount":4,"candidatesTokenCount":20,"thoughtsTokenCount":100,"toolUsePromptTokenCount":5,"totalTokenCount":135}}`, 135, 15, 120},
	{"no total", false, `{"usageMetadata":{"promptTokenCount":10,"candidatesTokenCount":20}}`, 30, 10, 20},
	{"zeros left out", false, `{"usageMetadata":{"promptTokenCount":7}}`, 7, 7, 0},
	{"stream", true, "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"Hel\"}]}}],\"usageMetadata\":{\"promptTokenCount\":10,\"totalTokenCount\":10}}\r\n\r\ndata: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"lo\"}]},\"finishReason\":\"STOP\"}],\"usageMetadata\":{\"promptTokenCount\":10,\"candidatesTokenCount\":2,\"totalTokenCount\":12}}\r\n\r\n", 12, 10, 2},
	{"stream as a JSON array", false, `[{"candidates":[],"usageMetadata":{"promptTokenCount":10,"totalTokenCount":10}},
{"candidates":[],"usageMetadata":{"promptTokenCount":10,"candidatesTokenCount":3,"totalTokenCount":13}}]`, 13, 10, 3},
	{"nested usageMetadata is not read", false, `{"candidates":[{"usageMetadata":{"promptTokenCount":1}}],"x":{"usageMetadata":{"promptTokenCount":1}}}`, -1, -1, -1},
	{"OpenAI's usage is not read", false, `{"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`, -1, -1, -1},
	{"a bad count", false, `{"usageMetadata":{"promptTokenCount":-1,"candidatesTokenCount":2}}`, -1, -1, -1},
	{"a string count", false, `{"usageMetadata":{"promptTokenCount":"10"}}`, -1, -1, -1},
	{"the key with every letter escaped", false, `{"\u0075\u0073\u0061\u0067\u0065\u004d\u0065\u0074\u0061\u0064\u0061\u0074\u0061":{"promptTokenCount":4,"candidatesTokenCount":5}}`, 9, 4, 5},
}

// scanUsage scans body of format in chunks of chunk bytes and returns the total, prompt and
// completion counts it reads (-1: none) and the scanner.
func scanUsage(format Format, sse bool, body string, chunk int) ([3]int64, *Scanner) {
	s := NewScanner(format, sse)
	for b := body; b != ""; {
		n := min(chunk, len(b))
		_, _ = s.Write([]byte(b[:n]))
		b = b[n:]
	}
	return tokens(s), s
}

// tokens returns the total, prompt and completion counts s reads (-1: none).
func tokens(s *Scanner) [3]int64 {
	var got [3]int64
	for i, which := range []string{Total, Prompt, Completion} {
		n, ok := s.Tokens(which)
		if !ok {
			n = -1
		}
		got[i] = n
	}
	return got
}

// TestUsageScanner: the usage of a body, whatever the chunking, in the shapes of chat
// completions (JSON and stream) and of the Responses API, and of Anthropic's Messages API (JSON,
// and a stream whose counts come in message_start and message_delta); a usage object anywhere
// but the top level (or a Responses API event's response, an Anthropic event's message) is not
// one; a count that is negative or not an integer makes the usage one that cannot be charged.
func TestUsageScanner(t *testing.T) {
	t.Parallel()
	for format, cases := range map[Format][]usageCase{OpenAI: usageCases, Anthropic: anthropicCases, Gemini: geminiCases} {
		for _, tc := range cases {
			want := [3]int64{tc.total, tc.prompt, tc.completion}
			for _, chunk := range []int{1, 3, 64, 1 << 20} {
				got, s := scanUsage(format, tc.sse, tc.body, chunk)
				if got != want {
					t.Errorf("format %d, %s, chunks of %d: total, prompt, completion = %v; want %v", format, tc.name, chunk, got, want)
				}
				if cap(s.buf) > 2*maxUsageBytes || cap(s.key) > 2*maxKeyBytes {
					t.Errorf("%s: kept %d + %d bytes", tc.name, cap(s.buf), cap(s.key))
				}
			}
		}
	}
}

// testWeights are the weights of the tests: prompt 1, completion 4, cached 0.1, cache_write 1.25.
var testWeights = &Weights{Prompt: big.NewRat(1, 1), Completion: big.NewRat(4, 1), Cached: big.NewRat(1, 10), CacheWrite: big.NewRat(5, 4)}

// TestWeighted: what a usage is charged under weights (prompt 1, completion 4, cached 0.1,
// cache_write 1.25), rounded up exactly; OpenAI's cached tokens are part of its prompt count,
// Anthropic's are not part of its input_tokens; an embeddings usage (no completion count) has
// the total less the prompt as its completion; a usage whose cached tokens exceed its prompt, or
// whose cached count is not a count, cannot be charged.
func TestWeighted(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		format Format
		sse    bool
		body   string
		want   int64 // -1: cannot be charged
	}{
		{"chat, no cache", OpenAI, false, `{"usage":{"prompt_tokens":100,"completion_tokens":50,"total_tokens":150}}`, 300},
		{"chat, 30 cached: 70 + 3 + 200", OpenAI, false, `{"usage":{"prompt_tokens":100,"completion_tokens":50,"total_tokens":150,"prompt_tokens_details":{"cached_tokens":30,"audio_tokens":0}}}`, 273},
		{"chat, 31 cached: 69 + 3.1 + 200, rounded up", OpenAI, false, `{"usage":{"prompt_tokens":100,"completion_tokens":50,"prompt_tokens_details":{"cached_tokens":31}}}`, 273},
		{"chat, every prompt token cached: 30 × 0.1 is exactly 3", OpenAI, false, `{"usage":{"prompt_tokens":30,"completion_tokens":0,"prompt_tokens_details":{"cached_tokens":30}}}`, 3},
		{"chat, cached null", OpenAI, false, `{"usage":{"prompt_tokens":10,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":null}}}`, 14},
		{"chat stream", OpenAI, true, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":10}}}\n\ndata: [DONE]\n\n", 5},
		{"responses, cached in input_tokens_details", OpenAI, true, "data: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":40,\"input_tokens_details\":{\"cached_tokens\":20},\"output_tokens\":2,\"output_tokens_details\":{\"reasoning_tokens\":1},\"total_tokens\":42}}}\n\n", 30},
		{"embeddings: total less prompt", OpenAI, false, `{"object":"list","usage":{"prompt_tokens":8,"total_tokens":8}}`, 8},
		{"no prompt count", OpenAI, false, `{"usage":{"total_tokens":8}}`, -1},
		{"cached above the prompt", OpenAI, false, `{"usage":{"prompt_tokens":10,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":11}}}`, -1},
		{"cached a string", OpenAI, false, `{"usage":{"prompt_tokens":10,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":"1"}}}`, -1},
		{"anthropic: 100 + 3 + 25 + 200", Anthropic, false, `{"usage":{"input_tokens":100,"cache_creation_input_tokens":20,"cache_read_input_tokens":30,"output_tokens":50}}`, 328},
		{"anthropic stream", Anthropic, true, "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"cache_read_input_tokens\":10,\"output_tokens\":1}}}\n\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n", 86},
		{"anthropic stream cut short", Anthropic, true, "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n", -1},
		{"huge: at most 2^63 − 1", OpenAI, false, `{"usage":{"prompt_tokens":9223372036854775807,"completion_tokens":9223372036854775807}}`, math.MaxInt64},
	} {
		_, s := scanUsage(tc.format, tc.sse, tc.body, 7)
		got, ok := s.Weighted(testWeights)
		if !ok {
			got = -1
		}
		if got != tc.want {
			t.Errorf("%s: weighted %d, want %d", tc.name, got, tc.want)
		}
	}
}

// FuzzUsage: for any body and any split into two writes, as JSON and as an event stream, the
// scanner reads the same counts as with one write, and keeps at most its bounds; for a body that
// is one valid JSON document, it reads what encoding/json finds at the places the scanner reads
// (the last object value of a top-level "usage", or of "usage" in a top-level "response"
// object), with the same rules for the counts, and weighs them as big.Rat arithmetic does.
func FuzzUsage(f *testing.F) {
	for _, tc := range usageCases {
		f.Add([]byte(tc.body), uint16(len(tc.body)/2))
	}
	f.Fuzz(func(t *testing.T, body []byte, split uint16) { fuzzScanner(t, OpenAI, body, split) })
}

// FuzzAnthropicUsage is FuzzUsage for Anthropic's format: each count is the last found in a
// top-level "usage" object or the "usage" of a top-level "message" object, in document order,
// and a usage needs a top-level one.
func FuzzAnthropicUsage(f *testing.F) {
	for _, tc := range anthropicCases {
		f.Add([]byte(tc.body), uint16(len(tc.body)/2))
	}
	f.Fuzz(func(t *testing.T, body []byte, split uint16) { fuzzScanner(t, Anthropic, body, split) })
}

// FuzzGeminiUsage is FuzzUsage for Gemini's format: the last top-level "usageMetadata" object
// (of the document, or of each object of a top-level array) decides.
func FuzzGeminiUsage(f *testing.F) {
	for _, tc := range geminiCases {
		f.Add([]byte(tc.body), uint16(len(tc.body)/2))
	}
	f.Fuzz(func(t *testing.T, body []byte, split uint16) { fuzzScanner(t, Gemini, body, split) })
}

// fuzzScanner checks the scanner of format on body split at split (FuzzUsage).
func fuzzScanner(t *testing.T, format Format, body []byte, split uint16) {
	for _, sse := range []bool{false, true} {
		whole, s := scanUsage(format, sse, string(body), len(body)+1)
		wholeW, okW := s.Weighted(testWeights)
		at := int(split) % (len(body) + 1)
		s2 := NewScanner(format, sse)
		_, _ = s2.Write(body[:at])
		_, _ = s2.Write(body[at:])
		if got := tokens(s2); got != whole {
			t.Fatalf("sse %v: counts %v written at once, %v split at %d", sse, whole, got, at)
		}
		if w, ok := s2.Weighted(testWeights); w != wholeW || ok != okW {
			t.Fatalf("sse %v: weighted %d %v written at once, %d %v split at %d", sse, wholeW, okW, w, ok, at)
		}
		if cap(s.buf) > 2*maxUsageBytes || cap(s.key) > 2*maxKeyBytes || cap(s2.buf) > 2*maxUsageBytes {
			t.Fatalf("kept %d, %d, %d bytes", cap(s.buf), cap(s.key), cap(s2.buf))
		}
		if sse || !json.Valid(body) {
			continue
		}
		want, wantW := referenceUsage(format, body)
		if !okW {
			wholeW = -1
		}
		if whole != want || wholeW != wantW {
			t.Fatalf("scanner: %v weighted %d, encoding/json: %v weighted %d", whole, wholeW, want, wantW)
		}
	}
}

var jsonInteger = regexp.MustCompile(`^(0|[1-9][0-9]*)$`)

// referenceUsage reads the total, prompt and completion counts of body, one valid JSON document,
// in format, with encoding/json, and what they weigh under testWeights (-1: none): the object
// values of "usage" in the top-level object, or in its "response" (OpenAI) or "message"
// (Anthropic) objects, in document order; OpenAI's last decides, Anthropic's counts each keep
// their last value and need a top-level usage.
func referenceUsage(format Format, body []byte) ([3]int64, int64) {
	if format == Gemini {
		return referenceGemini(body)
	}
	none := [3]int64{-1, -1, -1}
	inner := "response"
	names := []string{"total_tokens", "prompt_tokens", "completion_tokens", "input_tokens", "output_tokens"}
	if format == Anthropic {
		inner = "message"
		names = []string{"input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}
	}
	c := make([]int64, len(names)+1) // the counts of names, then OpenAI's cached; -1 absent
	for i := range c {
		c[i] = -1
	}
	found, bad, cachedBad := false, false, false
	take := func(v json.RawMessage, top bool) {
		dec := json.NewDecoder(bytes.NewReader(v))
		dec.UseNumber()
		var m map[string]any
		if len(v) > maxUsageBytes || dec.Decode(&m) != nil {
			bad = true
			return
		}
		u := make([]int64, len(c))
		for i, name := range names {
			u[i] = refCount(m[name], &bad)
		}
		u[len(names)] = -1
		if format == OpenAI {
			for _, d := range []string{"prompt_tokens_details", "input_tokens_details"} {
				if details, ok := m[d].(map[string]any); ok && u[len(names)] == -1 {
					b := false
					if u[len(names)] = refCount(details["cached_tokens"], &b); b {
						u[len(names)] = -2
					}
				}
			}
			copy(c, u)
			found, cachedBad = true, u[len(names)] == -2
			return
		}
		for i, n := range u {
			if n >= 0 {
				c[i] = n
			}
		}
		found = found || top
	}
	var walk func(doc json.RawMessage, top bool)
	walk = func(doc json.RawMessage, top bool) {
		dec := json.NewDecoder(bytes.NewReader(doc))
		if t, err := dec.Token(); err != nil || t != json.Delim('{') {
			return
		}
		for dec.More() {
			t, _ := dec.Token()
			var v json.RawMessage
			_ = dec.Decode(&v)
			if len(v) == 0 || v[0] != '{' {
				continue
			}
			switch k, _ := t.(string); {
			case k == "usage":
				if format == OpenAI {
					bad = false // the last decides
				}
				take(v, top)
			case k == inner && top:
				walk(v, false)
			}
		}
	}
	walk(body, true)
	if !found || bad {
		return none, -1
	}
	var total, in, out, uncached, cached, written int64
	if format == Anthropic {
		total, in, out, uncached = -1, -1, c[1], c[0]
		cached, written = max(c[2], 0), max(c[3], 0)
		if c[0] >= 0 {
			in = addCapped(addCapped(c[0], cached), written)
		}
	} else {
		either := func(a, b int64) int64 {
			if a >= 0 {
				return a
			}
			return b
		}
		total, in, out, cached = c[0], either(c[1], c[3]), either(c[2], c[4]), max(c[5], 0)
		uncached = in - cached
	}
	if total < 0 && in >= 0 && out >= 0 {
		total = addCapped(in, out)
	}
	weighted := int64(-1)
	if out < 0 && total >= in {
		out = total - in
	}
	if !cachedBad && in >= 0 && uncached >= 0 && out >= 0 {
		sum := new(big.Rat)
		for _, term := range []struct {
			w *big.Rat
			n int64
		}{{testWeights.Prompt, uncached}, {testWeights.Cached, cached}, {testWeights.CacheWrite, written}, {testWeights.Completion, out}} {
			sum.Add(sum, new(big.Rat).Mul(term.w, new(big.Rat).SetInt64(term.n)))
		}
		weighted = math.MaxInt64
		if q := new(big.Int).Add(new(big.Int).Quo(sum.Num(), sum.Denom()), big.NewInt(0)); !sum.IsInt() {
			q.Add(q, big.NewInt(1))
			if q.IsInt64() {
				weighted = q.Int64()
			}
		} else if q.IsInt64() {
			weighted = q.Int64()
		}
	}
	return [3]int64{total, in, tokensOut(c, format)}, weighted
}

// tokensOut is the completion count of the reference counts c of format.
func tokensOut(c []int64, format Format) int64 {
	if format == Anthropic {
		return c[1]
	}
	if c[2] >= 0 {
		return c[2]
	}
	return c[4]
}

// refCount reads one count of a usage object as encoding/json decoded it (UseNumber): -1 when
// absent or null; bad is set when it is present but not a non-negative integer of at most
// 2^63 − 1.
func refCount(v any, bad *bool) int64 {
	switch v := v.(type) {
	case nil:
		return -1
	case json.Number:
		n, err := strconv.ParseInt(string(v), 10, 64)
		if !jsonInteger.MatchString(string(v)) || err != nil {
			*bad = true
			return -1
		}
		return n
	}
	*bad = true
	return -1
}

// referenceGemini reads body, one valid JSON document, as Gemini's format with encoding/json: the
// last "usageMetadata" object of the top-level object, or of the objects of a top-level array;
// its counts, left out as 0, and what they weigh under testWeights (-1: none).
func referenceGemini(body []byte) ([3]int64, int64) {
	none := [3]int64{-1, -1, -1}
	var docs []json.RawMessage
	if err := json.Unmarshal(body, &docs); err != nil {
		docs = []json.RawMessage{body}
	}
	var last map[string]any
	bad := false
	for _, doc := range docs {
		dec := json.NewDecoder(bytes.NewReader(doc))
		if t, err := dec.Token(); err != nil || t != json.Delim('{') {
			continue
		}
		for dec.More() {
			t, _ := dec.Token()
			var v json.RawMessage
			_ = dec.Decode(&v)
			if k, _ := t.(string); k != "usageMetadata" || len(v) == 0 || v[0] != '{' {
				continue
			}
			d := json.NewDecoder(bytes.NewReader(v))
			d.UseNumber()
			last = nil
			bad = len(v) > maxUsageBytes || d.Decode(&last) != nil
		}
	}
	if last == nil || bad {
		return none, -1
	}
	n := func(name string) int64 { return max(refCount(last[name], &bad), 0) }
	in := addCapped(n("promptTokenCount"), n("toolUsePromptTokenCount"))
	out := addCapped(n("candidatesTokenCount"), n("thoughtsTokenCount"))
	cached := n("cachedContentTokenCount")
	total := refCount(last["totalTokenCount"], &bad)
	if bad {
		return none, -1
	}
	if total < 0 {
		total = addCapped(in, out)
	}
	if in < cached {
		return [3]int64{total, in, out}, -1
	}
	return [3]int64{total, in, out}, testWeights.Amount(in-cached, cached, 0, out)
}

var _ io.Writer = (*Scanner)(nil)
