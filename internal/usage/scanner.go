// Package usage reads the token usage an OpenAI-compatible API reports in a response body, as
// the body streams by: Scanner reads it from JSON or an event stream, Decoder decodes a
// compressed body on its way to a Scanner within bounds of memory and CPU, and IncludeUsage
// asks a streaming chat completion for its usage. It imports nothing from Caddy.
package usage

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
)

// maxUsageBytes bounds the bytes of one "usage" object the scanner keeps: OpenAI's is about 300.
const maxUsageBytes = 4096

// maxKeyBytes bounds the bytes of a key the scanner keeps to compare with "usage" and
// "response" (longer keys are neither): "response" with every letter escaped (\u0072...).
const maxKeyBytes = 48

// The counts Tokens reports.
const (
	Total      = "total"      // total_tokens, else the prompt and completion counts added
	Prompt     = "prompt"     // prompt_tokens (chat completions) or input_tokens (Responses API)
	Completion = "completion" // completion_tokens or output_tokens
)

// Scanner reads the OpenAI-format usage of a response body as it streams by, holding at most
// maxUsageBytes + maxKeyBytes (4 KiB and 48 bytes) whatever the body's size. It reads JSON with its
// strings and nesting tracked, and takes a "usage" object only where an OpenAI server puts it: at
// the top level of the document, or inside the top-level "response" object (a Responses API event).
// In an event stream (sse) each event's data is a document of its own: the usage of a chat
// completions stream's final chunk (stream_options.include_usage; the others carry "usage": null)
// or the response.usage of a Responses API response.completed event. A key inside a string, inside
// a nested object or array, or spelled otherwise is never taken; a key written with escapes
// (`"us\u0061ge"`) is the key it decodes to, as any JSON parser reads it. The last usage object
// found decides: see Tokens. A Scanner is not safe for concurrent use.
type Scanner struct {
	sse bool

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
	inResp    bool    // the container at depth 2 is the top-level "response" object
	expectKey bool    // the next string at depth 1 or 2 is a key
	inKey     bool    // reading a key at depth 1 or 2
	key       []byte  // its raw bytes, at most maxKeyBytes (keyLong past that)
	keyLong   bool
	pending   int  // what the key just read names: keyOther, keyUsage or keyResponse
	colon     bool // after that key's ':', before its value
	capDepth  int  // > 0: capturing the usage object that opened at this depth
	buf       []byte
	capLong   bool

	found bool        // a usage object was seen
	last  usageCounts // the last one's counts
	bad   bool        // the last one is not a usage we can charge (see parseUsage)
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
	keyResponse
)

// usageCounts are the token counts of a usage object: chat completions name them prompt_tokens
// and completion_tokens, the Responses API input_tokens and output_tokens; both have
// total_tokens. -1: absent (or null).
type usageCounts struct {
	total, prompt, completion, input, output int64
}

// NewScanner returns a scanner for a JSON body (application/json, or any +json type), or for an
// event stream (text/event-stream) when sse. Write the body to it, in chunks of any size.
func NewScanner(sse bool) *Scanner { return &Scanner{sse: sse} }

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
	s.depth, s.inStr, s.esc, s.inResp, s.expectKey, s.inKey, s.colon, s.capDepth = 0, false, false, false, false, false, false, 0
}

// scanJSON scans p, bytes of JSON: strings and nesting are tracked byte by byte; keys are read at
// depth 1 and inside the top-level "response" object; a usage object there is kept until it
// closes, then parsed.
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
			if s.colon && c == '{' {
				switch {
				case s.pending == keyUsage && (s.depth == 2 || s.depth == 3 && s.inResp):
					s.capDepth, s.capLong = s.depth, false
					s.buf = append(s.buf[:0], '{')
				case s.pending == keyResponse && s.depth == 2:
					s.inResp = true
				}
			}
			if s.depth <= 2 {
				s.obj[s.depth] = c == '{'
			}
			s.expectKey = c == '{' && s.keyed()
		case '}', ']':
			if s.capDepth > 0 && s.depth == s.capDepth {
				s.capDepth = 0
				s.found = true
				s.last, s.bad = parseUsage(s.buf, s.capLong)
			}
			if s.depth == 2 {
				s.inResp = false
			}
			s.depth = max(0, s.depth-1)
			s.expectKey = false
		}
		s.colon, s.pending = false, keyOther
	}
}

// keyed reports whether the container at the current depth is one whose keys are read: the
// top-level object, or the "response" object inside it.
func (s *Scanner) keyed() bool {
	return s.depth == 1 && s.obj[1] || s.depth == 2 && s.inResp && s.obj[2]
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
		return keyUsage
	case "response":
		return keyResponse
	}
	return keyOther
}

// parseUsage parses a usage object; bad when it is not one we can charge: too long, not a JSON
// object, or a count that is present but not a non-negative integer (a negative, a fraction, an
// exponent, a string, a number above 2^63 − 1). null is absent.
func parseUsage(b []byte, long bool) (usageCounts, bool) {
	u := usageCounts{-1, -1, -1, -1, -1}
	if long {
		return u, true
	}
	var raw map[string]json.RawMessage // names match exactly; of a name given twice, the last
	if json.Unmarshal(b, &raw) != nil {
		return u, true
	}
	bad := false
	count := func(r json.RawMessage) int64 {
		if r == nil || string(r) == "null" {
			return -1
		}
		if len(r) > 1 && r[0] == '0' || r[0] < '0' || r[0] > '9' {
			bad = true // a sign, a leading zero, a string, an object...
			return -1
		}
		n, err := strconv.ParseInt(string(r), 10, 64)
		if err != nil {
			bad = true // a fraction, an exponent, too large
			return -1
		}
		return n
	}
	u = usageCounts{count(raw["total_tokens"]), count(raw["prompt_tokens"]), count(raw["completion_tokens"]),
		count(raw["input_tokens"]), count(raw["output_tokens"])}
	return u, bad
}

// Tokens returns the count, in tokens, that the last usage object written so far reports for
// which (Total, Prompt or Completion), and whether it reports one that can be charged: false
// when no usage object was found, when the last one is bad (too long, not an object, or a count
// present but not a non-negative integer), or when it lacks the count, and on a nil Scanner.
// Total is total_tokens, else the prompt (or input) and completion (or output) counts added (at
// most 2^63 − 1).
func (s *Scanner) Tokens(which string) (int64, bool) {
	if s == nil || !s.found || s.bad {
		return 0, false
	}
	u := s.last
	pick := func(a, b int64) int64 {
		if a >= 0 {
			return a
		}
		return b
	}
	var n int64
	switch which {
	case Prompt:
		n = pick(u.prompt, u.input)
	case Completion:
		n = pick(u.completion, u.output)
	default:
		n = u.total
		if in, out := pick(u.prompt, u.input), pick(u.completion, u.output); n < 0 && in >= 0 && out >= 0 {
			n = in + out
			if n < 0 {
				n = math.MaxInt64
			}
		}
	}
	return n, n >= 0
}
