package usage

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
)

// MaxIncludeUsageBody bounds the request body IncludeUsage reads, in bytes: MaxRequestBody.
const MaxIncludeUsageBody = MaxRequestBody

// IncludeUsage asks a streaming chat completion for its usage, as LLM gateways do: when r's
// body is a JSON object with "messages" and a "stream" that is true as upstreams read it
// (streamValue; the last of each, as the upstream reads duplicates) and without
// "stream_options": {"include_usage": true}, it sets that, so the stream ends with a chunk
// carrying the usage (`"choices": []`), which a Scanner reads. Anything else (not a POST of
// JSON, a compressed body, a body over MaxIncludeUsageBody, one that does not parse, another
// API) goes on byte for byte as it came. The Content-Type is not looked at, as Model does not
// look at it. It reads the body as readBody does (once per request,
// with Model) before the request goes on: r.Body, r.GetBody and, when the body changed,
// r.ContentLength and any Content-Length field are set to what the upstream is to receive;
// closing r.Body closes the body that came.
func IncludeUsage(r *http.Request) {
	if r.Method != http.MethodPost {
		return
	}
	b := readBody(r)
	if b == nil {
		return
	}
	out, ok := withIncludeUsage(b.data, b.parse())
	if !ok {
		return
	}
	replaceBody(r, b, out)
}

// replaceBody makes out the body r goes on with in place of b: r.Body, r.GetBody,
// r.ContentLength and any Content-Length field; closing r.Body closes the body that came.
func replaceBody(r *http.Request, b *bufferedBody, out []byte) {
	setBody(r, out, b.Closer, nil) // parsed again if a reader asks: its offsets moved
	r.ContentLength = int64(len(out))
	if r.Header.Get("Content-Length") != "" {
		r.Header.Set("Content-Length", strconv.Itoa(len(out)))
	}
}

// withIncludeUsage returns body, a chat completions request whose fields are f, with
// "stream_options": {"include_usage": true}, and true; false when it is not a streaming chat
// completions request (a JSON object with "messages" and a "stream" that streamValue reads as
// true) or already asks for the usage, or when it does not parse. Only what must change
// changes: a "stream_options" member is added at the start of the object, or the last one's
// object gets "include_usage": true (or replaces its null).
func withIncludeUsage(body []byte, f *requestFields) ([]byte, bool) {
	if !f.object || !f.stream || !f.messages {
		return nil, false
	}
	add := []byte(`{"include_usage":true}`)
	if f.opts == nil {
		i := bytes.IndexByte(body, '{') + 1
		return append(append(append(append([]byte{}, body[:i]...), `"stream_options":`...), add...), append([]byte{','}, body[i:]...)...), true
	}
	if string(f.opts) != "null" {
		var m map[string]json.RawMessage
		if json.Unmarshal(f.opts, &m) != nil {
			return nil, false // not an object: the upstream's to refuse
		}
		if string(m["include_usage"]) == "true" {
			return nil, false
		}
		m["include_usage"] = json.RawMessage("true")
		add, _ = json.Marshal(m)
	}
	start := f.optsEnd - int64(len(f.opts))
	return append(append(append([]byte{}, body[:start]...), add...), body[f.optsEnd:]...), true
}

// streamValue reports whether v, a request's "stream", asks for a stream as the servers that
// validate requests with pydantic in its default (lax) mode read a bool (vLLM, SGLang, LiteLLM,
// FastChat): true, a number equal to 1 (1, 1.0), or a string that is "1" or, in any case,
// "t", "y", "on", "yes" or "true" (pydantic-core's str_as_bool). A client must not make its
// stream go unrecognised here while its upstream streams it.
func streamValue(v json.RawMessage) bool {
	switch {
	case string(v) == "true":
		return true
	case len(v) > 0 && v[0] == '"':
		var s string
		if json.Unmarshal(v, &s) != nil {
			return false
		}
		switch strings.ToLower(s) {
		case "1", "t", "y", "on", "yes", "true":
			return true
		}
		return false
	}
	f, err := strconv.ParseFloat(string(v), 64)
	return err == nil && f == 1
}
