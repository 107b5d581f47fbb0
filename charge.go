package ratelimitredis

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/big"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/usage"
)

// Charging after the response: a zone with count_status or charge takes its cost as a hold at
// admission (so concurrent requests cannot overshoot), and settles it once the response is
// complete, in one settle.lua call: to 0 (count_status, status not listed), to what the response
// reports (charge), or to the cost (nothing reported). See docs/charging.md.

// Sources of Charge.
const (
	ChargeHeader         = "header"
	ChargeOpenAIUsage    = "openai_usage"
	ChargeAnthropicUsage = "anthropic_usage"
	ChargeGeminiUsage    = "gemini_usage"
)

// Values of Charge.Usage.
const (
	UsageTotal      = usage.Total
	UsagePrompt     = usage.Prompt
	UsageCompletion = usage.Completion
)

// DefaultHoldMax is how long a zone's reservation waits for its response by default: an
// unsettled hold (the instance crashed, Redis failed at settlement) counts as charged after it.
const DefaultHoldMax = 10 * time.Minute

// MaxHoldMax bounds hold_max.
const MaxHoldMax = 24 * time.Hour

// Charge is what a zone charges once the response is complete, in place of its cost, which is
// then a reservation taken at admission.
type Charge struct {
	// `header`: a non-negative integer in the response header field Header (with Scale, a
	// decimal); `openai_usage`: the OpenAI-format `usage` of a JSON body, of the final event of
	// a chat completions stream (`stream_options.include_usage`), or of a Responses API
	// `response.completed` event; `anthropic_usage`: the `usage` of Anthropic's Messages API, of
	// a JSON body, or of a stream (input counts in `message_start`, the output count in the last
	// `message_delta`); `gemini_usage`: the `usageMetadata` of Google's Gemini API
	// (generateContent, streamGenerateContent). Required.
	Source string `json:"source,omitempty"`

	// header: the response header field (or trailer) holding the amount.
	// Required with source `header`.
	Header string `json:"header,omitempty"`

	// header: read the field as a non-negative decimal (0.000123, 1.23e-05) and charge it times
	// Scale, rounded up exactly: ceil(value × scale). For gateways that report what a request
	// cost in dollars, such as LiteLLM's `x-litellm-response-cost`: 1000000 charges
	// micro-dollars. Greater than 0, at most 10^15. A value that is not a decimal, a negative,
	// or a product above 2^63 − 1 keeps the reservation, as without Scale a value that is not a
	// non-negative integer of at most 2^63 − 1 does. Default (0): an integer, charged as it is.
	Scale float64 `json:"scale,omitempty"`

	// openai_usage, anthropic_usage, gemini_usage: which count to charge: `total` (OpenAI's
	// total_tokens, else the prompt and completion counts added), `prompt` (every input token:
	// OpenAI's prompt_tokens or input_tokens, cached ones included; Anthropic's input_tokens,
	// cache_read_input_tokens and cache_creation_input_tokens added) or `completion`
	// (completion_tokens or output_tokens). Default: `total`, unless Weights is given.
	Usage string `json:"usage,omitempty"`

	// openai_usage, anthropic_usage, gemini_usage, instead of Usage: charge the counts weighted
	// (see ChargeWeights), the sum rounded up. Default: none, Usage decides.
	Weights *ChargeWeights `json:"weights,omitempty"`

	// openai_usage, anthropic_usage, gemini_usage: what a successful (2xx) response that reports no
	// usage we can charge is charged, in the zone's units (0 to 2^53): no usage object, a count
	// that is negative or not an integer, a body in a content coding that is not read or whose
	// decoding stopped at its bounds, a stream cut short, a request whose client went away before
	// the response; size it as the most one request can be charged (for total, the model's context
	// length). Default (absent): the zone's max_cost (its capacity or limit unless set), the most
	// any response can be charged, so that no client gains by making its usage go unreported. At
	// most max_cost counts: a larger amount is charged as max_cost.
	Missing *int64 `json:"missing,omitempty"`
}

