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

// Capped is an LLM upstream that generates exactly the output cap each request sends, in the
// wire format of the API its path names: OpenAI chat completions (`max_completion_tokens`, else
// `max_tokens`) and Responses (`max_output_tokens`), Anthropic Messages (`max_tokens`) and Gemini
// generateContent and streamGenerateContent (`generationConfig.maxOutputTokens`, or its
// snake_case spelling). A request without a cap generates NoCap tokens. It reports as prompt
// tokens a quarter of the request body's bytes (at most one token per byte, as real tokenizers
// count text), as JSON or, for a stream ("stream": true, or Gemini's :streamGenerateContent),
// as the API's event stream with its usage, gzip-compressed when the request's Accept-Encoding
// allows it; a request with the header X-No-Usage gets a JSON body without a usage. It records
// every usage it reported (as if X-No-Usage's had been reported too) and the caps it received.
type Capped struct {
	*httptest.Server
	// NoCap is the output a request without a cap generates; set before the first request.
	NoCap int64

	mu       sync.Mutex
	reported int64   // the tokens of every usage reported
	caps     []int64 // the output cap of each request, 0 for none
	inFlight int
	peak     int
}

// StartCapped starts a Capped upstream, closed when the test ends.
func StartCapped(t testing.TB) *Capped {
	c := &Capped{NoCap: 100_000}
	c.Server = httptest.NewServer(http.HandlerFunc(c.serve))
	t.Cleanup(c.Close)
	return c
}

// Reported returns the sum of the prompt and output tokens of every usage reported so far, and
// the caps received (0: none), in order.
func (c *Capped) Reported() (tokens int64, caps []int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reported, append([]int64(nil), c.caps...)
}

// Peak returns the most requests the upstream served at once.
func (c *Capped) Peak() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.peak
}

// cappedRequest is what Capped reads of a request: the caps of every API (the last of a key
// given twice, as encoding/json reads it) and whether it streams.
type cappedRequest struct {
	Stream              bool   `json:"stream"`
	MaxTokens           *int64 `json:"max_tokens"`
	MaxCompletionTokens *int64 `json:"max_completion_tokens"`
	MaxOutputTokens     *int64 `json:"max_output_tokens"`
	GenerationConfig    *struct {
		MaxOutputTokens *int64 `json:"maxOutputTokens"`
	} `json:"generationConfig"`
	GenerationConfigSnake *struct {
		MaxOutputTokens *int64 `json:"max_output_tokens"`
	} `json:"generation_config"`
}

// cap returns the output cap req asks of api, 0 when none.
func (q *cappedRequest) cap(api string) int64 {
	var v *int64
	switch api {
	case "chat":
		v = q.MaxCompletionTokens
		if v == nil {
			v = q.MaxTokens
		}
	case "responses":
		v = q.MaxOutputTokens
	case "anthropic":
		v = q.MaxTokens
	case "gemini":
		if q.GenerationConfig != nil && q.GenerationConfig.MaxOutputTokens != nil {
			v = q.GenerationConfig.MaxOutputTokens
		} else if q.GenerationConfigSnake != nil {
			v = q.GenerationConfigSnake.MaxOutputTokens
		}
	}
	if v == nil || *v < 1 {
		return 0
	}
	return *v
}

// apiOf names the API of path: chat, responses, anthropic, gemini, or "" for none.
func apiOf(path string) (api string, stream bool) {
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		return "chat", false
	case strings.HasSuffix(path, "/responses"):
		return "responses", false
	case strings.HasSuffix(path, "/messages"):
		return "anthropic", false
	case strings.HasSuffix(path, ":generateContent"):
		return "gemini", false
	case strings.HasSuffix(path, ":streamGenerateContent"):
		return "gemini", true
	}
	return "", false
}

