// Package usage reads what an LLM API reports it used, as a response body streams by, and what a
// request asks of it: Scanner reads the token usage of an OpenAI-compatible or Anthropic API
// from JSON or an event stream, Weights turn it into one amount, Decoder decodes a compressed
// body on its way to a Scanner within bounds of memory and CPU, CeilScaled reads a decimal cost
// from a header, IncludeUsage asks a streaming chat completion for its usage and Model reads the
// model a request names. It imports nothing from Caddy.
package usage

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
)

// maxUsageBytes bounds the bytes of one "usage" object the scanner keeps: OpenAI's is about 300.
const maxUsageBytes = 4096

// maxKeyBytes bounds the bytes of a key the scanner keeps to compare with "usage",
// "usageMetadata", "response" and "message" (longer keys are none of them): "usageMetadata"
// with every letter escaped (\u0075...) is 78 bytes.
const maxKeyBytes = 80

// Format is the wire format of the usage a Scanner reads.
type Format uint8

// The formats of usage.
const (
	// OpenAI is the usage of OpenAI's chat completions, completions, embeddings and Responses
	// APIs, and of the servers compatible with them: prompt_tokens (or input_tokens, which
	// include the cached ones: prompt_tokens_details.cached_tokens or
	// input_tokens_details.cached_tokens), completion_tokens (or output_tokens), total_tokens.
	OpenAI Format = iota + 1
	// Anthropic is the usage of Anthropic's Messages API: input_tokens (those neither read from
	// nor written to the prompt cache), cache_read_input_tokens, cache_creation_input_tokens and
	// output_tokens; no total.
	Anthropic
	// Gemini is the usageMetadata of Google's Gemini API (generateContent and
	// streamGenerateContent): promptTokenCount (cached ones included: cachedContentTokenCount)
	// and toolUsePromptTokenCount are input, candidatesTokenCount and thoughtsTokenCount
	// output, totalTokenCount their total. A count it leaves out is 0, as proto3 JSON leaves
	// out zeros.
	Gemini

	// Formats is the length of an array indexed by a Format (its element 0 unused).
	Formats = iota + 1
)

// The counts Tokens reports.
const (
	Total      = "total"      // total_tokens, else the prompt and completion counts added
	Prompt     = "prompt"     // prompt_tokens (chat completions) or input_tokens (Responses API)
	Completion = "completion" // completion_tokens or output_tokens
)

// Scanner reads the usage of a response body in one Format as it streams by, holding at most
// maxUsageBytes + maxKeyBytes (4 KiB and 80 bytes) whatever the body's size. It reads JSON with its
// strings and nesting tracked, and takes a "usage" object only where the API puts it: at the top
// level of the document, or inside one top-level object, "response" for OpenAI (a Responses API
// event) and "message" for Anthropic (a message_start event); Gemini's "usageMetadata" at the
// top level, or in each object of a top-level array (streamGenerateContent without alt=sse). In
// an event stream (sse) each event's data is a document of its own.
//
// OpenAI: the usage of a chat completions stream's final chunk (stream_options.include_usage;
// the others carry "usage": null) or the response.usage of a Responses API response.completed
// event; the last usage object found decides. Gemini: likewise, of every chunk of a stream.
//
// Anthropic: a stream's input counts come in message_start's message.usage and its output count
// (cumulative) in the usage of its message_delta events; each count is the last one found, and a
// stream has a usage only once a top-level usage (a message_delta's) has come, so a stream cut
// short before it has none. A JSON body has its usage at the top level.
//
// A key inside a string, inside a nested object or array, or spelled otherwise is never taken; a
// key written with escapes (`"us\u0061ge"`) is the key it decodes to, as any JSON parser reads it.
// See Tokens and Weighted. A Scanner is not safe for concurrent use.
type Scanner struct {
	format Format
	sse    bool

	// The event stream's line state (sse).
	line    int // lineField, lineData or lineSkip
	field   [5]byte
	nfield  int
	afterCR bool

	// The JSON document's state.
	depth     int
	inStr     bool
	esc       bool
	obj       [3]bool // obj[d]: the container at depth d (1 or 2) is an object
	inInner   bool    // the container at depth 2 is the top-level "response" (or "message") object
	expectKey bool    // the next string at depth 1 or 2 is a key
	inKey     bool    // reading a key at depth 1 or 2
	key       []byte  // its raw bytes, at most maxKeyBytes (keyLong past that)
	keyLong   bool
	pending   int  // what the key just read names: keyOther, keyUsage or keyInner
	colon     bool // after that key's ':', before its value
	capDepth  int  // > 0: capturing the usage object that opened at this depth
	buf       []byte
	capLong   bool

	found bool        // a usage was seen (Anthropic: a top-level one)
	last  usageCounts // the last one's counts (Anthropic: each count's last)
	bad   bool        // it is not a usage we can charge (see parseUsage; Anthropic: any was not)
}

