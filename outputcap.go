package ratelimitredis

import (
	"cmp"
	"fmt"
	"math"
	"math/big"
	"net/http"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/usage"
)

// A zone with cap_output reserves at admission a true upper bound of what an LLM request can
// use, and caps the request's output to what the client's budget has left, so that what the
// upstreams report never exceeds the budget. See docs/charging.md, "Budgets that are never
// overdrawn".

// CapOutput makes a charging zone's budget one that is never overdrawn: each request reserves
// its prompt's bound (the request body's length in bytes) and its output cap in the zone's
// units, and when the client has less left, its output cap (max_tokens and its kin) is rewritten
// down to what fits. A request that cannot get its prompt and MinOutput tokens is refused with
// 429. Needs charge openai_usage, anthropic_usage or gemini_usage on a token_bucket or
// fixed_window zone, and no cost (the reservation is computed per request).
type CapOutput struct {
	// The fewest output tokens a request is capped to, per output (choice): a request whose
	// client's budget cannot hold its prompt's bound and this many output tokens is refused
	// (429), never forwarded. 1 to 2^31 − 1. Default: 16.
	MinOutput *int64 `json:"min_output,omitempty"`

	// The output cap, in tokens, given to a request that asks for none, when the budget has
	// that much left: min_output to 2^31 − 1. Default (0): as many as the zone's max_cost
	// allows, which reserves the client's whole budget while such a request runs.
	DefaultOutput int64 `json:"default_output,omitempty"`

	// What a POST to an LLM API whose body the module cannot read gets: "refuse" (the
	// default) answers 415 to a compressed body (Content-Encoding), 413 to one over 1 MiB and
	// 400 to one that is not a single JSON object in UTF-8 (a byte order mark, another
	// encoding, bytes after it), naming why, and never forwards it; "pass" forwards it as it
	// came, reserved at the zone's max_cost and charged what the response reports, at most
	// max_cost, with its output cap not rewritten (outside the never-overdrawn guarantee).
	Unreadable string `json:"unreadable,omitempty"`

	// Also write max_tokens into a chat completions request that has none (it gives only
	// max_completion_tokens, or no cap), for upstreams that read only max_tokens: llama.cpp
	// builds and other servers that predate max_completion_tokens. Off by default: OpenAI's
	// reasoning models (o-series, GPT-5) answer 400 to a request with max_tokens.
	InsertMaxTokens bool `json:"insert_max_tokens,omitempty"`
}

// The values of CapOutput.Unreadable.
const (
	UnreadableRefuse = "refuse"
	UnreadablePass   = "pass"
)

// DefaultMinOutput is CapOutput.MinOutput's default, in tokens.
const DefaultMinOutput = 16

// ratOne is the weight 1 of a usage count, never written to.
var ratOne = big.NewRat(1, 1)

// maxOutputTokens bounds CapOutput's numbers, and the caps it writes: 2^31 − 1.
const maxOutputTokens = math.MaxInt32

// check returns what is wrong with c's numbers, or "".
func (c *CapOutput) check() string {
	switch {
	case c.MinOutput != nil && (*c.MinOutput < 1 || *c.MinOutput > maxOutputTokens):
		return fmt.Sprintf("cap_output min_output %d must be between 1 and %d", *c.MinOutput, maxOutputTokens)
	case c.DefaultOutput < 0 || c.DefaultOutput > maxOutputTokens:
		return fmt.Sprintf("cap_output default_output %d must be between min_output and %d", c.DefaultOutput, maxOutputTokens)
	case c.DefaultOutput > 0 && c.DefaultOutput < c.minOutput():
		return fmt.Sprintf("cap_output default_output %d is below min_output %d", c.DefaultOutput, c.minOutput())
	case c.Unreadable != "" && c.Unreadable != UnreadableRefuse && c.Unreadable != UnreadablePass:
		return fmt.Sprintf("cap_output unreadable %q must be refuse or pass", c.Unreadable)
	}
	return ""
}