// ChargeWeights are what one token of each kind is charged, in the zone's units, so that a
// budget counts what a provider bills (output tokens at several times the input, cached input
// at a tenth): a weight is a decimal from 0 to 1,000,000, read exactly (0.1 is a tenth), or a
// placeholder whose value is one (see Weight), and the weighted sum is rounded up. With a
// provider's prices per million tokens as the weights, the zone counts micro-dollars.
type ChargeWeights struct {
	// An input token neither read from nor written to the prompt cache: OpenAI's prompt_tokens
	// (or input_tokens) less the cached ones; Anthropic's input_tokens. Default: 1.
	Prompt *Weight `json:"prompt,omitempty"`

	// An output token (completion_tokens or output_tokens, reasoning tokens included); an
	// OpenAI usage without one (embeddings) counts its total_tokens less its prompt tokens.
	// Default: 1.
	Completion *Weight `json:"completion,omitempty"`

	// An input token read from the prompt cache: OpenAI's prompt_tokens_details.cached_tokens
	// (input_tokens_details.cached_tokens in the Responses API), Anthropic's
	// cache_read_input_tokens. Default: the prompt weight.
	Cached *Weight `json:"cached,omitempty"`

	// An input token written to the prompt cache: Anthropic's cache_creation_input_tokens (OpenAI
	// reports none). Default: the prompt weight.
	CacheWrite *Weight `json:"cache_write,omitempty"`
}

// MaxChargeWeight bounds a weight of ChargeWeights, and MaxChargeScale Charge.Scale.
const (
	MaxChargeWeight = 1_000_000
	MaxChargeScale  = 1e15
)

// check returns what is wrong with w: a weight out of range, or every weight 0.
func (w *ChargeWeights) check() string {
	all := []struct {
		name string
		v    *Weight
	}{{"prompt", w.Prompt}, {"completion", w.Completion}, {"cached", w.Cached}, {"cache_write", w.CacheWrite}}
	some := false
	for _, c := range all {
		switch {
		case c.v == nil:
			some = some || c.name == "prompt" || c.name == "completion" // default 1
		case c.v.placeholder():
			some = true // its value is checked per request
		case !(c.v.value >= 0 && c.v.value <= MaxChargeWeight):
			return fmt.Sprintf("charge weight %s %v must be between 0 and %d", c.name, c.v.value, MaxChargeWeight)
		case c.v.value > 0:
			some = true
		}
	}
	if !some {
		return "charge weights are all 0: the zone would charge nothing"
	}
	return ""
}

// decimalOf returns *v as the shortest decimal that reads as it (0.1 as a tenth), or def when
// v is nil.
func decimalOf(v *float64, def int64) *big.Rat {
	if v == nil {
		return big.NewRat(def, 1)
	}
	r, ok := usage.ParseDecimal(strconv.FormatFloat(*v, 'g', -1, 64))
	if !ok {
		return new(big.Rat) // out of range: validation refuses it first
	}
	return r
}

// afterResponse is a zone's count_status and charge, provisioned.
type afterResponse struct {
	statuses [600]bool // count_status: the listed codes; all false without count_status
	counting bool      // count_status is set
	bounded  bool      // cap_output: a request's reservation bounds what it uses
	charge   *Charge
	// format: with charge openai_usage, anthropic_usage or gemini_usage, the body is read in
	// this format; 0 otherwise.
	format  usage.Format
	weights *usage.Weights // the charge's weights; nil without them, or with placeholders
	// dynWeights are the charge's weights when one is a placeholder: resolved per request
	// (weightsFor); nil otherwise.
	dynWeights *ChargeWeights
	scale      *big.Rat // charge header with a scale; nil otherwise
	hold       time.Duration
	charged    prometheus.Counter
	refunded   prometheus.Counter
	inFlight   prometheus.Gauge   // concurrency: the zone's slots this instance holds; nil otherwise
	missing    prometheus.Counter // charge: responses charged Charge.Missing
	capped     prometheus.Counter // charge: amounts reported above max_cost, charged max_cost
	warned     atomic.Int64       // Unix ns of the last warning of a missing usage
	// warnedWeight is the Unix ns of the last warning of an unusable weight placeholder.
	warnedWeight atomic.Int64
	// undecoded: a charge of usage, the compressed responses whose decoding stopped, by
	// reason (usage.StopReasons' order); warnedUndecoded, the Unix ns of the last warning of one.
	undecoded       [len(usage.StopReasons)]prometheus.Counter
	warnedUndecoded atomic.Int64
}