// The event stream's line states.
const (
	lineField = iota // reading the field's name
	lineData         // in a data field's value: the document's bytes
	lineSkip         // in another field, or a comment
)

var newline = []byte{'\n'}

// What a key names.
const (
	keyOther = iota
	keyUsage
	keyInner // "response" (OpenAI) or "message" (Anthropic)
)

// usageCounts are the token counts of a usage object: chat completions name them prompt_tokens
// and completion_tokens, the Responses API and Anthropic input_tokens and output_tokens; OpenAI
// has total_tokens and cached (prompt_tokens_details.cached_tokens, or input_tokens_details'),
// Anthropic cacheRead (cache_read_input_tokens) and cacheWrite (cache_creation_input_tokens).
// -1: absent (or null); cached is badCount when present but not a count (it is read for weights
// only, so it does not make the usage bad).
type usageCounts struct {
	total, prompt, completion, input, output int64
	cached, cacheRead, cacheWrite            int64
}

// badCount is usageCounts.cached when it is present but not a non-negative integer.
const badCount = -2

// noCounts are the counts of a usage object with none.
var noCounts = usageCounts{-1, -1, -1, -1, -1, -1, -1, -1}

// NewScanner returns a scanner of the usage of format in a JSON body (application/json, or any
// +json type), or in an event stream (text/event-stream) when sse. Write the body to it, in
// chunks of any size.
func NewScanner(format Format, sse bool) *Scanner {
	return &Scanner{format: format, sse: sse, last: noCounts}
}

// Write scans p; it never fails.
func (s *Scanner) Write(p []byte) (int, error) {
	if !s.sse {
		s.scanJSON(p)
		return len(p), nil
	}
	for i := 0; i < len(p); {
		c := p[i]
		if s.afterCR {
			s.afterCR = false
			if c == '\n' {
				i++
				continue
			}
		}
		if s.line == lineData {
			j := bytes.IndexAny(p[i:], "\r\n")
			if j < 0 {
				s.scanJSON(p[i:])
				return len(p), nil
			}
			s.scanJSON(p[i : i+j])
			s.scanJSON(newline) // data lines join with a newline: whitespace in JSON
			i += j
			c = p[i]
		}
		i++
		if c == '\r' || c == '\n' {
			s.afterCR = c == '\r'
			if s.line == lineField && s.nfield == 0 {
				s.endDocument() // a blank line ends the event
			}
			if s.line == lineField && s.nfield == 4 && string(s.field[:4]) == "data" {
				s.scanJSON(newline) // "data" with no colon: an empty data line
			}
			s.line, s.nfield = lineField, 0
			continue
		}
		if s.line != lineField {
			continue // lineSkip
		}
		switch {
		case c == ':' && s.nfield == 4 && string(s.field[:4]) == "data":
			s.line = lineData
		case c == ':':
			s.line = lineSkip
		case s.nfield < len(s.field):
			s.field[s.nfield] = c
			s.nfield++
		default:
			s.line, s.nfield = lineSkip, len(s.field) // a longer name: not data
		}
	}
	return len(p), nil
}

