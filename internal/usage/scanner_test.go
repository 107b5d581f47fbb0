package usage

import (
	"bytes"
	"encoding/json"
	"io"
	"math"
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

	// Security review III, finding 3: reflected client data cannot set the charge.
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

// scanUsage scans body in chunks of chunk bytes and returns the total, prompt and completion
// counts it reads (-1: none) and the scanner.
func scanUsage(sse bool, body string, chunk int) ([3]int64, *Scanner) {
	s := NewScanner(sse)
	for b := body; b != ""; {
		n := min(chunk, len(b))
		_, _ = s.Write([]byte(b[:n]))
		b = b[n:]
	}
	var got [3]int64
	for i, which := range []string{Total, Prompt, Completion} {
		n, ok := s.Tokens(which)
		if !ok {
			n = -1
		}
		got[i] = n
	}
	return got, s
}

// TestUsageScanner: the usage of a body, whatever the chunking, in the shapes of chat
// completions (JSON and stream) and of the Responses API; a usage object anywhere but the top
// level (or a Responses API event's response) is not one; a count that is negative or not an
// integer makes the usage one that cannot be charged.
func TestUsageScanner(t *testing.T) {
	t.Parallel()
	for _, tc := range usageCases {
		want := [3]int64{tc.total, tc.prompt, tc.completion}
		for _, chunk := range []int{1, 3, 64, 1 << 20} {
			got, s := scanUsage(tc.sse, tc.body, chunk)
			if got != want {
				t.Errorf("%s, chunks of %d: total, prompt, completion = %v; want %v", tc.name, chunk, got, want)
			}
			if cap(s.buf) > 2*maxUsageBytes || cap(s.key) > 2*maxKeyBytes {
				t.Errorf("%s: kept %d + %d bytes", tc.name, cap(s.buf), cap(s.key))
			}
		}
	}
}

// FuzzUsage: for any body and any split into two writes, as JSON and as an event stream, the
// scanner reads the same counts as with one write, and keeps at most its bounds; for a body that
// is one valid JSON document, it reads what encoding/json finds at the places the scanner reads
// (the last object value of a top-level "usage", or of "usage" in a top-level "response"
// object), with the same rules for the counts.
func FuzzUsage(f *testing.F) {
	for _, tc := range usageCases {
		f.Add([]byte(tc.body), uint16(len(tc.body)/2))
	}
	f.Fuzz(func(t *testing.T, body []byte, split uint16) {
		for _, sse := range []bool{false, true} {
			whole, s := scanUsage(sse, string(body), len(body)+1)
			at := int(split) % (len(body) + 1)
			s2 := NewScanner(sse)
			_, _ = s2.Write(body[:at])
			_, _ = s2.Write(body[at:])
			for i, which := range []string{Total, Prompt, Completion} {
				n, ok := s2.Tokens(which)
				if !ok {
					n = -1
				}
				if n != whole[i] {
					t.Fatalf("sse %v: %s = %d written at once, %d split at %d", sse, which, whole[i], n, at)
				}
			}
			if cap(s.buf) > 2*maxUsageBytes || cap(s.key) > 2*maxKeyBytes || cap(s2.buf) > 2*maxUsageBytes {
				t.Fatalf("kept %d, %d, %d bytes", cap(s.buf), cap(s.key), cap(s2.buf))
			}
			if sse || !json.Valid(body) {
				continue
			}
			if want := referenceUsage(body); whole != want {
				t.Fatalf("scanner: %v, encoding/json: %v", whole, want)
			}
		}
	})
}

var jsonInteger = regexp.MustCompile(`^(0|[1-9][0-9]*)$`)

// referenceUsage reads the counts of body, one valid JSON document, with encoding/json: the last
// object value of "usage" in the top-level object, or in its "response" objects, in document
// order.
func referenceUsage(body []byte) [3]int64 {
	none := [3]int64{-1, -1, -1}
	var last json.RawMessage
	var walk func(doc json.RawMessage, inner bool)
	walk = func(doc json.RawMessage, inner bool) {
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
				last = v
			case k == "response" && !inner:
				walk(v, true)
			}
		}
	}
	walk(body, false)
	if last == nil || len(last) > maxUsageBytes {
		return none
	}
	dec := json.NewDecoder(bytes.NewReader(last))
	dec.UseNumber()
	var m map[string]any
	if dec.Decode(&m) != nil {
		return none
	}
	var c [5]int64
	for i, name := range []string{"total_tokens", "prompt_tokens", "completion_tokens", "input_tokens", "output_tokens"} {
		c[i] = -1
		switch v := m[name].(type) {
		case nil:
		case json.Number:
			n, err := strconv.ParseInt(string(v), 10, 64)
			if !jsonInteger.MatchString(string(v)) || err != nil {
				return none
			}
			c[i] = n
		default:
			return none
		}
	}
	either := func(a, b int64) int64 {
		if a >= 0 {
			return a
		}
		return b
	}
	in, out := either(c[1], c[3]), either(c[2], c[4])
	total := c[0]
	if total < 0 && in >= 0 && out >= 0 {
		total = in + out
		if total < 0 {
			total = math.MaxInt64
		}
	}
	return [3]int64{total, in, out}
}

var _ io.Writer = (*Scanner)(nil)