// provisionAfter provisions the zone's count_status, charge and hold_max; a zone with neither
// of the first two has z.after nil.
func (z *Zone) provisionAfter() error {
	z.after = nil
	if z.lz.Algorithm.HoldsSlots() {
		return z.provisionSlots()
	}
	if len(z.CountStatus) == 0 && z.Charge == nil {
		return nil
	}
	a := &afterResponse{charge: z.Charge, hold: time.Duration(z.HoldMax)}
	if a.hold == 0 {
		a.hold = DefaultHoldMax
	}
	for _, s := range z.CountStatus {
		lo, hi, err := parseStatus(s)
		if err != nil {
			return fmt.Errorf("zone %s: count_status: %w", z.Name, err)
		}
		for c := lo; c <= hi; c++ {
			a.statuses[c] = true
		}
		a.counting = true
	}
	if c := z.Charge; c != nil {
		a.format = usageFormat(c.Source)
		switch {
		case a.format != 0 && c.Weights != nil && c.Weights.dynamic():
			a.dynWeights = c.Weights // resolved per request
		case a.format != 0 && c.Weights != nil:
			a.weights, _ = c.Weights.resolve(nil) // literals: no error
		case a.format != 0 && c.Usage == "":
			c.Usage = UsageTotal
		case c.Source == ChargeHeader && c.Scale != 0:
			a.scale = decimalOf(&c.Scale, 1)
		}
	}
	if limiter.ValidZoneName(z.Name) {
		initMetrics()
		a.charged = metrics.charged.WithLabelValues(z.Name)
		a.refunded = metrics.refunded.WithLabelValues(z.Name)
		if z.Charge != nil {
			a.missing = metrics.chargeMissing.WithLabelValues(z.Name)
			a.capped = metrics.chargeCapped.WithLabelValues(z.Name)
		}
		if a.format != 0 {
			for i, reason := range usage.StopReasons {
				a.undecoded[i] = metrics.chargeUndecoded.WithLabelValues(z.Name, reason)
			}
		}
		exportSettleFailures()
	}
	z.after = a
	return nil
}

// usageFormat returns the usage format a charge of source reads, 0 for a source that reads no
// usage.
func usageFormat(source string) usage.Format {
	switch source {
	case ChargeOpenAIUsage:
		return usage.OpenAI
	case ChargeAnthropicUsage:
		return usage.Anthropic
	case ChargeGeminiUsage:
		return usage.Gemini
	}
	return 0
}

// exportSettleFailures exports the settlement failures at 0 for every reason from the load of a
// config that settles, so that a rate over the first failures of a reason is defined.
func exportSettleFailures() {
	for _, reason := range settleFailureReasons {
		metrics.settleFailures.WithLabelValues(string(reason))
	}
}

