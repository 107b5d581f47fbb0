package usage

import (
	"bytes"
	"encoding/json"
	"io"
	"mime"
	"net/http"
)

// MaxRequestBody bounds the request body the readers of a request (IncludeUsage, Model) read,
// in bytes: 1 MiB, a text chat of over 200,000 tokens. A larger body goes on unchanged, unread.
const MaxRequestBody = 1 << 20

// MaxModelBytes bounds the model Model reads, in bytes: a longer "model" reads as none.
const MaxModelBytes = 256

// bufferedBody is a request body that readBody has read into memory: data, replayed to whoever
// reads the request next; closing it closes the body that came.
type bufferedBody struct {
	*bytes.Reader
	io.Closer
	data   []byte
	parsed *requestFields // once parsed: parse
}

// unreadBody is a request body that readBody did not read whole (over MaxRequestBody, or its
// reading failed): what it read, then the rest (or the read's error again).
type unreadBody struct {
	io.Reader
	io.Closer
}

// readBody returns r's body, read into memory, when it is one the request readers read: JSON
// (Content-Type application/json, or any +json type), not compressed (no Content-Encoding), of
// at most MaxRequestBody bytes; nil otherwise. The body goes on byte for byte as it came: r.Body
// (and r.GetBody, when it was read whole) replay it. A request's body is read at most once: a
// second call gives the same bytes, or nil, without reading. Reading waits for the client to
// send the body (within the server's read timeouts).
func readBody(r *http.Request) *bufferedBody {
	switch b := r.Body.(type) {
	case *bufferedBody:
		if b.Len() != len(b.data) {
			return nil // read from since: not ours to read again
		}
		return b
	case *unreadBody:
		return nil
	}
	if r.Body == nil || r.Body == http.NoBody || r.Header.Get("Content-Encoding") != "" || r.ContentLength > MaxRequestBody {
		return nil
	}
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "application/json" && !(len(mt) > 5 && mt[len(mt)-5:] == "+json") {
		return nil
	}
	body := r.Body
	read, err := io.ReadAll(io.LimitReader(body, MaxRequestBody+1))
	if err != nil || len(read) > MaxRequestBody {
		r.Body = &unreadBody{io.MultiReader(bytes.NewReader(read), body), body}
		return nil
	}
	return setBody(r, read, body, nil)
}

// setBody makes data, with its parsed fields when known, the body r goes on with; closing it
// closes c.
func setBody(r *http.Request, data []byte, c io.Closer, parsed *requestFields) *bufferedBody {
	b := &bufferedBody{Reader: bytes.NewReader(data), Closer: c, data: data, parsed: parsed}
	r.Body = b
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }
	return b
}

// requestFields are the top-level members of a JSON request body that the readers use; of a
// name given twice, the last, as the upstream reads duplicates.
type requestFields struct {
	object   bool            // the body is one JSON object, and nothing after it
	model    string          // "model" when it is a string of at most MaxModelBytes, else ""
	stream   bool            // "stream" read as an upstream reads it: streamValue
	messages bool            // "messages" is present
	opts     json.RawMessage // "stream_options"
	optsEnd  int64           // the offset of the end of opts in the body
}

// parse returns the fields of b's body, parsing it on the first call.
func (b *bufferedBody) parse() *requestFields {
	if b.parsed == nil {
		f := parseRequest(b.data)
		b.parsed = &f
	}
	return b.parsed
}

// parseRequest reads the top-level members of body that requestFields holds; object is false,
// and the others are zero, when body is not one JSON object.
func parseRequest(body []byte) requestFields {
	var f requestFields
	dec := json.NewDecoder(bytes.NewReader(body))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return requestFields{}
	}
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return requestFields{}
		}
		key, _ := t.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return requestFields{}
		}
		switch key {
		case "model":
			f.model = ""
			if s := ""; json.Unmarshal(v, &s) == nil && len(s) <= MaxModelBytes {
				f.model = s
			}
		case "stream":
			f.stream = streamValue(v)
		case "messages":
			f.messages = true
		case "stream_options":
			f.opts, f.optsEnd = v, dec.InputOffset()
		}
	}
	if t, err := dec.Token(); err != nil || t != json.Delim('}') {
		return requestFields{}
	}
	if _, err := dec.Token(); err != io.EOF {
		return requestFields{} // more after the object
	}
	f.object = true
	return f
}

// Model returns the "model" of r's body, as an OpenAI-compatible or Anthropic upstream reads it
// (the last one given): "" when the body is not one readBody reads (not JSON, compressed, over
// MaxRequestBody), is not one JSON object, has no "model", or one that is not a string or is
// longer than MaxModelBytes. It reads the body as readBody does: once per request, passing it
// on unchanged.
func Model(r *http.Request) string {
	b := readBody(r)
	if b == nil {
		return ""
	}
	return b.parse().model
}
