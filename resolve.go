package ratelimitredis

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/clientip"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/usage"
)

// resolveError is why a request could not be resolved into limiter requests: it is answered
// before any decision, and nothing is charged or counted in decisions_total.
type resolveError struct {
	zone *Zone
	// kind says which answer it gets (see unresolved).
	kind resolveKind
	err  error
}

func (e *resolveError) Error() string { return e.err.Error() }
func (e *resolveError) Unwrap() error { return e.err }

type resolveKind uint8

const (
	resolveMatcher  resolveKind = iota // a zone's matcher failed: 500
	resolveNumbers                     // a number from a placeholder is unusable: 500
	resolveCost                        // the cost placeholder is not a positive integer: 400
	resolveEmptyKey                    // every key candidate is empty and empty_key is deny: 403
	resolveBody                        // the body cannot be bounded or its model is ambiguous: its usage.Refusal
)

// resolve appends to reqs, for every zone of zones (zones of h) that applies to r in order, the
// limiter request (the zone's numbers, client key and cost, tagged with the zone's index in
// h.Zones), and to shown its client key as placeholders show it; shaping is true when one of
// them may be held (max_wait). A zone whose key is empty and whose empty_key is skip is left out.
// The body of r is read first (once) for a zone that uses the request's model (model.go). The
// error is a *resolveError.
func (h *Handler) resolve(r *http.Request, repl *caddy.Replacer, zones []*Zone, reqs []limiter.Request, shown []string) (_ []limiter.Request, _ []string, shaping bool, _ error) {
	var lastShown, lastKey string // the previous zone's, when keyed is true
	keyed, model := false, false  // model: the model placeholder is published
	var masked clientip.Memo      // the previous IP candidate masked: zones usually share their key
	for _, z := range zones {
		if ok, err := h.applies(r, repl, z, &model); !ok {
			if err != nil {
				return nil, nil, false, err
			}
			continue
		}
		key := z.clientKey(r, repl, &masked)
		if key == "" {
			z.emptyKeys.Inc()
			switch z.EmptyKey {
			case EmptyKeySkip:
				continue
			case EmptyKeyDeny:
				return nil, nil, false, &resolveError{z, resolveEmptyKey, errors.New("empty client key")}
			}
			h.warnEmptyKey(z)
		}
		lz, err := z.numbers(repl)
		if err != nil {
			if h.shadowUnresolved(z, err) {
				continue
			}
			return nil, nil, false, &resolveError{z, resolveNumbers, err}
		}
		cost, err := z.cost(repl)
		if err != nil {
			err = fmt.Errorf("zone %s: %w", z.Name, err)
			if h.shadowUnresolved(z, err) {
				continue
			}
			return nil, nil, false, &resolveError{z, resolveCost, err}
		}
		shown = append(shown, key)
		if h.keySecret != nil {
			if !keyed || key != lastShown {
				lastShown, lastKey, keyed = key, h.keySecret.Key(key), true
			}
			key = lastKey
		}
		rq, err := z.request(r, repl, lz, key, cost)
		if err != nil {
			return nil, nil, false, &resolveError{z, resolveBody, fmt.Errorf("zone %s: %w", z.Name, err)}
		}
		rq.Tenant = h.tenant(z, repl)
		reqs = append(reqs, rq)
		shaping = shaping || lz.MaxWait > 0
	}
	return reqs, shown, shaping, nil
}

// applies reports whether zone z applies to r: its matchers match, and the model it uses, if
// any, is read (*model: the model placeholder is published). A shadow zone whose matching or
// model fails is left out; another zone's failure is the *resolveError.
func (h *Handler) applies(r *http.Request, repl *caddy.Replacer, z *Zone, model *bool) (bool, error) {
	if len(z.matcherSets) > 0 {
		match, err := z.matches(r, repl, model)
		if err != nil {
			err = fmt.Errorf("zone %s: matching: %w", z.Name, err)
			if h.shadowUnresolved(z, err) {
				return false, nil
			}
			return false, &resolveError{z, matcherKind(err), err}
		}
		if !match {
			return false, nil
		}
	}
	if err := readModel(r, repl, z.usesModel, model); err != nil {
		err = fmt.Errorf("zone %s: %w", z.Name, err)
		if h.shadowUnresolved(z, err) {
			return false, nil
		}
		return false, &resolveError{z, resolveBody, err}
	}
	return true, nil
}

// matcherKind is the resolveKind of a matcher's error err: resolveBody when a model matcher
// refused the body (usage.Refusal), else resolveMatcher.
func matcherKind(err error) resolveKind {
	if errors.As(err, new(usage.Refusal)) {
		return resolveBody
	}
	return resolveMatcher
}