// parseStatus parses a count_status code (401) or class (4xx) into the codes it covers.
func parseStatus(s string) (lo, hi int, err error) {
	if len(s) == 3 && s[0] >= '1' && s[0] <= '5' && (s[1:] == "xx" || s[1:] == "XX") {
		lo = int(s[0]-'0') * 100
		return lo, lo + 99, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 100 || n > 599 {
		return 0, 0, fmt.Errorf("%q is not a status code (100 to 599) or a class such as 4xx", s)
	}
	return n, n, nil
}

// amount is what the zone charges for a response of status whose writer is cw, the request rq
// having reserved its cost: 0 when count_status does not list the status; with charge, what
// the response reports, at most the zone's max_cost (capped), or, when it reports nothing, the
// cost (charge header, or an unsuccessful response) or Charge.Missing (a charge of usage, a
// 2xx response: missing). With charge, a request whose client went away before the response
// (cw.clientLeft) is a 2xx that reported nothing: the upstream may have done all of its work.
func (a *afterResponse) amount(rq limiter.Request, status int, cw *chargeWriter, w *usage.Weights) (n int64, missing, capped bool) {
	if a.charge != nil && cw.clientLeft {
		status = http.StatusOK
	}
	if a.counting && (status < 0 || status >= len(a.statuses) || !a.statuses[status]) {
		return 0, false, false
	}
	if a.charge == nil {
		return rq.Cost, false, false
	}
	most := rq.Zone.MaxCostOrQuota()
	n, reported := a.reported(cw, w)
	if !reported && a.format != 0 && status >= 200 && status < 300 {
		missing := most
		if a.charge.Missing != nil {
			missing = min(*a.charge.Missing, most)
		}
		if a.bounded {
			missing = min(missing, reserved(&rq)) // a true bound of what it used
		}
		return missing, true, false
	}
	if !reported {
		return reserved(&rq), false, false // the reservation stands
	}
	if n > most {
		return most, false, true
	}
	return n, false, false
}

// reported returns the amount the response seen by cw reports for the charge, and whether it
// reports one: the header field (or trailer), an integer or, with a scale, a decimal scaled; or
// the usage read from the body (none when its decoding stopped: what the undecoded rest
// reports is unknown), a count or weighted by w (the request's weights: weightsFor).
func (a *afterResponse) reported(cw *chargeWriter, w *usage.Weights) (int64, bool) {
	if a.format == 0 {
		v := cw.Header().Get(a.charge.Header)
		if v == "" {
			v = cw.Header().Get(http.TrailerPrefix + a.charge.Header)
		}
		v = strings.TrimSpace(v)
		if a.scale != nil {
			return usage.CeilScaled(v, a.scale)
		}
		x, err := strconv.ParseInt(v, 10, 64)
		return x, err == nil && x >= 0
	}
	scan := cw.scans[a.format]
	if cw.undecoded != "" {
		return 0, false
	}
	switch {
	case w != nil:
		return scan.Weighted(w)
	case a.dynWeights != nil:
		return 0, false // a weight's placeholder is unusable: no amount can be known
	}
	return scan.Tokens(a.charge.Usage)
}

// chargeWriter sees the response of a request whose zones settle after it: its status, its
// header, and, when a zone charges a usage, its body, scanned as it passes through (and decoded
// when compressed). It buffers nothing: every write goes on to the client first, then to the
// scanners, and Flush reaches the writer below (through Unwrap, with http.ResponseController).
type chargeWriter struct {
	*caddyhttp.ResponseWriterWrapper
	status int // the final status written; 0 while none
	// formats: the usage formats its zones read (formats[usage.OpenAI], formats[usage.Anthropic],
	// formats[usage.Gemini]), each with its scanner in scans once the body is JSON or an event
	// stream.
	formats  [usage.Formats]bool
	readBody bool // a zone reads a usage
	scans    [usage.Formats]*usage.Scanner
	sink     io.Writer      // where the body goes to be scanned: the scanner(s), or dec
	dec      *usage.Decoder // the body's decoder when it is compressed
	coding   string         // the body's content coding
	// undecoded is why the body's decoding stopped before its end (usage.Decoder.Finish), once
	// finished; "" when it did not.
	undecoded string
	// served: the request was passed on to the next handler. clientLeft: it was, and its client
	// went away before any response header was written (set at settlement).
	served, clientLeft bool
	// start is when the request was passed on, when an adaptive_concurrency zone measures its
	// latency (zero otherwise); headerAt when its first final header was written.
	start, headerAt time.Time
}

// WriteHeader records the first final status, and, when the body is to be read, whether it can
// be: JSON or an event stream, in a content coding the scanner reads.
func (cw *chargeWriter) WriteHeader(code int) {
	if cw.status == 0 && code >= 200 {
		cw.status = code
		if !cw.start.IsZero() {
			cw.headerAt = time.Now()
		}
		if cw.readBody {
			cw.startScan()
		}
	}
	cw.ResponseWriter.WriteHeader(code)
}

// startScan sets up the scanner of the body of the header written.
func (cw *chargeWriter) startScan() {
	mt, _, err := mime.ParseMediaType(cw.Header().Get("Content-Type"))
	sse := mt == "text/event-stream"
	if err != nil || !sse && mt != "application/json" && !strings.HasSuffix(mt, "+json") {
		return
	}
	coding, ok := usage.BodyCoding(cw.Header())
	cw.coding = coding
	if !ok {
		return
	}
	var sinks []io.Writer
	for f, on := range cw.formats {
		if on {
			cw.scans[f] = usage.NewScanner(usage.Format(f), sse)
			sinks = append(sinks, cw.scans[f])
		}
	}
	cw.sink = sinks[0]
	if len(sinks) > 1 {
		cw.sink = io.MultiWriter(sinks...)
	}
	if coding != "identity" {
		cw.dec = usage.NewDecoder(coding, cw.sink)
		cw.sink = cw.dec
	}
}

// Write writes p on, then scans it (even when the client is gone: what the upstream reported
// counts).
func (cw *chargeWriter) Write(p []byte) (int, error) {
	if cw.status == 0 {
		cw.WriteHeader(http.StatusOK)
	}
	n, err := cw.ResponseWriter.Write(p)
	if cw.sink != nil {
		_, _ = cw.sink.Write(p)
	}
	return n, err
}

// ReadFrom copies through Write when the body is scanned; else as the wrapper does.
func (cw *chargeWriter) ReadFrom(r io.Reader) (int64, error) {
	if !cw.readBody {
		return cw.ResponseWriterWrapper.ReadFrom(r)
	}
	return io.Copy(struct{ io.Writer }{cw}, r)
}

// finish waits until the body written is scanned, once the response is complete.
func (cw *chargeWriter) finish() {
	if cw.dec != nil {
		cw.undecoded = cw.dec.Finish()
		cw.dec, cw.sink = nil, nil
	}
}

// serveAndSettle passes an admitted request on with a writer that sees its response, and once
// the response is complete settles every zone that holds its charge (d.Held), with one call.
// The settlement's outcome is counted and logged, never retried: a hold that is not settled
// counts as charged after its hold_max.
func (h *Handler) serveAndSettle(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, reqs []limiter.Request, d limiter.Decision, repl *caddy.Replacer) error {
	cw := &chargeWriter{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}}
	for _, rq := range reqs {
		if a := h.Zones[rq.Tag].after; rq.Hold > 0 && a != nil && a.format != 0 {
			cw.formats[a.format], cw.readBody = true, true
		}
	}
	if cw.readBody {
		usage.AcceptReadable(r.Header)
	}
	if cw.formats[usage.OpenAI] {
		_ = publishModel(r, repl) // the body read once, for IncludeUsage and the logs; admitted already
		usage.IncludeUsage(r)
	}
	var charged *int64 // {http.rate_limit_redis.charged}: the first settling zone's amount
	repl.Map(func(key string) (any, bool) {
		if key != placeholderPrefix+"charged" || charged == nil {
			return nil, false
		}
		return *charged, true
	})
	settled := false
	defer func() {
		// A handler that panics still settles, with what the response showed: reverse_proxy
		// aborts a response whose client went away mid-stream with panic(http.ErrAbortHandler).
		if p := recover(); p != nil {
			if !settled {
				h.settleResponse(r, cw, reqs, d.Held, errors.New("handler panicked"), &charged)
			}
			logCharged(r, charged)
			panic(p)
		}
	}()
	cw.served = true
	if anyAlgorithm(reqs, limiter.Algorithm.Adapts) {
		cw.start = time.Now()
	}
	err := next.ServeHTTP(cw, r)
	settled = true
	h.settleResponse(r, cw, reqs, d.Held, err, &charged)
	return err
}

