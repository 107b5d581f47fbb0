package ratelimitredis

import (
	"bytes"
	"encoding/json"
)

// maxUsageBytes bounds the bytes of one "usage" object the scanner keeps: OpenAI's is about 300.
const maxUsageBytes = 4096

// The scanner's states.
const (
	usageSearch  = iota // looking for the key "usage"
	usageColon          // after it: whitespace, then ':'
	usageOpen           // after ':': whitespace, then '{' (null and the like are skipped)
	usageCapture        // inside the object: kept until its closing brace
)

var usageKey = []byte(`"usage"`)

// usageScanner finds the OpenAI-format "usage" objects in a response body as it streams by,
// holding at most maxUsageBytes whatever the body's size, and remembers the last one: the
// top-level usage of a chat completion or Responses API JSON body, the usage of the final chunk
// of a chat completions stream (stream_options.include_usage; the others carry "usage": null),
// or the response.usage of a Responses API stream's response.completed event. In JSON a quote
// inside a string is escaped, so `"usage"` followed by ':' is always a key.
type usageScanner struct {
	state int
	match int // bytes of usageKey matched so far
	depth int // brace depth inside the captured object
	inStr bool
	esc   bool
	buf   []byte

	found bool
	last  usageCounts
}

// usageCounts are the token counts of a usage object: chat completions name them prompt_tokens
// and completion_tokens, the Responses API input_tokens and output_tokens; both have
// total_tokens.
type usageCounts struct {
	Total      *int64 `json:"total_tokens"`
	Prompt     *int64 `json:"prompt_tokens"`
	Completion *int64 `json:"completion_tokens"`
	Input      *int64 `json:"input_tokens"`
	Output     *int64 `json:"output_tokens"`
}

// Write scans p; it never fails.
func (s *usageScanner) Write(p []byte) {
	for i := 0; i < len(p); {
		switch s.state {
		case usageSearch:
			if s.match == 0 {
				j := bytes.IndexByte(p[i:], '"')
				if j < 0 {
					return
				}
				i += j
			}
			c := p[i]
			i++
			switch {
			case c == usageKey[s.match]:
				s.match++
				if s.match == len(usageKey) {
					s.state, s.match = usageColon, 0
				}
			case c == '"':
				s.match = 1
			default:
				s.match = 0
			}
		case usageColon, usageOpen:
			c := p[i]
			i++
			switch {
			case c == ' ' || c == '\t' || c == '\r' || c == '\n':
			case c == ':' && s.state == usageColon:
				s.state = usageOpen
			case c == '{' && s.state == usageOpen:
				s.state, s.depth, s.inStr, s.esc = usageCapture, 1, false, false
				s.buf = append(s.buf[:0], '{')
			default:
				s.state = usageSearch
				i-- // it may begin the next key
			}
		default: // usageCapture
			c := p[i]
			i++
			if len(s.buf) >= maxUsageBytes {
				s.state = usageSearch // not a usage object of ours: too big
				continue
			}
			s.buf = append(s.buf, c)
			switch {
			case s.inStr && s.esc:
				s.esc = false
			case s.inStr && c == '\\':
				s.esc = true
			case s.inStr && c == '"':
				s.inStr = false
			case s.inStr:
			case c == '"':
				s.inStr = true
			case c == '{':
				s.depth++
			case c == '}':
				s.depth--
				if s.depth == 0 {
					var u usageCounts
					if json.Unmarshal(s.buf, &u) == nil && (u.Total != nil || u.Prompt != nil || u.Completion != nil || u.Input != nil || u.Output != nil) {
						s.found, s.last = true, u
					}
					s.state = usageSearch
				}
			}
		}
	}
}

// tokens returns the count the last usage object reports for which (total, prompt or
// completion), and whether it reports one.
func (s *usageScanner) tokens(which string) (int64, bool) {
	if s == nil || !s.found {
		return 0, false
	}
	u := s.last
	pick := func(a, b *int64) (int64, bool) {
		switch {
		case a != nil:
			return *a, true
		case b != nil:
			return *b, true
		}
		return 0, false
	}
	switch which {
	case UsagePrompt:
		return pick(u.Prompt, u.Input)
	case UsageCompletion:
		return pick(u.Completion, u.Output)
	}
	if u.Total != nil {
		return *u.Total, true
	}
	in, ok1 := pick(u.Prompt, u.Input)
	out, ok2 := pick(u.Completion, u.Output)
	return in + out, ok1 && ok2
}
