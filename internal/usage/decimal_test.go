package usage

import (
	"math"
	"math/big"
	"strconv"
	"strings"
	"testing"
)

// TestCeilScaled: a decimal cost times the scale, rounded up exactly (0.000124 dollars are 124
// micro-dollars, where float64 arithmetic gives 124.00000000000001 and would round it up to
// 125); the forms Python, Go and JSON write a float in are read; anything else (a sign -, NaN,
// an infinity, hexadecimal, a fraction, spaces, an exponent of 4 digits, a text over 64 bytes)
// is not a decimal; a result above 2^63 − 1 is an overflow.
func TestCeilScaled(t *testing.T) {
	t.Parallel()
	micro := big.NewRat(1000000, 1)
	for _, tc := range []struct {
		v     string
		scale *big.Rat
		want  int64 // -1: not read
	}{
		{"0.000123", micro, 123},
		{"0.000124", micro, 124},
		{"0.0001234", micro, 124},
		{"1.23e-05", micro, 13},
		{"1.2E-5", micro, 12},
		{"0.00012300000000000001", micro, 124},
		{"5", micro, 5000000},
		{"+5", micro, 5000000},
		{".5", micro, 500000},
		{"5.", micro, 5000000},
		{"0", micro, 0},
		{"0.0", micro, 0},
		{"1e-999", micro, 1},
		{"2", big.NewRat(1, 3), 1},
		{"9223372036854775807", big.NewRat(1, 1), math.MaxInt64},
		{"9223372036854775808", big.NewRat(1, 1), -1},
		{"1e300", micro, -1},
		{"-0.5", micro, -1},
		{"-0", micro, -1},
		{"", micro, -1},
		{".", micro, -1},
		{"e5", micro, -1},
		{"1e", micro, -1},
		{"1e1000", micro, -1},
		{"NaN", micro, -1},
		{"inf", micro, -1},
		{"0x10", micro, -1},
		{"1/3", micro, -1},
		{" 1", micro, -1},
		{"1_000", micro, -1},
		{"0." + strings.Repeat("0", 62) + "1", micro, -1},
	} {
		got, ok := CeilScaled(tc.v, tc.scale)
		if !ok {
			got = -1
		}
		if got != tc.want {
			t.Errorf("CeilScaled(%q, %v) = %d, %v; want %d", tc.v, tc.scale, got, ok, tc.want)
		}
	}
}

// FuzzCeilScaled: for any text and scale, CeilScaled reads a decimal only when ParseFloat reads
// the same text as a non-negative number, and then its result c is the exact ceiling: c − 1 <
// value × scale ≤ c; a text of the grammar that ParseFloat reads (and that fits the bounds) is
// read.
func FuzzCeilScaled(f *testing.F) {
	for _, v := range []string{"0.000123", "1.23e-05", "5", "-1", "NaN", "1e1000", "0x1p-2", "+.5E+3"} {
		f.Add(v, uint32(1000000), uint16(1))
	}
	f.Fuzz(func(t *testing.T, v string, num uint32, den uint16) {
		if num == 0 || den == 0 {
			return
		}
		scale := big.NewRat(int64(num), int64(den))
		c, ok := CeilScaled(v, scale)
		fv, err := strconv.ParseFloat(v, 64)
		grammar := isDecimal(v)
		switch {
		case ok && !grammar:
			t.Fatalf("%q read, though not of the grammar", v)
		case grammar && err != nil && !strings.Contains(err.Error(), "range"):
			t.Fatalf("%q: of the grammar, but ParseFloat: %v", v, err)
		case grammar && fv < 0:
			t.Fatalf("%q: of the grammar, but negative", v)
		}
		if !ok {
			x, parsed := ParseDecimal(v)
			if grammar && (!parsed || new(big.Rat).Mul(x, scale).Cmp(new(big.Rat).SetInt64(math.MaxInt64)) <= 0) {
				t.Fatalf("%q × %v: of the grammar and at most 2^63 − 1, but not read", v, scale)
			}
			return
		}
		x, _ := new(big.Rat).SetString(v)
		prod := new(big.Rat).Mul(x, scale)
		cr := new(big.Rat).SetInt64(c)
		if prod.Cmp(cr) > 0 || new(big.Rat).Sub(cr, big.NewRat(1, 1)).Cmp(prod) >= 0 {
			t.Fatalf("CeilScaled(%q, %v) = %d, the value × scale being %v", v, scale, c, prod.FloatString(6))
		}
	})
}