// chargedLogField is the access log field that carries {http.rate_limit_redis.charged} when a
// handler panics: the name docs/responses.md gives `log_append` for it.
const chargedLogField = "charged"

// logCharged adds what the request was charged (when a zone settled) to r's access log line, as
// chargedLogField. It is for a response a handler ended with a panic (reverse_proxy aborting a
// stream whose client left): the panic skips log_append, which adds its fields once the handlers
// after it have returned, while Caddy still writes the access log with the request's extra log
// fields.
func logCharged(r *http.Request, charged *int64) {
	if charged == nil {
		return
	}
	if extra, ok := r.Context().Value(caddyhttp.ExtraLogFieldsCtxKey).(*caddyhttp.ExtraLogFields); ok {
		extra.Add(zap.Int64(chargedLogField, *charged))
	}
}

// settleResponse settles the held zones of reqs once the response seen by cw is complete (err is
// the handlers' error), and points *charged at what the first of them was charged.
func (h *Handler) settleResponse(r *http.Request, cw *chargeWriter, reqs []limiter.Request, held *limiter.Held, err error, charged **int64) {
	cw.finish()
	status := cw.status
	// reverse_proxy answers a client that left before the response with 499 (or returns
	// before writing anything).
	cw.clientLeft = cw.served && (status == 0 || status == statusClientClosed) && r.Context().Err() != nil
	if status == 0 {
		var he caddyhttp.HandlerError
		switch {
		case errors.As(err, &he) && he.StatusCode != 0:
			status = he.StatusCode // written by the error routes, after this handler
		case err != nil:
			status = http.StatusInternalServerError
		default:
			status = http.StatusOK
		}
	}
	amounts := make([]int64, len(reqs))
	for i, rq := range reqs {
		if rq.Hold <= 0 {
			continue
		}
		if a := h.Zones[rq.Tag].after; a != nil {
			var missing, capped bool
			w := a.weightsFor(h.logger, rq.Zone.Name, replacerOf(r))
			amounts[i], missing, capped = a.amount(rq, status, cw, w)
			if missing && a.missing != nil {
				a.missing.Inc()
				a.warnMissing(h.logger, rq.Zone.Name, r, status, cw, amounts[i])
			}
			if k := slices.Index(usage.StopReasons[:], cw.undecoded); k >= 0 && a.undecoded[k] != nil {
				a.undecoded[k].Inc()
				a.warnUndecoded(h.logger, rq.Zone.Name, r, cw, amounts[i])
			}
			if capped && a.capped != nil {
				a.capped.Inc()
			}
			if *charged == nil {
				*charged = &amounts[i]
			}
		}
	}
	sampleLatency(held, cw, err)
	h.settle(r.Context(), reqs, held, amounts)
}

