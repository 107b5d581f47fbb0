package usage

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// MaxRequestBody bounds the request body the readers of a request (IncludeUsage, Model) read,
// in bytes: 1 MiB, a text chat of over 200,000 tokens. A larger body goes on unchanged, unread.
const MaxRequestBody = 1 << 20

// MaxModelBytes bounds the model Model reads, in bytes: a longer "model" reads as
// UnreadableModel.
const MaxModelBytes = 256

// UnreadableModel is Model's answer for a body whose model cannot be known as every upstream
// reads it. A model name cannot be it: it begins with "?", which no model name does. A map of
// the model sends it to its default.
const UnreadableModel = "?unreadable"

// bufferedBody is a request body that readBody has read into memory: data, replayed to whoever
// reads the request next; closing it closes the body that came.
type bufferedBody struct {
	*bytes.Reader
	io.Closer
	data   []byte
	parsed *requestFields // once parsed: parse
	// bound is ReadBound's answer for boundAPI (0: none yet), kept so that a request's body is
	// scanned once however many zones ask.
	bound    Bound
	boundAPI API
}

// unreadBody is a request body that readBody did not read whole (over MaxRequestBody, or its
// reading failed): what it read, then the rest (or the read's error again).
type unreadBody struct {
	io.Reader
	io.Closer
	over bool // over MaxRequestBody; else its reading failed
}

// Refusal is why a request body is refused: an HTTP status and a reason, in lower case, that
// names what is wrong. The zero Refusal refuses nothing.
type Refusal struct {
	Status int
	Reason string
}

// Error returns the reason.
func (e Refusal) Error() string { return e.Reason }

// unreadable returns why r's body is not one readBody reads: 415 for a Content-Encoding, 413
// over MaxRequestBody, 400 for a body that is absent or whose reading failed.
func unreadable(r *http.Request) Refusal {
	switch b := r.Body.(type) {
	case *unreadBody:
		if !b.over {
			return Refusal{http.StatusBadRequest, "the request body could not be read"}
		}
	case *bufferedBody:
		return Refusal{http.StatusBadRequest, "the request body was read before the rate limit"}
	case nil:
		return Refusal{http.StatusBadRequest, "the request has no body"}
	}
	switch {
	case r.Body == http.NoBody:
		return Refusal{http.StatusBadRequest, "the request has no body"}
	case encoded(r.Header):
		return Refusal{http.StatusUnsupportedMediaType, "a request body with a Content-Encoding (" + r.Header.Get("Content-Encoding") + ") is not read: send it uncompressed"}
	}
	return Refusal{http.StatusRequestEntityTooLarge, "the request body is over " + strconv.Itoa(MaxRequestBody) + " bytes"}
}

// notJSON is why a body readBody read is refused when it is not one JSON object.
var notJSON = Refusal{http.StatusBadRequest, "the request body is not one JSON object in UTF-8 (no byte order mark, nothing after it)"}

// encoded reports whether h has a Content-Encoding other than identity.
func encoded(h http.Header) bool {
	ce := h.Get("Content-Encoding")
	return ce != "" && !strings.EqualFold(ce, "identity")
}

// readBody returns r's body, read into memory, when it is one the request readers read: not
// compressed (no Content-Encoding), of at most MaxRequestBody bytes, whatever its Content-Type
// (FastAPI and Go servers read a JSON body sent with none, or with text/plain); nil otherwise. The body goes on byte for byte as it came: r.Body
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
	if r.Body == nil || r.Body == http.NoBody || encoded(r.Header) {
		return nil
	}
	body := r.Body
	if r.ContentLength > MaxRequestBody {
		r.Body = &unreadBody{body, body, true}
		return nil
	}
	read, err := io.ReadAll(io.LimitReader(body, MaxRequestBody+1))
	if err != nil || len(read) > MaxRequestBody {
		r.Body = &unreadBody{io.MultiReader(bytes.NewReader(read), body), body, err == nil}
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
	badModel bool            // the last "model" is not a string
	long     bool            // the last "model" is a string longer than MaxModelBytes
	folded   string          // a name equal to "model" under case folding ("Model"), when given
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
			f.model, f.badModel, f.long = "", false, false
			s := ""
			switch {
			case v[0] != '"' || json.Unmarshal(v, &s) != nil:
				f.badModel = true
			case len(s) > MaxModelBytes:
				f.long = true
			default:
				f.model = s
			}
		case "stream":
			f.stream = streamValue(v)
		case "messages":
			f.messages = true
		case "stream_options":
			f.opts, f.optsEnd = v, dec.InputOffset()
		default:
			if strings.EqualFold(key, "model") {
				f.folded = key // Go's encoding/json reads "Model" as "model"; pydantic does not
			}
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

// pathModel returns the model that path names as Gemini's API does,
// ".../models/<model>:<method>" (generateContent, streamGenerateContent, countTokens…; Vertex
// AI's ".../publishers/google/models/<model>:<method>" too), and true; false for any other path.
// path is decoded once (r.URL.Path), as the upstream reads it: a "%2F" in the model is a '/',
// and so no such path. A model that is empty or longer than MaxModelBytes is UnreadableModel.
func pathModel(path string) (string, bool) {
	i := strings.LastIndexByte(path, '/')
	if i < 0 || !strings.HasSuffix(path[:i], "/models") && path[:i] != "models" {
		return "", false
	}
	model, method, ok := strings.Cut(path[i+1:], ":")
	if !ok || method == "" || strings.IndexByte(method, ':') >= 0 {
		return "", false
	}
	if model == "" || len(model) > MaxModelBytes {
		return UnreadableModel, true
	}
	return model, true
}

// Model returns the model of r: the one its URL path names as Gemini's API does (pathModel), else
// the "model" of its body, as an OpenAI-compatible or Anthropic upstream reads it
// (the last one given), whatever the body's Content-Type: "" when r's body is empty or its JSON
// object has no "model". It is UnreadableModel when the body cannot be read as upstreams read
// it: a body that readBody does not read (compressed, over MaxRequestBody, its reading failed),
// that is not one JSON object with nothing after it, or whose "model" is longer than
// MaxModelBytes. A body whose model upstreams read apart is refused (a 400 Refusal naming the
// member): its last "model" is not a string, or it has a member whose name is "model" under
// case folding ("Model", which Go servers read as the model and Python servers do not). It
// reads the body as readBody does: once per request, passing it on unchanged.
func Model(r *http.Request) (string, error) {
	if m, ok := pathModel(r.URL.Path); ok {
		return m, nil
	}
	if r.Body == nil || r.Body == http.NoBody {
		return "", nil
	}
	b := readBody(r)
	if b == nil {
		return UnreadableModel, nil
	}
	if len(b.data) == 0 {
		return "", nil
	}
	f := b.parse()
	switch {
	case !f.object || f.long:
		return UnreadableModel, nil
	case f.folded != "":
		return UnreadableModel, Refusal{http.StatusBadRequest, "the request body's model is ambiguous: " + strconv.Quote(f.folded) + " is read as \"model\" by some upstreams and not by others"}
	case f.badModel:
		return UnreadableModel, Refusal{http.StatusBadRequest, "the request body's \"model\" is not a string"}
	}
	return f.model, nil
}
