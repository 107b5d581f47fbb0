package usage

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
)

// jsonRequest returns a request of method with body as JSON (Content-Type ct), its
// ContentLength known.
func jsonRequest(method, ct, body string) *http.Request {
	r := httptest.NewRequest(method, "/v1/chat/completions", strings.NewReader(body))
	r.Header.Set("Content-Type", ct)
	return r
}

// TestModel: the "model" of a JSON body, the last one given, as the upstream reads it, whatever
// the Content-Type; none for a body without one; UnreadableModel for a body that is not one
// JSON object, a compressed body, one over 1 MiB, a model that is not a string or is longer
// than 256 bytes, and a name equal to "model" under case folding; and the last two, whose model
// upstreams read apart, are refused with a 400 naming the member.
func TestModel(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("m", MaxModelBytes)
	for _, tc := range []struct {
		name, ct, body, want string
		refused              bool // Model's error is a 400 Refusal naming the member; else nil
	}{
		{"chat", "application/json", `{"model":"gpt-4o","messages":[]}`, "gpt-4o", false},
		{"charset", "application/json; charset=utf-8", `{"messages":[],"model":"claude-sonnet-4-5"}`, "claude-sonnet-4-5", false},
		{"a +json type", "application/vnd.api+json", `{"model":"m"}`, "m", false},
		{"escaped", "application/json", `{"mod\u0065l":"gpt-\u0034o"}`, "gpt-4o", false},
		{"the last of two", "application/json", `{"model":"a","model":"b"}`, "b", false},
		{"a string, then not", "application/json", `{"model":"a","model":1}`, UnreadableModel, true},
		{"not a string, then one", "application/json", `{"model":1,"model":"a"}`, "a", false},
		{"null", "application/json", `{"model":null}`, UnreadableModel, true},
		{"no model", "application/json", `{"messages":[]}`, "", false},
		{"nested only", "application/json", `{"messages":[{"model":"a"}],"meta":{"model":"b"}}`, "", false},
		{"Model beside model", "application/json", `{"model":"small","Model":"big"}`, UnreadableModel, true},
		{"MODEL before model", "application/json", `{"MODEL":"big","model":"small"}`, UnreadableModel, true},
		{"Model alone", "application/json", `{"Model":"big"}`, UnreadableModel, true},
		{"modelx is another name", "application/json", `{"model":"a","modelx":"b","Models":"c"}`, "a", false},
		{"256 bytes", "application/json", `{"model":"` + long + `"}`, long, false},
		{"257 bytes", "application/json", `{"model":"` + long + `m"}`, UnreadableModel, false},
		{"not JSON", "application/json", `{"model":"a"`, UnreadableModel, false},
		{"more after the object", "application/json", `{"model":"a"} {}`, UnreadableModel, false},
		{"bytes after the object", "application/json", `{"model":"a"} x`, UnreadableModel, false},
		{"an array", "application/json", `[{"model":"a"}]`, UnreadableModel, false},
		{"text", "text/plain", `{"model":"a"}`, "a", false},
		{"no content type", "", `{"model":"a"}`, "a", false},
		{"a form type", "application/x-www-form-urlencoded", `{"model":"a"}`, "a", false},
		{"a form", "application/x-www-form-urlencoded", `model=a`, UnreadableModel, false},
		{"compressed", "application/json", `{"model":"a"}`, UnreadableModel, false},
		{"over 1 MiB", "application/json", `{"model":"a","pad":"` + strings.Repeat(" ", MaxRequestBody) + `"}`, UnreadableModel, false},
		{"no body", "", "", "", false},
	} {
		r := jsonRequest(http.MethodPost, tc.ct, tc.body)
		if tc.name == "compressed" {
			r.Header.Set("Content-Encoding", "gzip")
		}
		got, err := Model(r)
		if got != tc.want {
			t.Errorf("%s: model %q, want %q", tc.name, got, tc.want)
		}
		var rf Refusal
		if refused := errors.As(err, &rf) && rf.Status == http.StatusBadRequest && strings.Contains(rf.Reason, "odel"); refused != tc.refused || !refused && err != nil {
			t.Errorf("%s: error %v, want refused %v", tc.name, err, tc.refused)
		}
		if sent, _ := io.ReadAll(r.Body); string(sent) != tc.body {
			t.Errorf("%s: the body goes on as %d bytes, not as it came (%d)", tc.name, len(sent), len(tc.body))
		}
	}
}

// countingBody counts the reads of a body.
type countingBody struct {
	io.Reader
	reads  int
	closed bool
}

func (b *countingBody) Read(p []byte) (int, error) {
	b.reads++
	return b.Reader.Read(p)
}

func (b *countingBody) Close() error {
	b.closed = true
	return nil
}