// settle runs the settlement, under the handler's timeout and its circuit breakers, even when
// the client has gone; it counts what was charged and given back, and the failures by reason.
func (h *Handler) settle(ctx context.Context, reqs []limiter.Request, held *limiter.Held, amounts []int64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Duration(h.Timeout))
	defer cancel()
	release, err := h.client.acquire(ctx, h.KeyPrefix, reqs)
	var settled []bool
	if err == nil {
		settled, err = h.limiter.Settle(ctx, held, amounts)
		if errors.Is(err, limiter.ErrNotHeld) {
			release(nil) // Redis answered
		} else {
			release(err)
		}
	} else {
		h.limiter.Drop(held) // not settled: its concurrency slots are given back once Redis answers
	}
	slotsDone(h, reqs)
	for i, rq := range reqs {
		if i >= len(settled) || !settled[i] {
			continue
		}
		if a := h.Zones[rq.Tag].after; a != nil && a.charged != nil {
			a.charged.Add(float64(amounts[i]))
			if res := reserved(&rq); amounts[i] < res {
				a.refunded.Add(float64(res - amounts[i]))
			}
		}
	}
	if err == nil {
		return
	}
	reason := failNoHold
	if !errors.Is(err, limiter.ErrNotHeld) {
		reason = failureReason(err)
	}
	metrics.settleFailures.WithLabelValues(string(reason)).Inc()
	if c := h.logger.Check(zapcore.WarnLevel, "rate limit settlement failed; an unsettled hold counts as charged after hold_max"); c != nil {
		c.Write(zap.String("reason", string(reason)), zap.Error(err))
	}
}

