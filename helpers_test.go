package ratelimitredis

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// tunedHandler is the handler with the settings tests change that no config sets
// (Handler.breakerOpenFor, Handler.localKeys), for tests that run Caddy: the module
// http.handlers.rate_limit_redis_tuned and its directive, which exist in the test binary only.
// The directive takes the settings as arguments, then rate_limit_redis's block:
//
//	rate_limit_redis_tuned breaker_open_for=3s local_keys=64 {
//		...
//	}
type tunedHandler struct {
	Handler
	BreakerOpenFor caddy.Duration `json:"breaker_open_for,omitempty"`
	LocalKeys      int            `json:"local_keys,omitempty"`
}

func init() {
	caddy.RegisterModule(new(tunedHandler))
	httpcaddyfile.RegisterHandlerDirective("rate_limit_redis_tuned", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		th := new(tunedHandler)
		return th, th.UnmarshalCaddyfile(h.Dispenser)
	})
	httpcaddyfile.RegisterDirectiveOrder("rate_limit_redis_tuned", httpcaddyfile.Before, "basic_auth")
}

func (*tunedHandler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.rate_limit_redis_tuned", New: func() caddy.Module { return new(tunedHandler) }}
}

// Provision sets the settings, then provisions the handler.
func (th *tunedHandler) Provision(ctx caddy.Context) error {
	th.breakerOpenFor, th.localKeys = time.Duration(th.BreakerOpenFor), th.LocalKeys
	return th.Handler.Provision(ctx)
}

// UnmarshalCaddyfile reads the settings from the directive's arguments, and the rest as
// rate_limit_redis's.
func (th *tunedHandler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name
	for d.NextArg() {
		name, value, _ := strings.Cut(d.Val(), "=")
		switch name {
		case "breaker_open_for":
			dur, err := caddy.ParseDuration(value)
			if err != nil {
				return d.Errf("%s: %v", name, err)
			}
			th.BreakerOpenFor = caddy.Duration(dur)
		case "local_keys":
			n, err := strconv.Atoi(value)
			if err != nil {
				return d.Errf("%s: %v", name, err)
			}
			th.LocalKeys = n
		default:
			return d.Errf("unknown setting %q", d.Val())
		}
		d.Delete() // rate_limit_redis takes no arguments
	}
	d.Reset()
	return th.Handler.UnmarshalCaddyfile(d)
}

// liveHandler returns the one handler of the process's registry: that of the config Caddy runs.
func liveHandler(t testing.TB) *Handler {
	t.Helper()
	handlers.mu.RLock()
	defer handlers.mu.RUnlock()
	if len(handlers.handlers) != 1 {
		t.Fatalf("%d live handlers, want 1", len(handlers.handlers))
	}
	for h := range handlers.handlers {
		return h
	}
	return nil
}
