// Package l4 is the caddy-l4 front end of rate_limit_redis: the connection handler
// layer4.handlers.rate_limit_redis, which decides each new connection of a caddy-l4 route with
// the HTTP handler's zones, Redis keys and decision path (ratelimitredis.Handler's
// ServeConnection), and closes the connections it refuses.
//
// Build it into Caddy with caddy-l4:
//
//	xcaddy build --with github.com/mholt/caddy-l4 \
//		--with github.com/rate-limit-redis/caddy-rate-limit-redis/l4
package l4

import (
	"errors"
	"fmt"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"

	ratelimitredis "github.com/rate-limit-redis/caddy-rate-limit-redis"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler is the caddy-l4 connection handler layer4.handlers.rate_limit_redis. Its config is
// the HTTP handler's (http.handlers.rate_limit_redis), less what only an HTTP request has:
// response headers (headers, degraded_header, grpc_status, jitter, no_retry_over), the
// quota_endpoint, and the zones' match, count_status, charge, cap_output and max_cost, each
// refused at load. A connection is decided as a request of cost 1 from the connection's
// client (after caddy-l4's proxy_protocol handler, the PROXY header's); a concurrency zone's
// slot is held until the connection ends. A refused connection is closed before the next
// handler runs, and nothing is written to it.
type Handler struct {
	ratelimitredis.Handler
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "layer4.handlers.rate_limit_redis",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision refuses the options only HTTP requests have, then provisions the handler as the
// HTTP handler is provisioned (with no response headers).
func (h *Handler) Provision(ctx caddy.Context) error {
	if err := h.ConnectionOptions(); err != nil {
		return fmt.Errorf("layer4.handlers.rate_limit_redis: %w", err)
	}
	h.Headers = ratelimitredis.HeadersOff
	return h.Handler.Provision(ctx)
}

// Handle decides the connection cx and either passes it to next, which serves it, or returns
// nil without calling next, on which caddy-l4 closes the connection. A refusal is not returned
// as an error: caddy-l4 would log each one at error level, and a flood of refused connections
// would be a flood of error lines; the decision's own log line and metrics report it, as for
// requests, and a debug line here.
func (h *Handler) Handle(cx *layer4.Connection, next layer4.Handler) error {
	err := h.ServeConnection(cx.Context, cx.Replacer(), cx.RemoteAddr(), func() error { return next.Handle(cx) })
	if errors.Is(err, ratelimitredis.ErrRefused) {
		if cx.Logger != nil {
			cx.Logger.Debug("connection refused by rate_limit_redis", zap.Error(err))
		}
		return nil
	}
	return err
}

// UnmarshalCaddyfile parses the handler's block, the HTTP handler's syntax:
//
//	rate_limit_redis {
//		redis { address … }
//		zone <name> { algorithm concurrency  limit 5 }
//		…
//	}
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return h.Handler.UnmarshalCaddyfile(d)
}

// Interface guards
var (
	_ caddy.Provisioner     = (*Handler)(nil)
	_ caddy.Validator       = (*Handler)(nil)
	_ caddy.CleanerUpper    = (*Handler)(nil)
	_ caddyfile.Unmarshaler = (*Handler)(nil)
	_ layer4.NextHandler    = (*Handler)(nil)
)
