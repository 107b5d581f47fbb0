package ratelimitredis

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
)

// warnSharedZones logs a warning for each zone of h that has the name, key prefix and Redis of
// a zone of another handler of the same config (another site, or another route) but other
// numbers or another algorithm: the two share one client's state in Redis, read and spent
// under two sets of numbers. Handlers of one config are those whose Caddy context ends with
// the same done channel (done); a reload's new handlers are not compared with the old ones.
func (r *registry) warnSharedZones(h *Handler, done <-chan struct{}) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	warned := make(map[string]bool)
	for o := range r.handlers {
		if done == nil || o == h || o.configDone != done || o.KeyPrefix != h.KeyPrefix || o.redisID() != h.redisID() {
			continue
		}
		for _, z := range h.Zones {
			for _, oz := range o.Zones {
				if oz.Name != z.Name || warned[z.Name] {
					continue
				}
				diff := zoneDifferences(adminZone{h: h, z: z}.Info(), adminZone{h: o, z: oz}.Info())
				if len(diff) == 0 {
					continue
				}
				warned[z.Name] = true
				if c := h.logger.Check(zapcore.WarnLevel, "two handlers of this config have a zone of the same name, key prefix and Redis with different numbers: they share each client's state in Redis; give the zones names of their own"); c != nil {
					c.Write(zap.String("zone", z.Name), zap.String("key_prefix", h.KeyPrefix), zap.Strings("differ", diff))
				}
			}
		}
	}
}

// redisID names h's Redis: its addresses, Sentinel and database.
func (h *Handler) redisID() string {
	return fmt.Sprintf("%q|%q|%d", h.client.addrs, h.Redis.Sentinel, h.Redis.DB)
}

// zoneDifferences names the algorithm and numbers in which zi and o differ, each as
// "name: this vs other".
func zoneDifferences(zi, o adminapi.ZoneInfo) []string {
	var out []string
	add := func(name string, a, b any) {
		if a != b {
			out = append(out, fmt.Sprintf("%s: %v vs %v", name, a, b))
		}
	}
	add("algorithm", zi.Algorithm, o.Algorithm)
	add("capacity", zi.Capacity, o.Capacity)
	add("refill_rate", zi.RefillRate, o.RefillRate)
	add("limit", zi.Limit, o.Limit)
	add("window_ms", zi.WindowMs, o.WindowMs)
	add("period", zi.Period, o.Period)
	add("time_zone", zi.TimeZone, o.TimeZone)
	add("max_wait_ms", zi.MaxWaitMs, o.MaxWaitMs)
	add("block_ms", zi.BlockMs, o.BlockMs)
	add("block_max_ms", zi.BlockMaxMs, o.BlockMaxMs)
	if !maps.Equal(zi.Placeholders, o.Placeholders) {
		out = append(out, fmt.Sprintf("placeholders: %s vs %s", placeholderList(zi.Placeholders), placeholderList(o.Placeholders)))
	}
	return out
}

// placeholderList is m as "name=expr" pairs sorted by name, or "none".
func placeholderList(m map[string]string) string {
	if len(m) == 0 {
		return "none"
	}
	var pairs []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		pairs = append(pairs, k+"="+m[k])
	}
	return strings.Join(pairs, " ")
}