func (c *Capped) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	api, stream := apiOf(r.URL.Path)
	var req cappedRequest
	if api == "" || json.Unmarshal(body, &req) != nil {
		http.Error(w, `{"error":{"message":"bad request"}}`, http.StatusBadRequest)
		return
	}
	stream = stream || req.Stream
	limit := req.cap(api)
	out := limit
	if out == 0 {
		out = c.NoCap
	}
	prompt := int64(len(body) / 4)
	c.mu.Lock()
	c.reported += prompt + out
	c.caps = append(c.caps, limit)
	c.inFlight++
	c.peak = max(c.peak, c.inFlight)
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.inFlight--
		c.mu.Unlock()
	}()
	var wr io.Writer = w
	flush := func() { _ = http.NewResponseController(w).Flush() }
	if strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") {
		w.Header().Set("Content-Encoding", "gzip")
		gz := gzip.NewWriter(w)
		defer gz.Close()
		wr = gz
		flush = func() { _ = gz.Flush(); _ = http.NewResponseController(w).Flush() }
	}
	text := strings.Repeat("y", int(min(out, 64)))
	if r.Header.Get("X-No-Usage") != "" { // a response that reports no usage: charged missing
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(wr, `{"id":"x","choices":[]}`)
		return
	}
	if !stream {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(wr, cappedJSON(api, text, prompt, out))
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	for _, e := range cappedEvents(api, text, prompt, out) {
		_, _ = io.WriteString(wr, e)
		flush()
	}
}

// cappedJSON is a complete response of api with text, reporting prompt and out tokens, stopped
// by its cap.
func cappedJSON(api, text string, prompt, out int64) string {
	switch api {
	case "responses":
		return fmt.Sprintf(`{"id":"resp_1","object":"response","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":%q,"annotations":[]}]}],"usage":{"input_tokens":%d,"output_tokens":%d,"total_tokens":%d}}`, text, prompt, out, prompt+out)
	case "anthropic":
		return fmt.Sprintf(`{"id":"msg_1","type":"message","role":"assistant","model":"claude","content":[{"type":"text","text":%q}],"stop_reason":"max_tokens","stop_sequence":null,"usage":{"input_tokens":%d,"output_tokens":%d}}`, text, prompt, out)
	case "gemini":
		return geminiChunk(text, prompt, out, true)
	}
	return fmt.Sprintf(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"length"}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`, text, prompt, out, prompt+out)
}

// geminiChunk is a generateContent response (or one event of a stream) with text, its usage
// metadata at prompt and out tokens, finished by its cap when last.
func geminiChunk(text string, prompt, out int64, last bool) string {
	finish := ""
	if last {
		finish = `,"finishReason":"MAX_TOKENS"`
	}
	return fmt.Sprintf(`{"candidates":[{"content":{"parts":[{"text":%q}],"role":"model"},"index":0%s}],"usageMetadata":{"promptTokenCount":%d,"candidatesTokenCount":%d,"totalTokenCount":%d},"modelVersion":"gemini"}`, text, finish, prompt, out, prompt+out)
}

// cappedEvents is the event stream of api for a response with text, reporting prompt and out
// tokens, stopped by its cap.
func cappedEvents(api, text string, prompt, out int64) []string {
	switch api {
	case "responses":
		return []string{
			"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"output\":[]}}\n\n",
			fmt.Sprintf("event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"item_id\":\"m\",\"output_index\":0,\"content_index\":0,\"delta\":%q}\n\n", text),
			// A response stopped by its cap ends with response.incomplete, not response.completed.
			fmt.Sprintf("event: response.incomplete\ndata: {\"type\":\"response.incomplete\",\"response\":%s}\n\n", cappedJSON(api, text, prompt, out)),
		}
	case "anthropic":
		return []string{
			fmt.Sprintf("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude\",\"content\":[],\"stop_reason\":null,\"usage\":{\"input_tokens\":%d,\"output_tokens\":1}}}\n\n", prompt),
			"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
			fmt.Sprintf("event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":%q}}\n\n", text),
			"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
			fmt.Sprintf("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":%d}}\n\n", out),
			"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
		}
	case "gemini":
		return []string{
			"data: " + geminiChunk(text, prompt, 1, false) + "\r\n\r\n",
			"data: " + geminiChunk(text, prompt, out, true) + "\r\n\r\n",
		}
	}
	return []string{
		fmt.Sprintf("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":%q},\"finish_reason\":null}]}\n\n", text),
		"data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n",
		fmt.Sprintf("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\n", prompt, out, prompt+out),
		"data: [DONE]\n\n",
	}
}
