package ratelimitredis

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// The admin API (the admin.api.rate_limit_redis module) lives in package adminapi, which serves
// the zones of the process's registry through the adminapi.Registry and adminapi.Zone
// interfaces implemented here.
func init() {
	adminapi.Serve(handlers)
}

// registry is a set of provisioned Handlers not yet cleaned up: the admin API finds the zones
// and limiters there. It is a set of handlers, not of names, because a config reload provisions
// the new handlers before it cleans up the old ones, and several handlers may have zones of
// the same name.
type registry struct {
	mu       sync.RWMutex
	handlers map[*Handler]struct{}
}

// handlers is the process's registry: every handler Caddy provisions, which the admin API
// module serves.
var handlers = newRegistry()

func newRegistry() *registry { return &registry{handlers: make(map[*Handler]struct{})} }

// add adds a provisioned handler.
func (r *registry) add(h *Handler) {
	r.mu.Lock()
	r.handlers[h] = struct{}{}
	r.mu.Unlock()
}

// remove removes a handler; one that is not there is ignored.
func (r *registry) remove(h *Handler) {
	r.mu.Lock()
	delete(r.handlers, h)
	r.mu.Unlock()
}

// Zones returns the zones named name of r's handlers (every zone when name is ""), sorted by
// name, key prefix and Redis, so replies do not depend on map order.
func (r *registry) Zones(name string) []adminapi.Zone {
	r.mu.RLock()
	defer r.mu.RUnlock()
	var zs []adminZone
	for h := range r.handlers {
		id := h.redisID()
		for _, z := range h.Zones {
			if name == "" || z.Name == name {
				zs = append(zs, adminZone{h: h, z: z, redisID: id})
			}
		}
	}
	slices.SortStableFunc(zs, func(a, b adminZone) int {
		if c := strings.Compare(a.z.Name, b.z.Name); c != 0 {
			return c
		}
		if c := strings.Compare(a.h.KeyPrefix, b.h.KeyPrefix); c != 0 {
			return c
		}
		return strings.Compare(a.redisID, b.redisID)
	})
	out := make([]adminapi.Zone, len(zs))
	for i, z := range zs {
		out[i] = z
	}
	return out
}

// adminZone is zone z of handler h, as the admin API reads it.
type adminZone struct {
	h       *Handler
	z       *Zone
	redisID string // h.redisID()
}

// Info describes the zone and its handler's Redis (the addresses with placeholders replaced).
func (t adminZone) Info() adminapi.ZoneInfo {
	zi := adminapi.ZoneInfo{
		Name: t.z.Name, Algorithm: t.z.lz.Algorithm.String(), KeyPrefix: t.h.KeyPrefix, Redis: t.h.client.addrs, DB: t.h.Redis.DB,
		Capacity: t.z.lz.Capacity, RefillRate: t.z.lz.RefillRate, Limit: t.z.lz.Limit, WindowMs: t.z.lz.Window.Milliseconds(),
		Period: t.z.Period, TimeZone: t.z.TimeZone, MaxWaitMs: limiter.CeilMs(t.z.lz.MaxWait),
		BlockMs: t.z.lz.Block.Milliseconds(), BlockMaxMs: t.z.lz.BlockMax.Milliseconds(),
		Overrides: t.z.Overrides, DryRun: t.z.DryRun,
	}
	for _, dn := range t.z.dyn {
		if zi.Placeholders == nil {
			zi.Placeholders = make(map[string]string, len(t.z.dyn))
		}
		zi.Placeholders[dn.field.String()] = dn.expr
	}
	return zi
}

// Params is the zone's limiter parameters.
func (t adminZone) Params() *limiter.Zone { return &t.z.lz }

// Limiter is the handler's limiter.
func (t adminZone) Limiter() *limiter.Limiter { return t.h.limiter }

// RedisID names the handler's Redis (Handler.redisID).
func (t adminZone) RedisID() string { return t.redisID }

// Primaries returns the handler's Redis servers to scan.
func (t adminZone) Primaries(ctx context.Context) ([]limiter.Scanner, error) {
	return t.h.client.primaries(ctx)
}

// MapKey maps a client key given to the admin API as the zone maps a request's (Zone.adminKey).
func (t adminZone) MapKey(given string) (key, warning string, err error) { return t.z.adminKey(given) }

// LimiterKey maps a client key to the limiter's key through the handler's key_secret: the key
// the limiter gets for a client key as the placeholder shows it, the same, or with key_secret
// its keyed digest (as resolve maps a request's).
func (t adminZone) LimiterKey(key string) string { return t.h.limiterKey(key) }

// ClassName names the zone's priority class of index class.
func (t adminZone) ClassName(class int) string { return t.z.className(class) }

// TimedOut reports whether err is a timeout, as backend_failures_total counts it.
func (t adminZone) TimedOut(err error) bool { return failureReason(err) == failTimeout }

// Override returns the override that a PUT /rate_limit_redis/override body asks of the zone,
// and how long it lasts (readOverrideBody, Zone.override).
func (t adminZone) Override(body []byte) (limiter.Override, time.Duration, error) {
	var b overrideBody
	if err := readOverrideBody(body, &b); err != nil {
		return limiter.Override{}, 0, err
	}
	o, err := t.z.override(&b)
	return o, b.expiresIn, err
}

// Numbers returns the parameters to read the zone's state with: its own, or for a zone whose
// numbers come from placeholders, a copy with the numbers param gives by name (else the
// fallbacks). A number missing or unusable is an error naming it.
func (t adminZone) Numbers(param func(name string) string) (*limiter.Zone, bool, error) {
	z := t.z
	if len(z.dyn) == 0 {
		return &z.lz, false, nil
	}
	var missing []string
	for _, dn := range z.dyn {
		name := dn.field.String()
		v := param(name)
		if v == "" {
			if !dn.hasFallback {
				missing = append(missing, name)
			}
			continue
		}
		if _, err := parseNumber(dn.field, v, maxInt(dn.field, z.lz.Algorithm)); err != nil {
			return nil, false, fmt.Errorf("zone %s: query parameter %s: %w", z.Name, name, err)
		}
	}
	if len(missing) > 0 {
		return nil, false, fmt.Errorf(
			"zone %s takes %s from placeholders per request, with no fallback: give the numbers as query parameters (%s=…)",
			z.Name, strings.Join(missing, " and "), missing[0])
	}
	lz, err := z.resolve(func(dn *dynNumber) string { return param(dn.field.String()) })
	if err != nil { // the numbers together: a refill time beyond 366 days
		return nil, false, err
	}
	return lz, true, nil
}

// Interface guards
var (
	_ adminapi.Registry = (*registry)(nil)
	_ adminapi.Zone     = adminZone{}
)
