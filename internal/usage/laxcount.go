package usage

import (
	"encoding/json"
	"math"
	"strconv"
	"strings"
)

// laxCount returns the count a JSON value v is read as by the laxest reader of a count (a
// Python server validating with pydantic in lax mode, which takes the value Python's json
// module decoded): an integer as written; a number with a fraction or exponent, as a float64,
// when it is whole (2.0, 2e0); a string holding either, spaces around it ignored ("2", " 2.0
// "); true as 1, false as 0. ok is false for any other value (1.5, "x", "1_0", null, an object,
// an array), which no reader takes for a whole number. A count above MaxChoices is returned as
// MaxChoices + 1.
func laxCount(v []byte) (n int64, ok bool) {
	switch {
	case len(v) == 0:
		return 0, false
	case string(v) == "true":
		return 1, true
	case string(v) == "false":
		return 0, true
	case v[0] == '"':
		var s string
		if json.Unmarshal(v, &s) != nil {
			return 0, false
		}
		return numberCount(strings.TrimSpace(s))
	}
	return numberCount(string(v))
}

// numberCount reads s, a decimal number, as laxCount does.
func numberCount(s string) (int64, bool) {
	if s == "" || strings.ContainsRune(s, '_') {
		return 0, false
	}
	if !strings.ContainsAny(s, ".eE") {
		n, err := strconv.ParseInt(s, 10, 64)
		switch {
		case err == nil:
			return min(n, MaxChoices+1), true
		case err.(*strconv.NumError).Err == strconv.ErrRange:
			if s[0] == '-' {
				return 0, true // below 1: refused as such
			}
			return MaxChoices + 1, true
		}
		return 0, false
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) || f != math.Trunc(f) {
		return 0, false
	}
	if f > MaxChoices {
		return MaxChoices + 1, true
	}
	return int64(f), true
}
