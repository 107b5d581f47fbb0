package ratelimitredis

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/big"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/usage"
)

// Weight is one weight of ChargeWeights as configured: a decimal from 0 to 1,000,000 (a JSON
// number, or a Caddyfile argument such as 0.1), or a placeholder (a JSON string such as
// "{http.vars.price_out}") whose value, resolved per request, must be such a decimal. So one
// route can price each model from a `map` of the model placeholder.
type Weight struct {
	value float64 // a literal's value
	expr  string  // a placeholder's expression; "" for a literal
}

// WeightOf returns the literal weight v.
func WeightOf(v float64) *Weight { return &Weight{value: v} }

// WeightText returns the weight written as text: a decimal, or an expression with a
// placeholder.
func WeightText(text string) (*Weight, error) {
	if strings.Contains(text, "{") {
		return &Weight{expr: text}, nil
	}
	v, err := strconv.ParseFloat(text, 64)
	if err != nil {
		return nil, fmt.Errorf("%q is not a number or a placeholder", text)
	}
	return WeightOf(v), nil
}

// MarshalJSON writes w as it was given: a number, or a string with a placeholder.
func (w Weight) MarshalJSON() ([]byte, error) {
	if w.expr != "" {
		return json.Marshal(w.expr)
	}
	return json.Marshal(w.value)
}

// UnmarshalJSON reads a JSON number, or a string: a placeholder expression, or a decimal.
func (w *Weight) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if len(b) > 0 && b[0] == '"' {
		var text string
		if err := json.Unmarshal(b, &text); err != nil {
			return err
		}
		v, err := WeightText(text)
		if err != nil {
			return err
		}
		*w = *v
		return nil
	}
	*w = Weight{}
	return json.Unmarshal(b, &w.value)
}

// decimal returns w's value as an exact decimal (the shortest that reads as its float64: 0.1 is
// a tenth), or def when w is nil; a placeholder is resolved with repl (nil: its value is not
// known, and the result is nil). The error is a value that is not a decimal from 0 to
// MaxChargeWeight.
func (w *Weight) decimal(def *big.Rat, repl *caddy.Replacer) (*big.Rat, error) {
	switch {
	case w == nil:
		return def, nil
	case w.expr == "":
		r, ok := usage.ParseDecimal(strconv.FormatFloat(w.value, 'g', -1, 64))
		if !ok {
			return new(big.Rat), nil // out of range: validation refuses it first
		}
		return r, nil
	case repl == nil:
		return nil, nil
	}
	v := strings.TrimSpace(repl.ReplaceAll(w.expr, ""))
	r, ok := usage.ParseDecimal(v)
	if !ok || r.Cmp(big.NewRat(MaxChargeWeight, 1)) > 0 {
		return nil, fmt.Errorf("weight %s is %q, not a decimal from 0 to %d", w.expr, v, MaxChargeWeight)
	}
	return r, nil
}

// placeholder reports whether w comes from a placeholder.
func (w *Weight) placeholder() bool { return w != nil && w.expr != "" }

// dynamic reports whether a weight of w comes from a placeholder.
func (w *ChargeWeights) dynamic() bool {
	return w.Prompt.placeholder() || w.Completion.placeholder() || w.Cached.placeholder() || w.CacheWrite.placeholder()
}

// resolve returns w as exact decimals, a default filled in where none is given: prompt and
// completion 1, cached and cache_write the prompt weight. A placeholder is resolved with repl;
// its value must be a decimal from 0 to MaxChargeWeight, else the error says which.
func (w *ChargeWeights) resolve(repl *caddy.Replacer) (*usage.Weights, error) {
	one := big.NewRat(1, 1)
	prompt, err := w.Prompt.decimal(one, repl)
	if err != nil {
		return nil, err
	}
	completion, err := w.Completion.decimal(one, repl)
	if err != nil {
		return nil, err
	}
	cached, err := w.Cached.decimal(prompt, repl)
	if err != nil {
		return nil, err
	}
	written, err := w.CacheWrite.decimal(prompt, repl)
	if err != nil {
		return nil, err
	}
	return &usage.Weights{Prompt: prompt, Completion: completion, Cached: cached, CacheWrite: written}, nil
}