// minOutput is MinOutput, or its default.
func (c *CapOutput) minOutput() int64 {
	if c.MinOutput == nil {
		return DefaultMinOutput
	}
	return *c.MinOutput
}

// outputCap is a zone's cap_output, provisioned: its numbers and its charge's weights.
type outputCap struct {
	min, dflt int64
	pass      bool           // unreadable pass
	maxTokens bool           // insert_max_tokens
	after     *afterResponse // the zone's charge: its weights, or its usage count
}

// newOutputCap provisions c for a zone charged by a.
func newOutputCap(c *CapOutput, a *afterResponse) *outputCap {
	return &outputCap{min: c.minOutput(), dflt: c.DefaultOutput, pass: c.Unreadable == UnreadablePass, maxTokens: c.InsertMaxTokens, after: a}
}

// weights returns the most one input token is charged (the largest of the prompt, cached and
// cache-write weights) and what one output token is, for a request whose replacer is repl (nil
// when a token of that kind is not charged); false when a weight's placeholder is unusable.
func (c *outputCap) weights(repl *caddy.Replacer) (prompt, completion *big.Rat, ok bool) {
	a := c.after
	w := a.weights
	if a.dynWeights != nil {
		var err error
		if w, err = a.dynWeights.resolve(repl); err != nil {
			return nil, nil, false
		}
	}
	switch {
	case w != nil:
		for _, x := range []*big.Rat{w.Prompt, w.Cached, w.CacheWrite} {
			if x != nil && x.Sign() > 0 && (prompt == nil || x.Cmp(prompt) > 0) {
				prompt = x
			}
		}
		if w.Completion != nil && w.Completion.Sign() > 0 {
			completion = w.Completion
		}
	case a.charge.Usage == UsagePrompt:
		prompt = ratOne
	case a.charge.Usage == UsageCompletion:
		completion = ratOne
	default:
		prompt, completion = ratOne, ratOne
	}
	return prompt, completion, true
}

// units is n tokens at weight w, in the zone's units, rounded up; 0 for a nil weight, at most
// 2^53 (more than any quota).
func units(w *big.Rat, n int64) int64 {
	if w == nil || n <= 0 {
		return 0
	}
	x := new(big.Rat).Mul(w, new(big.Rat).SetInt64(n))
	q, r := new(big.Int).QuoRem(x.Num(), x.Denom(), new(big.Int))
	if r.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	if !q.IsInt64() || q.Int64() > limiter.MaxCapacity {
		return limiter.MaxCapacity
	}
	return q.Int64()
}

// requestBound returns what a request r asks of a zone with cap_output: its API and what its
// body says. known is false for a request that is not a POST to an API usage.APIOf knows: it
// is reserved at the zone's max_cost and passed on as it came.
func requestBound(r *http.Request) (api usage.API, b usage.Bound, known bool) {
	if r.Method != http.MethodPost {
		return 0, usage.Bound{}, false
	}
	api = usage.APIOf(r.URL.Path)
	if api == 0 {
		return 0, usage.Bound{}, false
	}
	return api, usage.ReadBound(r, api), true
}