// TestBodyReadOnce: a request's body is read once, whatever asks (Model, IncludeUsage, in any
// order, twice): the second reader takes the bytes the first read; the upstream then gets the
// body once, whole (GetBody too), and closing it closes the body that came. A body over the
// bound is read once too, and goes on whole.
func TestBodyReadOnce(t *testing.T) {
	t.Parallel()
	const body = `{"model":"m","messages":[],"stream":true}`
	const asked = `{"stream_options":{"include_usage":true},"model":"m","messages":[],"stream":true}`
	for _, tc := range []struct {
		name  string
		calls []string
		want  string
	}{
		{"model", []string{"model", "model"}, body},
		{"model, then include_usage", []string{"model", "include", "model"}, asked},
		{"include_usage, then model", []string{"include", "model", "include"}, asked},
	} {
		cb := &countingBody{Reader: strings.NewReader(body)}
		r := jsonRequest(http.MethodPost, "application/json", "")
		r.Body, r.ContentLength = cb, int64(len(body))
		for _, c := range tc.calls {
			if c == "model" {
				if m, _ := Model(r); m != "m" {
					t.Fatalf("%s: model %q", tc.name, m)
				}
				continue
			}
			IncludeUsage(r)
		}
		reads := cb.reads
		sent, _ := io.ReadAll(r.Body)
		again, _ := r.GetBody()
		resent, _ := io.ReadAll(again)
		switch {
		case reads > 2: // io.ReadAll: a read of the body, one more for its EOF
			t.Errorf("%s: the body was read %d times", tc.name, reads)
		case string(sent) != tc.want || string(resent) != tc.want:
			t.Errorf("%s: the upstream gets %s (again: %s), want %s", tc.name, sent, resent, tc.want)
		case r.ContentLength != int64(len(tc.want)):
			t.Errorf("%s: ContentLength %d, want %d", tc.name, r.ContentLength, len(tc.want))
		}
		_ = r.Body.Close()
		if !cb.closed {
			t.Errorf("%s: closing the body did not close the body that came", tc.name)
		}
	}

	big := `{"model":"m","pad":"` + strings.Repeat(" ", MaxRequestBody) + `"}`
	cb := &countingBody{Reader: strings.NewReader(big)}
	r := jsonRequest(http.MethodPost, "application/json", "")
	r.Body, r.ContentLength = cb, -1 // chunked: the size is known once read
	if m, _ := Model(r); m != UnreadableModel {
		t.Fatal("a body over the bound has a model")
	}
	reads := cb.reads
	_, _ = Model(r)
	IncludeUsage(r)
	if cb.reads != reads {
		t.Fatalf("a body over the bound was read again: %d reads, then %d", reads, cb.reads)
	}
	if sent, _ := io.ReadAll(r.Body); string(sent) != big {
		t.Fatalf("a body over the bound goes on as %d bytes, not %d", len(sent), len(big))
	}
}

// failingBody fails its read after giving some bytes.
type failingBody struct{ given bool }

func (b *failingBody) Read(p []byte) (int, error) {
	if !b.given {
		b.given = true
		return copy(p, `{"model":`), nil
	}
	return 0, errors.New("connection reset")
}

func (*failingBody) Close() error { return nil }

// TestBodyReadFails: a body whose reading fails has the unreadable model, and the upstream's read gets
// what was read, then the same error.
func TestBodyReadFails(t *testing.T) {
	t.Parallel()
	r := jsonRequest(http.MethodPost, "application/json", "")
	r.Body, r.ContentLength = &failingBody{}, -1
	if m, _ := Model(r); m != UnreadableModel {
		t.Fatalf("model %q", m)
	}
	sent, err := io.ReadAll(r.Body)
	if string(sent) != `{"model":` || err == nil {
		t.Fatalf("the upstream reads %q, %v", sent, err)
	}
}

