// Package llmtest serves what the tests put behind the module as an LLM provider: Anthropic's
// Messages API, as a real HTTP server speaking its wire format.
package llmtest

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// AnthropicUsage are the token counts a Messages API response reports in its usage.
type AnthropicUsage struct {
	Input      int64 // input_tokens: neither read from nor written to the prompt cache
	CacheWrite int64 // cache_creation_input_tokens
	CacheRead  int64 // cache_read_input_tokens
	Output     int64 // output_tokens
}

// Total is every token of u: what `charge anthropic_usage total` charges.
func (u AnthropicUsage) Total() int64 { return u.Input + u.CacheWrite + u.CacheRead + u.Output }

// Anthropic is a fake of Anthropic's Messages API (POST /v1/messages), as its SDKs and the
// module read it: a message as JSON, or, for "stream": true, an event stream whose
// message_start carries the input counts (and output_tokens 1) and whose message_delta carries
// the output count. It answers gzip-compressed when the request's Accept-Encoding allows gzip,
// as Anthropic's API does, else identity. It refuses, as the API does (400
// invalid_request_error), a body that is not JSON or holds a field the API does not know (such
// as OpenAI's stream_options). A request with the header X-Cut-Short gets a stream that ends
// after its first text delta, with no message_delta. It records what it received.
type Anthropic struct {
	*httptest.Server
	usage AnthropicUsage

	mu        sync.Mutex
	bodies    [][]byte // the request bodies received, in order
	encodings []string // the Content-Encoding of each answer ("" for identity)
}

// StartAnthropic starts an Anthropic upstream whose every message reports u, closed when the
// test ends.
func StartAnthropic(t testing.TB, u AnthropicUsage) *Anthropic {
	a := &Anthropic{usage: u}
	a.Server = httptest.NewServer(http.HandlerFunc(a.serve))
	t.Cleanup(a.Close)
	return a
}

// Received returns the request bodies received so far, and the Content-Encoding of each answer.
func (a *Anthropic) Received() (bodies [][]byte, encodings []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([][]byte(nil), a.bodies...), append([]string(nil), a.encodings...)
}

// messageFields are the fields of a Messages API request that this fake knows: the API refuses
// any other.
var messageFields = map[string]bool{"model": true, "messages": true, "max_tokens": true, "stream": true, "system": true,
	"metadata": true, "stop_sequences": true, "temperature": true, "top_k": true, "top_p": true, "tools": true, "tool_choice": true}

func (a *Anthropic) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var req map[string]json.RawMessage
	bad := r.Method != http.MethodPost || r.URL.Path != "/v1/messages" || json.Unmarshal(body, &req) != nil
	for name := range req {
		bad = bad || !messageFields[name]
	}
	encoding := ""
	if strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") && !bad {
		encoding = "gzip"
	}
	a.mu.Lock()
	a.bodies, a.encodings = append(a.bodies, body), append(a.encodings, encoding)
	a.mu.Unlock()
	if bad {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"type":"error","error":{"type":"invalid_request_error","message":"not a Messages API request this server knows"}}`)
		return
	}
	var out io.Writer = w
	flush := func() { _ = http.NewResponseController(w).Flush() }
	if encoding == "gzip" {
		w.Header().Set("Content-Encoding", "gzip")
		zw := gzip.NewWriter(w)
		defer zw.Close()
		out = zw
		flush = func() { _ = zw.Flush(); _ = http.NewResponseController(w).Flush() }
	}
	u := a.usage
	usage := fmt.Sprintf(`{"input_tokens":%d,"cache_creation_input_tokens":%d,"cache_read_input_tokens":%d,"output_tokens":%d}`,
		u.Input, u.CacheWrite, u.CacheRead, u.Output)
	model := string(req["model"])
	if string(req["stream"]) != "true" {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(out, `{"id":"msg_1","type":"message","role":"assistant","model":%s,"content":[{"type":"text","text":"Hello \"usage\": {\"input_tokens\": 0}"}],"stop_reason":"end_turn","stop_sequence":null,"usage":%s}`, model, usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	event := func(name, data string) {
		fmt.Fprintf(out, "event: %s\ndata: %s\n\n", name, data)
		flush()
	}
	start := fmt.Sprintf(`{"input_tokens":%d,"cache_creation_input_tokens":%d,"cache_read_input_tokens":%d,"output_tokens":1}`, u.Input, u.CacheWrite, u.CacheRead)
	event("message_start", `{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":`+model+`,"content":[],"stop_reason":null,"stop_sequence":null,"usage":`+start+`}}`)
	event("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`)
	event("ping", `{"type": "ping"}`)
	event("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}`)
	if r.Header.Get("X-Cut-Short") != "" {
		return
	}
	event("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" \"usage\": {\"output_tokens\": 0}"}}`)
	event("content_block_stop", `{"type":"content_block_stop","index":0}`)
	event("message_delta", fmt.Sprintf(`{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":%d}}`, u.Output))
	event("message_stop", `{"type":"message_stop"}`)
}
