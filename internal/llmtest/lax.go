package llmtest

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"unicode/utf16"
)

// Lax is an LLM upstream that reads each request as the laxest servers do, and generates exactly
// the output that reading asks for: it is what a client that sends a body the module reads one
// way and an upstream another gets served. It takes a gzip-compressed body (Content-Encoding),
// a UTF-8 byte order mark and UTF-16 (as Python's json.loads of bytes does), numbers and counts
// as pydantic's lax mode does ("3", 3.0 and true are 3, 3 and 1), a member under any case
// ("Max_Tokens", as Go's encoding/json does), and of every reading of the cap the largest:
// llama.cpp's n_predict over max_tokens, OpenAI's max_completion_tokens over max_tokens, the
// Responses, Anthropic and Gemini caps (both spellings of generationConfig); times the largest
// count (n, best_of, candidateCount); NoCap for a reading without a cap. A body it cannot read
// (not JSON, a cap or count that no reading makes a whole number, a count below 1) is a 400,
// and serves nothing. It answers JSON in the API's format, reporting as prompt tokens a quarter
// of the body's bytes as read, and counts what it served (prompt and output) per X-API-Key.
type Lax struct {
	*httptest.Server
	// NoCap is the output a reading without a cap generates; set before the first request.
	NoCap int64

	mu     sync.Mutex
	served map[string]int64
	last   map[string][]byte // the last body read, per X-API-Key
}

// Last returns the last body (as read: decompressed, in UTF-8) that a request with the
// X-API-Key key sent, nil when none did.
func (l *Lax) Last(key string) []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.last[key]
}

// StartLax starts a Lax upstream, closed when the test ends.
func StartLax(t testing.TB) *Lax {
	l := &Lax{NoCap: 100_000, served: map[string]int64{}, last: map[string][]byte{}}
	l.Server = httptest.NewServer(http.HandlerFunc(l.serve))
	t.Cleanup(l.Close)
	return l
}

// Served returns the tokens (prompt and output) served so far to requests with the X-API-Key
// key.
func (l *Lax) Served(key string) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.served[key]
}

func (l *Lax) serve(w http.ResponseWriter, r *http.Request) {
	var body io.Reader = r.Body
	if strings.EqualFold(r.Header.Get("Content-Encoding"), "gzip") {
		gz, err := gzip.NewReader(r.Body)
		if err != nil {
			http.Error(w, `{"error":{"message":"bad gzip"}}`, http.StatusBadRequest)
			return
		}
		body = gz
	}
	raw, _ := io.ReadAll(body)
	data := laxText(raw)
	l.mu.Lock()
	l.last[r.Header.Get("X-API-Key")] = data
	l.mu.Unlock()
	api, _ := apiOf(r.URL.Path)
	if strings.HasSuffix(r.URL.Path, "/completions") && api == "" {
		api = "completions"
	}
	var doc map[string]any
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if api == "" || dec.Decode(&doc) != nil || dec.More() {
		http.Error(w, `{"error":{"message":"bad request"}}`, http.StatusBadRequest)
		return
	}
	out, ok := l.output(api, doc)
	if !ok {
		http.Error(w, `{"error":{"message":"bad cap or count"}}`, http.StatusBadRequest)
		return
	}
	prompt := int64(len(data) / 4)
	l.mu.Lock()
	l.served[r.Header.Get("X-API-Key")] += prompt + out
	l.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if api == "completions" {
		api = "chat"
	}
	_, _ = io.WriteString(w, cappedJSON(api, "y", prompt, out))
}

