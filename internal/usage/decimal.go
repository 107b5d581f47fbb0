package usage

import (
	"math"
	"math/big"
)

// MaxDecimalBytes bounds the text of a decimal that ParseDecimal reads: a longer one is not
// read. 64 bytes hold any float64 as Python, Go or JSON writes it (0.00012300000000000001,
// 1.23e-05) with room to spare.
const MaxDecimalBytes = 64

// maxExponentDigits bounds the digits of a decimal's exponent, so that the exact value of any
// decimal read is at most about 3,300 bits (10^999): a header cannot make its reading costly.
const maxExponentDigits = 3

// ParseDecimal parses s, a non-negative decimal number, exactly (0.1 is one tenth, not the
// float64 nearest it): an optional +, digits with an optional fraction (5, 0.5, .5, 5.), and an
// optional exponent of at most 3 digits (1.23e-05, 1E+06), as JSON, Go and Python's repr of a
// float write one; at most MaxDecimalBytes. It returns false for anything else: a sign -, an
// empty string, NaN, an infinity, hexadecimal, a fraction such as 1/3, spaces.
func ParseDecimal(s string) (*big.Rat, bool) {
	if !isDecimal(s) {
		return nil, false
	}
	r, ok := new(big.Rat).SetString(s)
	return r, ok
}

// isDecimal reports whether s has ParseDecimal's grammar and length.
func isDecimal(s string) bool {
	if len(s) == 0 || len(s) > MaxDecimalBytes {
		return false
	}
	i := 0
	if s[0] == '+' {
		i++
	}
	digits := 0
	for ; i < len(s) && isDigit(s[i]); i++ {
		digits++
	}
	if i < len(s) && s[i] == '.' {
		for i++; i < len(s) && isDigit(s[i]); i++ {
			digits++
		}
	}
	if digits == 0 {
		return false
	}
	if i < len(s) && (s[i] == 'e' || s[i] == 'E') {
		i++
		if i < len(s) && (s[i] == '+' || s[i] == '-') {
			i++
		}
		exp := 0
		for ; i < len(s) && isDigit(s[i]); i++ {
			exp++
		}
		if exp == 0 || exp > maxExponentDigits {
			return false
		}
	}
	return i == len(s)
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// CeilScaled returns ceil(v × scale), v being the text of a decimal (ParseDecimal), and true;
// false when v is not one, or when the result is above 2^63 − 1. scale 1000000 turns a cost in
// dollars into micro-dollars: 0.000123 is 123, 0.0001234 is 124.
func CeilScaled(v string, scale *big.Rat) (int64, bool) {
	x, ok := ParseDecimal(v)
	if !ok {
		return 0, false
	}
	return ceilInt64(x.Mul(x, scale))
}

// ceilInt64 returns the least integer at least x (x ≥ 0), and whether it is at most 2^63 − 1.
func ceilInt64(x *big.Rat) (int64, bool) {
	q, m := new(big.Int).QuoRem(x.Num(), x.Denom(), new(big.Int))
	if m.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	if !q.IsInt64() {
		return math.MaxInt64, false
	}
	return q.Int64(), true
}
