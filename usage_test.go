package ratelimitredis

import (
	"strings"
	"testing"
)

// TestUsageScanner: the last usage object of a body, whatever the chunking, in the shapes of
// chat completions (JSON and stream) and of the Responses API.
func TestUsageScanner(t *testing.T) {
	for _, tc := range []struct {
		name, body                string
		total, prompt, completion int64
		found                     bool
	}{
		{"chat completion", `{"id":"x","choices":[{"message":{"content":"the \"usage\": {\"total_tokens\": 9}"}}],"usage": {"prompt_tokens":100,"completion_tokens":200,"total_tokens":300,"prompt_tokens_details":{"cached_tokens":0}}}`, 300, 100, 200, true},
		{"stream", "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":5,\"total_tokens\":12}}\n\ndata: [DONE]\n\n", 12, 7, 5, true},
		{"responses completed", "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"status\":\"completed\",\"usage\":{\"input_tokens\":40,\"output_tokens\":2,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":42}}}\n\n", 42, 40, 2, true},
		{"no total", `{"usage":{"prompt_tokens":1,"completion_tokens":2}}`, 3, 1, 2, true},
		{"none", `{"choices":[],"usage":null}`, 0, 0, 0, false},
		{"too big", `{"usage":{"x":"` + strings.Repeat("a", maxUsageBytes) + `","total_tokens":5}}`, 0, 0, 0, false},
	} {
		for _, chunk := range []int{1, 3, 64, 1 << 20} {
			s := new(usageScanner)
			for b := tc.body; b != ""; {
				n := min(chunk, len(b))
				s.Write([]byte(b[:n]))
				b = b[n:]
			}
			for which, want := range map[string]int64{UsageTotal: tc.total, UsagePrompt: tc.prompt, UsageCompletion: tc.completion} {
				got, ok := s.tokens(which)
				if ok != tc.found || got != want {
					t.Errorf("%s, chunks of %d: %s = %d, %v; want %d, %v", tc.name, chunk, which, got, ok, want, tc.found)
				}
			}
			if cap(s.buf) > 2*maxUsageBytes {
				t.Errorf("%s: kept %d bytes", tc.name, cap(s.buf))
			}
		}
	}
}