// request is the zone's limiter request for r, tagged with the zone's index (tag): its hold
// when it settles after the response (charge.go), and with cap_output its cost and bound
// (outputcap.go), or the usage.Refusal of a body cap_output cannot bound.
func (z *Zone) request(r *http.Request, repl *caddy.Replacer, lz *limiter.Zone, key string, cost int64) (limiter.Request, error) {
	rq := limiter.Request{Zone: lz, Key: key, Cost: cost, Tag: z.tag}
	if z.Priority != nil {
		rq.Class = z.classOf(repl)
	}
	if z.after != nil {
		rq.Hold = z.after.hold
	}
	if z.capOut != nil {
		if err := z.capOut.reserve(r, repl, &rq); err != nil {
			return rq, err
		}
	}
	return rq, nil
}

// unresolved answers a request that resolve refused with err (a *resolveError). Each refusal is
// Cache-Control: no-store, and a gRPC call gets the gRPC status of its HTTP status (refuse).
//   - A matcher's failure is a 500 (INTERNAL); logged here at error level.
//   - A number from a placeholder that is empty without a fallback, does not parse or is out of
//     range: the server's configuration (or what feeds the placeholder) is wrong, not the
//     client. 500 (INTERNAL); logged here at error level, as Caddy logs a handler's error at
//     debug level only when the server has handle_errors routes (and never a gRPC call's, which
//     is answered here). dry_run passes the request on.
//   - A bad cost is a 400 (INVALID_ARGUMENT); dry_run passes the request on.
//   - An empty key in an empty_key deny zone: denyEmptyKey.
//   - A body cap_output cannot bound, or whose model a zone uses and upstreams read apart: the
//     status of its usage.Refusal (400, 413, 415; INVALID_ARGUMENT), its reason in the
//     answer; dry_run passes the request on.
//
// A gRPC call's grpc-message names the zone and, for a 500, not the configuration's details,
// which stay in the log as a 500's do.
func (h *Handler) unresolved(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, repl *caddy.Replacer, err error) error {
	var re *resolveError
	if !errors.As(err, &re) {
		return h.refuse(w, r, http.StatusInternalServerError, err, grpcInternal, "rate limit configuration error")
	}
	internal := "zone " + re.zone.Name + ": rate limit configuration error"
	switch re.kind {
	case resolveEmptyKey:
		return h.denyEmptyKey(w, r, next, re.zone, repl)
	case resolveNumbers:
		if c := h.logger.Check(zapcore.ErrorLevel, "a zone number from a placeholder is unusable"); c != nil {
			c.Write(zap.String("zone", re.zone.Name), zap.Bool("dry_run", h.DryRun), zap.Error(re.err))
		}
		if h.DryRun {
			return next.ServeHTTP(w, r)
		}
		return h.refuse(w, r, http.StatusInternalServerError, re.err, grpcInternal, internal)
	case resolveCost, resolveBody:
		if h.DryRun {
			if c := h.logger.Check(zapcore.DebugLevel, "bad request; dry_run lets it through"); c != nil {
				c.Write(zap.Error(re.err))
			}
			return next.ServeHTTP(w, r)
		}
		if re.kind == resolveBody {
			return h.refuseBody(w, r, re.err)
		}
		return h.refuse(w, r, http.StatusBadRequest, re.err, grpcInvalidArgument, re.err.Error())
	}
	if c := h.logger.Check(zapcore.ErrorLevel, "a zone's matcher failed"); c != nil {
		c.Write(zap.String("zone", re.zone.Name), zap.Error(re.err))
	}
	return h.refuse(w, r, http.StatusInternalServerError, re.err, grpcInternal, internal)
}

// refuseBody answers a request whose body err (wrapping a usage.Refusal) refuses: its status,
// Cache-Control: no-store; a gRPC call gets INVALID_ARGUMENT. When the server has no
// handle_errors routes, the body is the reason as the LLM APIs write an error
// ({"error":{"message":...,"type":"invalid_request_error"}}), which the SDKs show; else the
// error goes to handle_errors ({http.error.message}).
func (h *Handler) refuseBody(w http.ResponseWriter, r *http.Request, err error) error {
	var rf usage.Refusal
	status := http.StatusBadRequest
	if errors.As(err, &rf) {
		status = rf.Status
	}
	if !h.bareDenials || h.grpcCall(r) {
		return h.refuse(w, r, status, err, grpcInvalidArgument, err.Error())
	}
	noStore(w)
	body, _ := json.Marshal(map[string]any{"error": map[string]string{"message": err.Error(), "type": "invalid_request_error"}})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
	return nil
}

// denyEmptyKey rejects a request whose key placeholders are all empty in zone z, whose
// empty_key is deny: 403 with no body, Cache-Control: no-store (a gRPC call: PERMISSION_DENIED;
// in dry_run: passed on), before any decision, so no zone is charged or counted in
// decisions_total ({http.rate_limit_redis.allowed} is false).
func (h *Handler) denyEmptyKey(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, z *Zone, repl *caddy.Replacer) error {
	new(outcome).publish(repl)
	if c := h.logger.Check(zapcore.DebugLevel, "empty client key denied"); c != nil {
		c.Write(zap.String("zone", z.Name), zap.Bool("dry_run", h.DryRun))
	}
	if h.DryRun {
		return next.ServeHTTP(w, r)
	}
	noStore(w)
	if h.grpcCall(r) {
		writeGRPCRefusal(w, grpcPermissionDenied, z.errEmptyKey.Error(), "")
		return nil
	}
	if h.bareDenials {
		w.WriteHeader(http.StatusForbidden)
		return nil
	}
	return caddyhttp.HandlerError{StatusCode: http.StatusForbidden, Err: z.errEmptyKey}
}

