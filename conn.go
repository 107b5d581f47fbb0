package ratelimitredis

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// A connection front end (the caddy-l4 handler, package l4) decides each connection as this
// handler decides a request, through the same stages and with the same zones, Redis keys,
// metrics, events and logs: a connection is a request with no header, no body and no matcher,
// from its client's address. A zone of the same name, numbers and key in an L4 route and in an
// HTTP route is so one limit.

// ErrRefused is returned by ServeConnection for a connection the zones refused (a zone over its
// limit, a client in the penalty box, an empty key with empty_key deny) or that fail_mode
// closed refused while Redis failed. The front end closes the connection, writing nothing.
var ErrRefused = errors.New("rate_limit_redis: connection refused by the rate limit")

// ServeConnection decides one connection from the client at remote (its address as the front
// end sees it: after a PROXY protocol header, the header's client) against the handler's zones,
// with repl (the connection's replacer: the zones' key placeholders are read from it, and the
// decision's {http.rate_limit_redis.*} placeholders set in it) and ctx (the connection's; a
// zone's queue stops waiting when it ends). The default key, {http.vars.client_ip}, is remote's
// IP address. When the connection is admitted, ServeConnection calls next, which serves the
// whole connection, and returns next's error; a concurrency zone's slot is held until next
// returns. Otherwise it returns an error wrapping ErrRefused, and next is not called.
//
// The handler must have been checked with ConnectionOptions at load.
func (h *Handler) ServeConnection(ctx context.Context, repl *caddy.Replacer, remote net.Addr, next func() error) error {
	ip := remote.String()
	if host, _, err := net.SplitHostPort(ip); err == nil {
		ip = host
	}
	vars := map[string]any{caddyhttp.ClientIPVarKey: ip}
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, vars)
	ctx = context.WithValue(ctx, caddy.ReplacerCtxKey, repl)
	r := (&http.Request{
		Method:     http.MethodConnect,
		URL:        &url.URL{},
		Proto:      "HTTP/1.1",
		ProtoMajor: 1,
		ProtoMinor: 1,
		Header:     http.Header{},
		Body:       http.NoBody,
		RemoteAddr: remote.String(),
	}).WithContext(ctx)
	admitted := false
	err := h.ServeHTTP(new(discardWriter), r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		admitted = true
		return next()
	}))
	if admitted {
		return err
	}
	var he caddyhttp.HandlerError
	if errors.As(err, &he) {
		return fmt.Errorf("%w (%d)", ErrRefused, he.StatusCode)
	}
	if err == nil {
		return ErrRefused
	}
	return fmt.Errorf("%w: %w", ErrRefused, err)
}

// ConnectionOptions returns an error naming every option of h that only means something for an
// HTTP request (its headers, body, response or status, and {http.request.*} placeholders in a
// zone's key, cost or fair_by), so that a connection front end refuses it at load; nil when there is
// none.
func (h *Handler) ConnectionOptions() error {
	var bad []string
	add := func(set bool, name string) {
		if set {
			bad = append(bad, name)
		}
	}
	add(h.Headers != "", "headers")
	add(h.DegradedHeader != nil, "degraded_header")
	add(h.GRPCStatus != nil, "grpc_status")
	add(h.Jitter != 0, "jitter")
	add(h.NoRetryOver != nil, "no_retry_over")
	add(h.QuotaEndpoint != nil, "quota_endpoint")
	for _, z := range h.Zones {
		in := func(name string) string { return "zone " + z.Name + ": " + name }
		add(len(z.MatcherSetsRaw) > 0, in("match"))
		add(len(z.CountStatus) > 0, in("count_status"))
		add(z.Charge != nil, in("charge"))
		add(z.CapOutput != nil, in("cap_output"))
		add(!z.MaxCost.IsZero(), in("max_cost"))
		add(z.Jitter != nil, in("jitter"))
		add(z.NoRetryOver != nil, in("no_retry_over"))
		add(z.Algorithm == "adaptive_concurrency", in("algorithm adaptive_concurrency (it learns from the latency of responses)"))
		for _, k := range z.Key {
			add(strings.Contains(k, "{http.request."), in("key "+k))
		}
		add(strings.Contains(z.Cost, "{http.request."), in("cost "+z.Cost))
		add(strings.Contains(z.FairBy, "{http.request."), in("fair_by "+z.FairBy))
	}
	if len(bad) == 0 {
		return nil
	}
	return fmt.Errorf("%s: only HTTP requests have these (headers, bodies, responses or statuses); a connection has none", strings.Join(bad, ", "))
}

// discardWriter is the response writer of a connection's request: nothing is written to a
// connection (a refused one is closed), so what the stages write is dropped; the header map
// keeps what they set, for the stages that read it back.
type discardWriter struct{ header http.Header }

func (w *discardWriter) Header() http.Header {
	if w.header == nil {
		w.header = http.Header{}
	}
	return w.header
}
func (*discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (*discardWriter) WriteHeader(int)             {}