// output is the most tokens a lax reader of doc, a request of api, generates: its largest cap
// reading times its largest count; false when a cap or count is one no reader makes a whole
// number, or a count is below 1.
func (l *Lax) output(api string, doc map[string]any) (int64, bool) {
	ok := true
	// first is the lax value of the first of names doc has (under any case), or -1.
	first := func(obj map[string]any, names ...string) int64 {
		for _, n := range names {
			if v, found := laxMember(obj, n); found {
				if v < 0 {
					ok = false
				}
				return v
			}
		}
		return -1
	}
	orNoCap := func(v int64) int64 {
		if v <= 0 {
			return l.NoCap
		}
		return v
	}
	count := int64(1)
	counts := func(obj map[string]any, names ...string) {
		for _, n := range names {
			if v, found := laxMember(obj, n); found {
				if v < 1 {
					ok = false
				}
				count = max(count, v)
			}
		}
	}
	var cap int64
	switch api {
	case "chat", "completions":
		cap = max(orNoCap(first(doc, "n_predict", "max_tokens")), orNoCap(first(doc, "max_completion_tokens", "max_tokens")))
		if api == "completions" {
			cap = orNoCap(first(doc, "n_predict", "max_tokens"))
		}
		counts(doc, "n", "best_of")
	case "responses":
		cap = orNoCap(first(doc, "max_output_tokens"))
	case "anthropic":
		cap = orNoCap(first(doc, "max_tokens"))
	case "gemini":
		cap = -1
		for k, v := range doc {
			gc, isObj := v.(map[string]any)
			if !isObj || !strings.EqualFold(k, "generationConfig") && !strings.EqualFold(k, "generation_config") {
				continue
			}
			cap = max(cap, orNoCap(max(first(gc, "maxOutputTokens"), first(gc, "max_output_tokens"))))
			counts(gc, "candidateCount", "candidate_count")
		}
		cap = orNoCap(cap)
	}
	return cap * count, ok
}

// boolInt is 1 for true, 0 for false.
func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// laxMember returns the largest lax value (laxInt) of the members of obj named name under
// case folding, and whether there is one that is not null; -1 when one is no whole number.
func laxMember(obj map[string]any, name string) (int64, bool) {
	best, found := int64(0), false
	for k, v := range obj {
		if !strings.EqualFold(k, name) || v == nil {
			continue
		}
		n, ok := laxInt(v)
		if !ok {
			return -1, true
		}
		best, found = max(best, n), true
	}
	return best, found
}

// laxInt reads v, a decoded JSON value, as pydantic's lax mode reads an int: a whole number,
// a string of one (spaces around it, a zero fraction), a bool (1 or 0).
func laxInt(v any) (int64, bool) {
	switch x := v.(type) {
	case bool:
		return boolInt(x), true
	case json.Number:
		return wholeNumber(string(x))
	case string:
		return wholeNumber(strings.TrimSpace(x))
	}
	return 0, false
}

// wholeNumber reads s as a whole number, written as an integer or as a float whose fraction is
// zero; at most 2^53.
func wholeNumber(s string) (int64, bool) {
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		return min(n, 1<<53), true
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f != math.Trunc(f) || math.IsInf(f, 0) {
		return 0, false
	}
	return int64(min(f, 1<<53)), true
}

// laxText returns b as UTF-8, read as Python's json.loads reads bytes: a UTF-8 byte order mark
// dropped; UTF-16 (a byte order mark, or a zero byte among the first two) decoded.
func laxText(b []byte) []byte {
	if bytes.HasPrefix(b, []byte("\xef\xbb\xbf")) {
		return b[3:]
	}
	be, le := bytes.HasPrefix(b, []byte("\xfe\xff")), bytes.HasPrefix(b, []byte("\xff\xfe"))
	if be || le {
		b = b[2:]
	} else if len(b) >= 2 && (b[0] == 0) != (b[1] == 0) {
		be, le = b[0] == 0, b[1] == 0
	}
	if !be && !le || len(b)%2 != 0 {
		return b
	}
	u := make([]uint16, len(b)/2)
	for i := range u {
		if be {
			u[i] = uint16(b[2*i])<<8 | uint16(b[2*i+1])
		} else {
			u[i] = uint16(b[2*i+1])<<8 | uint16(b[2*i])
		}
	}
	return []byte(string(utf16.Decode(u)))
}