// clientKey resolves the zone's key placeholders for r: the first that is not empty wins, and
// the client key says which it was (limiter.CandidateKey: the first candidate's value as it is,
// the n-th's as "<n>=value"), so that no value of one candidate can name another's state. A value
// that is an IP address is first masked to the zone's prefix length (clientip.Mask); memo holds the
// last one masked. All empty gives "": the zone's empty_key decides (shared: the limiter counts
// it under the zone's one shared key).
func (z *Zone) clientKey(r *http.Request, repl *caddy.Replacer, memo *clientip.Memo) string {
	for i, k := range z.Key {
		var v string
		if i < len(z.keySources) {
			v = z.keySources[i].value(r, repl, k)
		} else {
			v = repl.ReplaceAll(k, "")
		}
		if v != "" {
			return limiter.CandidateKey(i+1, memo.Mask(v, z.v4, z.v6))
		}
	}
	return ""
}

// keySource is how one entry of a zone's key is read, compiled once (compileKey).
type keySource struct {
	// name is the placeholder's name when the entry is exactly one placeholder, else "" (the
	// entry goes through Caddy's ReplaceAll).
	name string
	// header is, for {http.request.header.<field>}, the field's canonical name; vars, for
	// {http.vars.<name>} (such as the default key, {http.vars.client_ip}), the variable's
	// name. Either is read from the request directly, as Caddy's HTTP placeholders read it, but
	// without their provider's chain of prefix tests and its boxing of the value in an interface
	// (one allocation per request).
	header, vars string
}

// compileKey returns how key entry k is read.
func compileKey(k string) keySource {
	src := keySource{name: singlePlaceholder(k)}
	if field, ok := strings.CutPrefix(src.name, "http.request.header."); ok && field != "" {
		src.header = textproto.CanonicalMIMEHeaderKey(field)
	} else if name, ok := strings.CutPrefix(src.name, "http.vars."); ok && name != "" {
		src.vars = name
	}
	return src
}

// value is the entry k's value for r: what Caddy's placeholder gives. {http.request.header.*}
// is the field's values joined by commas, {http.vars.*} the variable as a string, empty when
// absent; both as Caddy's HTTP placeholder provider computes them, from the request as it
// reaches this handler (whose header map and variables are the ones Caddy's provider reads:
// handlers change them in place). One difference: a placeholder of these names that a handler
// before this one set as a static value (Replacer.Set) is not seen; no Caddy handler does.
func (s keySource) value(r *http.Request, repl *caddy.Replacer, k string) string {
	switch {
	case s.header != "":
		vals := r.Header[s.header]
		if len(vals) == 1 {
			return vals[0]
		}
		return strings.Join(vals, ",")
	case s.vars != "":
		return caddy.ToString(caddyhttp.GetVar(r.Context(), s.vars))
	case s.name != "":
		v, _ := repl.GetString(s.name)
		return v
	}
	return repl.ReplaceAll(k, "")
}

// cost resolves the request's cost: the literal, or the placeholder's value; empty counts as 1.
// Anything but a positive integer is errCost.
func (z *Zone) cost(repl *caddy.Replacer) (int64, error) {
	if z.fixedCost > 0 {
		return z.fixedCost, nil
	}
	v := repl.ReplaceAll(z.Cost, "")
	if v == "" {
		return 1, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 1 {
		return 0, errCost
	}
	return n, nil
}

// warnEmptyKey logs, at most once a minute per zone, that charging zone z decides a request
// under its one shared empty key (empty_key shared): every client whose key placeholders are
// all empty then spends one budget, which one of them can use up for all. Zones without charge
// are left to empty_key_total.
func (h *Handler) warnEmptyKey(z *Zone) {
	if z.Charge == nil || !onceAMinute(z.emptyKeyLogged) {
		return
	}
	if c := h.logger.Check(zapcore.WarnLevel, "rate limit charging zone decided with an empty key: every such client shares one budget; key on every field your clients send the key in, or set empty_key deny (logged at most once a minute per zone)"); c != nil {
		c.Write(zap.String("zone", z.Name), zap.Strings("key", z.Key))
	}
}

// limiterKey returns the key the limiter gets for a client key (or tenant) as the placeholder
// shows it: the same, or with key_secret its keyed digest.
func (h *Handler) limiterKey(shown string) string {
	if h.keySecret == nil {
		return shown
	}
	return h.keySecret.Key(shown)
}