// reserve sets rq's cost to the least request r can use in its zone (its prompt's bound and
// min_output tokens per output) and its bound (Request.SetUpTo) to the most: its prompt's
// bound and its output cap (the request's own, else default_output), at most the zone's
// max_cost. A request whose prompt its body does not bound (non-text content), whose weights
// are unknown, or that is not a POST to a known API, costs max_cost; its output is still
// capped (capOutput) to what max_cost leaves after its body's bytes. A cost above max_cost is
// a request the zone can never admit (a prompt larger than the whole budget): 429. The error
// is a usage.Refusal: a body that cannot be read (unless the zone passes it: unreadable
// pass, reserved at max_cost), or a choices count no reader takes for a whole number from 1
// to usage.MaxChoices.
func (c *outputCap) reserve(r *http.Request, repl *caddy.Replacer, rq *limiter.Request) error {
	most := rq.Zone.MaxCostOrQuota()
	api, b, known := requestBound(r)
	if known && b.Refusal.Status != 0 {
		if !b.Readable && c.pass {
			rq.Cost = most
			return nil
		}
		return b.Refusal
	}
	wp, wc, priced := c.weights(repl)
	if !known || !priced {
		rq.Cost = most
		return nil
	}
	prompt := units(wp, b.Prompt)
	if api == usage.Embeddings {
		rq.Cost = max(1, prompt)
		return nil
	}
	choices := max(b.Choices, 1)
	least := max(1, prompt+units(wc, c.min*choices))
	if b.Unbounded {
		rq.Cost = max(most, least) // above max_cost: refused, its output could not be capped
		return nil
	}
	rq.Cost = least
	want := b.Cap
	if want == 0 {
		want = c.dflt
	}
	upTo := most
	if want > 0 {
		upTo = min(most, prompt+units(wc, min(want, limiter.MaxCapacity)*choices))
	}
	rq.SetUpTo(upTo)
	return nil
}

// outputFor returns the most output tokens per output (of choices) that fit in units after a
// prompt of prompt units, an output token weighing wc; maxOutputTokens when output is not
// charged (wc nil).
func outputFor(wc *big.Rat, units, prompt, choices int64) int64 {
	if wc == nil {
		return maxOutputTokens
	}
	left := units - prompt
	if left <= 0 {
		return 0
	}
	per := new(big.Rat).Mul(wc, new(big.Rat).SetInt64(max(choices, 1)))
	x := new(big.Rat).Quo(new(big.Rat).SetInt64(left), per)
	n := new(big.Int).Quo(x.Num(), x.Denom()) // floor: both are positive
	if !n.IsInt64() || n.Int64() > maxOutputTokens {
		return maxOutputTokens
	}
	return n.Int64()
}

// capOutput rewrites the output cap of r, admitted, to what every zone with cap_output among
// reqs reserved for it (Result.Granted, else its cost) leaves after its body's bytes: the
// fewest tokens any of them leaves room for. A body already within that cap goes on as it
// came; one that asks for no cap gets it. A body whose prompt is not bounded by its bytes is
// capped too, to what max_cost leaves. Nothing changes for a body that is not read (passed
// with unreadable pass), a request to no API usage.APIOf knows, or one no zone could price
// (a weight's placeholder unusable).
func (h *Handler) capOutput(r *http.Request, repl *caddy.Replacer, reqs []limiter.Request) {
	capped := false
	for _, rq := range reqs {
		capped = capped || h.Zones[rq.Tag].capOut != nil
	}
	if !capped {
		return
	}
	api, b, known := requestBound(r)
	if !known || !b.Readable || api == usage.Embeddings {
		return // every zone reserved its max_cost, or there is nothing to cap
	}
	limit, maxTokens := int64(-1), false
	for i := range reqs {
		c := h.Zones[reqs[i].Tag].capOut
		if c == nil {
			continue
		}
		wp, wc, known := c.weights(repl)
		if !known {
			continue // this zone reserved its max_cost; the others still cap the request
		}
		maxTokens = maxTokens || c.maxTokens
		n := outputFor(wc, reserved(&reqs[i]), units(wp, b.Prompt), b.Choices)
		if want := cmp.Or(b.Cap, c.dflt); want > 0 {
			n = min(n, want) // an inserted cap is at most the client's own, else default_output
		}
		if limit < 0 || n < limit {
			limit = n
		}
	}
	if limit > 0 && limit < maxOutputTokens {
		usage.SetOutputCap(r, api, limit, maxTokens)
	}
}

// reserved is what rq's admission reserved in its zone: what a bound granted (cap_output), else
// its cost.
func reserved(rq *limiter.Request) int64 { return max(rq.Cost, int64(rq.Result.Granted)) }
