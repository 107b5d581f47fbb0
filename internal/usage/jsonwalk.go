package usage

import (
	"bytes"
	"encoding/json"
	"unicode"
	"unicode/utf8"
)

// The functions of this file walk a JSON text that encoding/json has accepted (parseRequest
// says object): they index its bytes, never check its syntax, and allocate nothing but the
// name of a member written with escapes.

// skipSpace returns the index of the first byte of b at or after i that is not JSON
// whitespace, or len(b).
func skipSpace(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// stringEnd returns the index just past the JSON string whose opening quote is b[i].
func stringEnd(b []byte, i int) int {
	for i++; ; {
		q := bytes.IndexByte(b[i:], '"')
		if q < 0 {
			return len(b)
		}
		i += q
		bs := 0
		for bs < i && b[i-1-bs] == '\\' {
			bs++
		}
		i++
		if bs%2 == 0 {
			return i
		}
	}
}

// valueEnd returns the index just past the JSON value that begins at b[i].
func valueEnd(b []byte, i int) int {
	depth := 0
	for i < len(b) {
		switch b[i] {
		case '"':
			i = stringEnd(b, i)
			if depth == 0 {
				return i
			}
			continue
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return i // the end of a number or literal inside its container
			}
			depth--
			if depth == 0 {
				return i + 1
			}
		case ',', ' ', '\t', '\n', '\r':
			if depth == 0 {
				return i
			}
		}
		i++
	}
	return i
}

// member is one member of a JSON object: its name as written between the quotes, and its
// value, body[start:end].
type member struct {
	name       []byte
	start, end int
}

// eachMember calls fn on each member of the JSON object that opens at b[i] ('{'), in order.
func eachMember(b []byte, i int, fn func(m member)) {
	i = skipSpace(b, i+1)
	for i < len(b) && b[i] == '"' {
		end := stringEnd(b, i)
		name := b[i+1 : end-1]
		start := skipSpace(b, skipSpace(b, end)+1) // past the ':'
		vend := valueEnd(b, start)
		fn(member{name, start, vend})
		i = skipSpace(b, vend)
		if i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
}

// unescapedName returns a member's name with its escapes decoded; it allocates only when
// the name has escapes.
func unescapedName(name []byte) []byte {
	if bytes.IndexByte(name, '\\') < 0 {
		return name
	}
	var s string
	quoted := make([]byte, 0, len(name)+2)
	quoted = append(append(append(quoted, '"'), name...), '"')
	if json.Unmarshal(quoted, &s) != nil {
		return nil
	}
	return []byte(s)
}

// maxFolded bounds the length of a folded name, in bytes; a longer name folds to nothing.
const maxFolded = 48

// foldName writes into buf the name n (unescaped) folded: ASCII letters in lower case,
// without '_', a non-ASCII letter replaced by the ASCII letter it equals under Unicode case
// folding (the Kelvin sign is 'k', as Go's encoding/json reads it). It returns nil for a name
// longer than maxFolded or with another non-ASCII character: no name the readers look for.
// "max_output_tokens" and "maxOutputTokens" fold to the same "maxoutputtokens".
func foldName(buf *[maxFolded]byte, n []byte) []byte {
	k := 0
	for len(n) > 0 {
		c := rune(n[0])
		size := 1
		if c >= utf8.RuneSelf {
			c, size = utf8.DecodeRune(n)
			c = unicode.ToLower(unicode.ToUpper(c))
			if c >= utf8.RuneSelf {
				return nil
			}
		}
		n = n[size:]
		switch {
		case c == '_':
			continue
		case 'A' <= c && c <= 'Z':
			c += 'a' - 'A'
		}
		if k == maxFolded {
			return nil
		}
		buf[k] = byte(c)
		k++
	}
	return buf[:k]
}

// positiveInt returns v's value when v is a JSON number that is an integer greater than 0
// written without fraction or exponent and at most 2^63-1; 0 for any other value.
func positiveInt(v []byte) int64 {
	if len(v) == 0 || v[0] < '1' || v[0] > '9' {
		return 0
	}
	var n int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0
		}
		d := int64(c - '0')
		if n > (1<<63-1-d)/10 {
			return 0
		}
		n = n*10 + d
	}
	return n
}
