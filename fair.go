package ratelimitredis

import (
	"strings"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// Fair queuing (fair_by): a zone with a queue serves the waiters of each class in turn by
// tenant, the value of its fair_by placeholder, by start-time fair queuing in queue.lua
// (limiter.Zone.FairTenants), instead of in arrival order. The tenant, keyed with key_secret
// as a client key is, is also the request's client identity in the waiting room
// (waitingIdentity). See docs/queues.md.

// fairTenants returns the limiter's FairTenants of z: 0 without fair_by, else fair_tenants or
// its default; or the field error of a fair_by that names no placeholder, or of a fair_tenants
// without fair_by. Whether z has a queue is the limiter's check.
func (z *Zone) fairTenants() (int, error) {
	switch {
	case z.FairBy == "" && z.FairTenants != 0:
		return 0, z.fieldError("fair_tenants", "fair_tenants needs fair_by, the placeholder that names a request's tenant")
	case z.FairBy == "":
		return 0, nil
	case !strings.Contains(z.FairBy, "{"):
		return 0, z.fieldError("fair_by", "fair_by %q is a literal, so every request would be one tenant: use a placeholder, such as {http.request.header.X-Tenant}", z.FairBy)
	case z.FairTenants == 0:
		return limiter.DefaultFairTenants, nil
	}
	return z.FairTenants, nil
}

// tenant is the tenant of a request of z whose placeholders are in repl, as the limiter gets
// it (keyed with key_secret); "" when z has no fair_by.
func (h *Handler) tenant(z *Zone, repl *caddy.Replacer) string {
	if z.FairBy == "" {
		return ""
	}
	return h.limiterKey(repl.ReplaceAll(z.FairBy, ""))
}