// endDocument starts a new document: the next event's data.
func (s *Scanner) endDocument() {
	s.depth, s.inStr, s.esc, s.inInner, s.expectKey, s.inKey, s.colon, s.capDepth = 0, false, false, false, false, false, false, 0
}

// scanJSON scans p, bytes of JSON: strings and nesting are tracked byte by byte; keys are read at
// depth 1 and inside the top-level "response" (or "message") object; a usage object there is
// kept until it closes, then parsed.
func (s *Scanner) scanJSON(p []byte) {
	for i := 0; i < len(p); i++ {
		if s.inStr && !s.inKey && !s.esc && s.capDepth == 0 {
			// Inside a string value (most of a completion's bytes): on to its end or an escape.
			j := bytes.IndexAny(p[i:], `"\`)
			if j < 0 {
				return
			}
			i += j
		}
		c := p[i]
		if s.capDepth > 0 {
			if len(s.buf) < maxUsageBytes {
				s.buf = append(s.buf, c)
			} else {
				s.capLong = true
			}
		}
		if s.inStr {
			switch {
			case s.esc:
				s.esc = false
			case c == '\\':
				s.esc = true
			case c == '"':
				s.inStr = false
				if s.inKey {
					s.inKey = false
					s.pending = s.keyName()
					continue
				}
			}
			if s.inKey {
				if len(s.key) < maxKeyBytes {
					s.key = append(s.key, c)
				} else {
					s.keyLong = true
				}
			}
			continue
		}
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		case '"':
			s.inStr = true
			if s.expectKey {
				s.expectKey, s.inKey, s.keyLong, s.key = false, true, false, s.key[:0]
			}
		case ':':
			s.colon = true // the value of the key just read follows
			continue
		case ',':
			s.expectKey = s.keyed()
			s.pending = keyOther
		case '{', '[':
			s.depth++
			if c == '{' && s.depth == 2 && s.format == Gemini && !s.obj[1] {
				s.inInner = true // a chunk of a top-level array: its keys are read
			}
			if s.colon && c == '{' {
				switch {
				case s.pending == keyUsage && (s.depth == 2 || s.depth == 3 && s.inInner):
					s.capDepth, s.capLong = s.depth, false
					s.buf = append(s.buf[:0], '{')
				case s.pending == keyInner && s.depth == 2:
					s.inInner = true
				}
			}
			if s.depth <= 2 {
				s.obj[s.depth] = c == '{'
			}
			s.expectKey = c == '{' && s.keyed()
		case '}', ']':
			if s.capDepth > 0 && s.depth == s.capDepth {
				s.capDepth = 0
				u, bad := parseUsage(s.format, s.buf, s.capLong)
				s.take(u, bad, s.depth == 2)
			}
			if s.depth == 2 {
				s.inInner = false
			}
			s.depth = max(0, s.depth-1)
			s.expectKey = false
		}
		s.colon, s.pending = false, keyOther
	}
}

// take records the counts u of a usage object (bad: it is not one we can charge), at the top
// level when top: OpenAI's last one decides; Anthropic's counts each keep their last value.
func (s *Scanner) take(u usageCounts, bad, top bool) {
	if s.format != Anthropic {
		s.found, s.last, s.bad = true, u, bad
		return
	}
	for i, n := range u.fields() {
		if n != -1 {
			*s.last.fieldsPtr()[i] = n
		}
	}
	s.found = s.found || top
	s.bad = s.bad || bad
}

// keyed reports whether the container at the current depth is one whose keys are read: the
// top-level object, or the "response" (or "message") object inside it.
func (s *Scanner) keyed() bool {
	return s.depth == 1 && s.obj[1] || s.depth == 2 && s.inInner && s.obj[2]
}

// keyName is what the key just read names, decoded as JSON decodes it.
func (s *Scanner) keyName() int {
	if s.keyLong {
		return keyOther
	}
	k := s.key
	if bytes.IndexByte(k, '\\') >= 0 {
		var dec string
		if json.Unmarshal(append(append([]byte{'"'}, k...), '"'), &dec) != nil {
			return keyOther
		}
		k = []byte(dec)
	}
	switch string(k) {
	case "usage":
		if s.format != Gemini {
			return keyUsage
		}
	case "usageMetadata":
		if s.format == Gemini {
			return keyUsage
		}
	case "response":
		if s.format != Anthropic {
			return keyInner
		}
	case "message":
		if s.format == Anthropic {
			return keyInner
		}
	}
	return keyOther
}

// parseUsage parses a usage object of format; bad when it is not one we can charge: too long,
// not a JSON object, or a count that is present but not a non-negative integer (a negative, a
// fraction, an exponent, a string, a number above 2^63 − 1). null is absent. OpenAI's cached
// count is read apart (badCount), as only weights read it.
func parseUsage(format Format, b []byte, long bool) (usageCounts, bool) {
	u := noCounts
	if long {
		return u, true
	}
	var raw map[string]json.RawMessage // names match exactly; of a name given twice, the last
	if json.Unmarshal(b, &raw) != nil {
		return u, true
	}
	bad := false
	count := func(r json.RawMessage) int64 {
		n, ok := parseCount(r)
		bad = bad || !ok
		return n
	}
	if format == Gemini {
		zero := func(r json.RawMessage) int64 { return max(count(r), 0) } // left out: 0
		u.prompt = addCapped(zero(raw["promptTokenCount"]), zero(raw["toolUsePromptTokenCount"]))
		u.completion = addCapped(zero(raw["candidatesTokenCount"]), zero(raw["thoughtsTokenCount"]))
		u.total, u.cached = count(raw["totalTokenCount"]), zero(raw["cachedContentTokenCount"])
		return u, bad
	}
	if format == Anthropic {
		u.input, u.output = count(raw["input_tokens"]), count(raw["output_tokens"])
		u.cacheRead, u.cacheWrite = count(raw["cache_read_input_tokens"]), count(raw["cache_creation_input_tokens"])
		return u, bad
	}
	u.total, u.prompt, u.completion = count(raw["total_tokens"]), count(raw["prompt_tokens"]), count(raw["completion_tokens"])
	u.input, u.output = count(raw["input_tokens"]), count(raw["output_tokens"])
	u.cached = cachedCount(raw["prompt_tokens_details"])
	if u.cached == -1 {
		u.cached = cachedCount(raw["input_tokens_details"])
	}
	return u, bad
}

// parseCount parses r, a count of a usage object: -1 when absent or null; false when present
// but not a non-negative integer of at most 2^63 − 1.
func parseCount(r json.RawMessage) (int64, bool) {
	if r == nil || string(r) == "null" {
		return -1, true
	}
	if len(r) > 1 && r[0] == '0' || r[0] < '0' || r[0] > '9' {
		return -1, false // a sign, a leading zero, a string, an object...
	}
	n, err := strconv.ParseInt(string(r), 10, 64)
	if err != nil {
		return -1, false // a fraction, an exponent, too large
	}
	return n, true
}

// cachedCount is the cached_tokens of details, an OpenAI usage's prompt_tokens_details or
// input_tokens_details: -1 when absent (or details is not an object), badCount when present
// but not a count.
func cachedCount(details json.RawMessage) int64 {
	var d map[string]json.RawMessage
	if len(details) == 0 || details[0] != '{' || json.Unmarshal(details, &d) != nil {
		return -1
	}
	n, ok := parseCount(d["cached_tokens"])
	if !ok {
		return badCount
	}
	return n
}

// fields are u's counts, in the order of fieldsPtr.
func (u usageCounts) fields() [8]int64 {
	return [8]int64{u.total, u.prompt, u.completion, u.input, u.output, u.cached, u.cacheRead, u.cacheWrite}
}

// fieldsPtr are pointers to u's counts, in the order of fields.
func (u *usageCounts) fieldsPtr() [8]*int64 {
	return [8]*int64{&u.total, &u.prompt, &u.completion, &u.input, &u.output, &u.cached, &u.cacheRead, &u.cacheWrite}
}

// counts are a usage's counts in one shape whatever its format; -1 where absent.
type counts struct {
	total                     int64 // total_tokens (OpenAI only)
	in                        int64 // every input token: OpenAI's prompt (or input) count; Anthropic's three added
	out                       int64 // completion_tokens or output_tokens
	uncached, cached, written int64 // of in: neither read from nor written to the cache, read, written; for Weighted
	cachedBad                 bool  // OpenAI's cached count is present but not a count
}

// counts returns the usage written so far in one shape, and whether there is one that can be
// charged: false when none was found (Anthropic: no top-level usage), when it is bad, and on a
// nil Scanner.
func (s *Scanner) counts() (counts, bool) {
	if s == nil || !s.found || s.bad {
		return counts{}, false
	}
	u := s.last
	if s.format == Anthropic {
		c := counts{total: -1, in: -1, out: u.output, uncached: u.input, cached: max(u.cacheRead, 0), written: max(u.cacheWrite, 0)}
		if u.input >= 0 {
			c.in = addCapped(addCapped(u.input, c.cached), c.written)
		}
		return c, true
	}
	pick := func(a, b int64) int64 {
		if a >= 0 {
			return a
		}
		return b
	}
	c := counts{total: u.total, in: pick(u.prompt, u.input), out: pick(u.completion, u.output), cached: max(u.cached, 0), cachedBad: u.cached == badCount}
	c.uncached = c.in - c.cached // negative (a usage that does not add up) when cached > in
	return c, true
}

// addCapped returns a + b, at most 2^63 − 1, for a, b ≥ 0.
func addCapped(a, b int64) int64 {
	if n := a + b; n >= 0 {
		return n
	}
	return math.MaxInt64
}

// Tokens returns the count, in tokens, that the usage written so far reports for which (Total,
// Prompt or Completion), and whether it reports one that can be charged: false when no usage
// was found (Anthropic: a stream cut short before its message_delta), when it is bad (too long,
// not an object, or a count present but not a non-negative integer), or when it lacks the
// count, and on a nil Scanner. Prompt is every input token: OpenAI's prompt_tokens (or
// input_tokens), cached ones included; Anthropic's input_tokens, cache_read_input_tokens and
// cache_creation_input_tokens added. Completion is completion_tokens (or output_tokens). Total
// is total_tokens, else the prompt and completion counts added (at most 2^63 − 1).
func (s *Scanner) Tokens(which string) (int64, bool) {
	c, ok := s.counts()
	if !ok {
		return 0, false
	}
	var n int64
	switch which {
	case Prompt:
		n = c.in
	case Completion:
		n = c.out
	default:
		n = c.total
		if n < 0 && c.in >= 0 && c.out >= 0 {
			n = addCapped(c.in, c.out)
		}
	}
	return n, n >= 0
}

// Weighted returns what the usage written so far is charged under w (Weights.Amount), and
// whether it can be: as Tokens, it needs a usage that can be charged, with its input count and
// its output count (or, when that is absent, a total from which the input is taken: an
// embeddings response); OpenAI's cached count, when present, must be a count of at most the
// input. An absent cache count is 0.
func (s *Scanner) Weighted(w *Weights) (int64, bool) {
	c, ok := s.counts()
	if !ok || c.cachedBad || c.in < 0 || c.uncached < 0 {
		return 0, false
	}
	out := c.out
	if out < 0 && c.total >= c.in {
		out = c.total - c.in
	}
	if out < 0 {
		return 0, false
	}
	return w.Amount(c.uncached, c.cached, c.written, out), true
}
