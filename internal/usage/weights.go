package usage

import "math/big"

// Weights are what one token of each kind is charged, in the unit of a zone's budget, so that a
// budget counts what a provider bills: output tokens at several times the input, cached input at
// a tenth. Each weight is an exact decimal (ParseDecimal) of at least 0; a nil one weighs 0.
type Weights struct {
	Prompt     *big.Rat // an input token neither read from nor written to the prompt cache
	Completion *big.Rat // an output token (reasoning tokens included)
	Cached     *big.Rat // an input token read from the prompt cache
	CacheWrite *big.Rat // an input token written to the prompt cache (Anthropic's cache_creation_input_tokens)
}

// Amount returns the weighted sum of uncached prompt tokens, cached ones, ones written to the
// cache and completion tokens (all ≥ 0), rounded up to an integer: exact, so 30 tokens at 0.1
// are 3, not the 4 that float64 arithmetic would round 3.0000000000000004 up to. A sum above
// 2^63 − 1 is 2^63 − 1.
func (w *Weights) Amount(uncached, cached, written, completion int64) int64 {
	sum := new(big.Rat)
	term := new(big.Rat)
	for _, t := range [...]struct {
		w *big.Rat
		n int64
	}{{w.Prompt, uncached}, {w.Cached, cached}, {w.CacheWrite, written}, {w.Completion, completion}} {
		if t.w != nil && t.n > 0 {
			sum.Add(sum, term.Mul(t.w, term.SetInt64(t.n)))
		}
	}
	n, _ := ceilInt64(sum) // 2^63 − 1 when above it
	return n
}