// TestIncludeUsage: a streaming chat completion asks for its usage, with only what must change
// changed; anything else goes on as it came.
func TestIncludeUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, method, body, want string
	}{
		{"added at the start", "POST", `{"model":"m","messages":[],"stream":true}`, `{"stream_options":{"include_usage":true},"model":"m","messages":[],"stream":true}`},
		{"null replaced", "POST", `{"messages":[],"stream":true,"stream_options":null}`, `{"messages":[],"stream":true,"stream_options":{"include_usage":true}}`},
		{"set in the object", "POST", `{"messages":[],"stream":"yes","stream_options":{"include_usage":false}}`, `{"messages":[],"stream":"yes","stream_options":{"include_usage":true}}`},
		{"the last of two", "POST", `{"messages":[],"stream":1,"stream_options":{"include_usage":true},"stream_options":{}}`, `{"messages":[],"stream":1,"stream_options":{"include_usage":true},"stream_options":{"include_usage":true}}`},
		{"asked already", "POST", `{"messages":[],"stream":true,"stream_options":{"include_usage":true}}`, ""},
		{"not a stream", "POST", `{"messages":[],"stream":false}`, ""},
		{"the last stream is false", "POST", `{"messages":[],"stream":true,"stream":false}`, ""},
		{"no messages (an Anthropic-like prompt)", "POST", `{"prompt":"x","stream":true}`, ""},
		{"options not an object", "POST", `{"messages":[],"stream":true,"stream_options":[]}`, ""},
		{"not a POST", "PUT", `{"messages":[],"stream":true}`, ""},
		{"not JSON", "POST", `{"messages":[],"stream":true`, ""},
	} {
		r := jsonRequest(tc.method, "application/json", tc.body)
		r.Header.Set("Content-Length", strconv.Itoa(len(tc.body)))
		IncludeUsage(r)
		want := tc.want
		if want == "" {
			want = tc.body
		}
		sent, _ := io.ReadAll(r.Body)
		if string(sent) != want || r.ContentLength != int64(len(want)) || r.Header.Get("Content-Length") != strconv.Itoa(len(want)) {
			t.Errorf("%s: sent %s (length %d, field %s), want %s", tc.name, sent, r.ContentLength, r.Header.Get("Content-Length"), want)
		}
		if tc.want != "" && !json.Valid(sent) {
			t.Errorf("%s: not JSON: %s", tc.name, sent)
		}
	}
}

// FuzzModel: for any body, Model reads what encoding/json finds as the last top-level "model"
// of a body that is one JSON object, when that is a string of at most MaxModelBytes and no other
// top-level name equals "model" under case folding; "" when it has no "model";
// UnreadableModel for any other body. The body goes on byte for byte.
func FuzzModel(f *testing.F) {
	for _, b := range []string{`{"model":"gpt-4o","messages":[]}`, `{"model":"a","model":"b"}`, `{"mod\u0065l":"x"}`, `{"model":1}`,
		`[{"model":"a"}]`, `{"model":"a"} x`, `{"model":"\ud800"}`, `{"model":"a","Model":"b"}`, `{"MODEL":"b"}`, `{"mOdEl":"b","model":"a"}`,
		`{"model":null}`, `{}`, `model=a`, ``} {
		f.Add([]byte(b))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		r := jsonRequest(http.MethodPost, "text/plain", string(body))
		got, _ := Model(r)
		if sent, _ := io.ReadAll(r.Body); !bytes.Equal(sent, body) {
			t.Fatalf("the body went on changed: %q", sent)
		}
		want := UnreadableModel
		var m map[string]json.RawMessage
		if len(body) == 0 {
			want = ""
		} else if json.Unmarshal(body, &m) == nil && m != nil {
			var s string
			raw, ok := m["model"]
			folded := false
			for name := range m {
				folded = folded || name != "model" && strings.EqualFold(name, "model")
			}
			switch {
			case folded:
			case !ok:
				want = ""
			case raw[0] == '"' && json.Unmarshal(raw, &s) == nil && len(s) <= MaxModelBytes:
				want = s
			}
		}
		if got != want {
			t.Fatalf("model %q, encoding/json: %q", got, want)
		}
	})
}

// TestPathModel: a Gemini path names the model, whatever the body says; an escaped path is
// read decoded once, as the upstream reads it, so "a%2Fb" is no model path; an empty or too
// long model is UnreadableModel; other paths read the body.
func TestPathModel(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("m", MaxModelBytes+1)
	for _, tc := range []struct{ path, body, want string }{
		{"/v1beta/models/gemini-2.5-flash:generateContent", `{"contents":[]}`, "gemini-2.5-flash"},
		{"/v1beta/models/small:streamGenerateContent?alt=sse", `{"model":"big"}`, "small"},
		{"/v1/projects/p/locations/us/publishers/google/models/gemini-2.5-pro:generateContent", ``, "gemini-2.5-pro"},
		{"/gw/v1beta/models/small:countTokens", `{"model":"big"}`, "small"},
		{"/v1beta/models/a%2Fb:generateContent", `{"model":"big"}`, "big"},
		{"/v1beta/models/sm%61ll:generateContent", `{}`, "small"},
		{"/v1beta/models/:generateContent", `{"model":"big"}`, UnreadableModel},
		{"/v1beta/models/" + long + ":generateContent", `{}`, UnreadableModel},
		{"/v1beta/models/small", `{"model":"big"}`, "big"},
		{"/v1beta/models/small:", `{"model":"big"}`, "big"},
		{"/v1/chat/completions", `{"model":"big"}`, "big"},
		{"/v1beta/tunedModels/x:generateContent", `{"model":"big"}`, "big"},
	} {
		r := httptest.NewRequest(http.MethodPost, tc.path, strings.NewReader(tc.body))
		if got, _ := Model(r); got != tc.want {
			t.Errorf("%s: model %q, want %q", tc.path, got, tc.want)
		}
	}
}