// warnMissing logs, at most once a minute per zone, that the response of r, of status, written
// through cw, reported no usage and was charged amount.
func (a *afterResponse) warnMissing(logger *zap.Logger, zone string, r *http.Request, status int, cw *chargeWriter, amount int64) {
	if !onceAMinute(&a.warned) {
		return
	}
	if c := logger.Check(zapcore.WarnLevel, "rate limit charge: a successful response reported no usage; charged the zone's missing amount (logged at most once a minute per zone)"); c != nil {
		c.Write(zap.String("zone", zone), zap.String("uri", r.RequestURI), zap.Int("status", status),
			zap.String("content_type", cw.Header().Get("Content-Type")), zap.String("content_encoding", cw.coding), zap.Int64("charged", amount))
	}
}

// warnUndecoded logs, at most once a minute per zone, that the decoding of the body of r's
// response, written through cw, stopped at one of its bounds, and that it was charged amount.
func (a *afterResponse) warnUndecoded(logger *zap.Logger, zone string, r *http.Request, cw *chargeWriter, amount int64) {
	if !onceAMinute(&a.warnedUndecoded) {
		return
	}
	if c := logger.Check(zapcore.WarnLevel, "rate limit charge: stopped decoding a compressed response at its bound; the rest went to the client undecoded (logged at most once a minute per zone)"); c != nil {
		c.Write(zap.String("zone", zone), zap.String("uri", r.RequestURI), zap.String("reason", cw.undecoded),
			zap.String("content_encoding", cw.coding), zap.Int64("charged", amount))
	}
}

// onceAMinute reports whether a minute has passed since *last (Unix ns), and if so sets it to
// now; at most one of concurrent callers gets true.
func onceAMinute(last *atomic.Int64) bool {
	now := time.Now().UnixNano()
	l := last.Load()
	return now-l >= int64(time.Minute) && last.CompareAndSwap(l, now)
}

// settleFailureReasons are the reason label's values of settle_failures_total: failureReason's,
// and no_hold.
var settleFailureReasons = append(decisionFailures[:len(decisionFailures):len(decisionFailures)], failNoHold)

// weightsFor returns the weights the zone (named zone) charges r's usage with, the request's
// replacer repl resolving their placeholders: nil without weights, and when a placeholder's
// value is unusable, which is logged (at most once a minute) and charges missing, as a usage
// that cannot be weighted does.
func (a *afterResponse) weightsFor(logger *zap.Logger, zone string, repl *caddy.Replacer) *usage.Weights {
	if a.dynWeights == nil {
		return a.weights
	}
	w, err := a.dynWeights.resolve(repl)
	if err != nil && onceAMinute(&a.warnedWeight) {
		if c := logger.Check(zapcore.WarnLevel, "rate limit charge: a weight's placeholder is unusable; the response is charged the zone's missing amount (logged at most once a minute per zone)"); c != nil {
			c.Write(zap.String("zone", zone), zap.Error(err))
		}
	}
	return w
}

// replacerOf returns r's replacer, or a new one.
func replacerOf(r *http.Request) *caddy.Replacer {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		return repl
	}
	return caddy.NewReplacer()
}
