package limiter

import (
	"strconv"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestHashSlotMatchesRedis: hashSlot gives the slot a Redis Cluster node computes (CLUSTER
// KEYSLOT) for keys with and without hash tags, empty tags and unbalanced braces.
func TestHashSlotMatchesRedis(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
	keys := []string{"", "a", "{", "}", "{}", "{}x", "x{}y", "{a}", "rl:{alice}:api:tb", "{a}{b}", "a{b}c{d}e", "{{a}}", "}{a}", "~x-y_z", "\x00\xff"}
	for i := 0; i < 200; i++ {
		keys = append(keys, "rl:{client-"+strconv.Itoa(i)+"}:z:sw", "k"+strconv.Itoa(i*7919))
	}
	for _, k := range keys {
		want := int(srv.Do("CLUSTER", "KEYSLOT", k).(int64))
		if got := hashSlot(k); got != want {
			t.Errorf("hashSlot(%q) = %d, Redis says %d", k, got, want)
		}
	}
}
