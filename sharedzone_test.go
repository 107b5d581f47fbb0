package ratelimitredis

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// sharedZoneSite is a site with two handlers (routes /a/ and /b/) on one Redis with a zone
// named tokens each: /a/'s takes its capacity from a placeholder, /b/'s numbers are literal.
func sharedZoneSite(redisAddr string) string {
	handler := func(path, capacity, rate string) string {
		return fmt.Sprintf(`route %s {
	rate_limit_redis {
		redis {
			address %s
		}
		zone tokens {
			key {http.request.header.Authorization}
			capacity %s
			refill_rate %s
		}
	}
	respond ok
}
`, path, redisAddr, capacity, rate)
	}
	return "map {http.request.header.X-Plan} {plan_capacity} {\n\tdefault 5000\n}\n" +
		handler("/a/*", "{plan_capacity}", "5000/24h") + handler("/b/*", "100000", "100000/24h")
}

// TestSharedZoneNameWarn: two handlers of one config with a zone of the same name, key prefix
// and Redis but different numbers: one warning at load, naming the zone and what differs.
func TestSharedZoneNameWarn(t *testing.T) {
	srv := redistest.Start(t)
	lc := startLoggedCaddy(t, sharedZoneSite(srv.Addr))
	got := withMsg(ours(lc.lines()), "two handlers of this config have a zone of the same name, key prefix and Redis with different numbers: they share each client's state in Redis; give the zones names of their own")
	if len(got) != 1 {
		t.Fatalf("%d shared-zone warnings, want 1: %v", len(got), got)
	}
	f := got[0].fields
	if f["zone"] != "tokens" || !strings.Contains(fmt.Sprint(f["differ"]), "capacity") || !strings.Contains(fmt.Sprint(f["differ"]), "placeholders") {
		t.Fatalf("warning: %s, want zone tokens and its capacity, refill_rate and placeholders named", got[0].raw)
	}
}

// TestStateSharedZoneNamePerHandler: GET /state of a zone name that two handlers have, one with
// literal numbers and one taking them from placeholders, answers for the first and reports the
// second's error in its entry, instead of a 400 for the whole call.
func TestStateSharedZoneNamePerHandler(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, sharedZoneSite(srv.Addr))
	if got := ac.Get("/b/x", "Authorization", "Bearer sk-b").Status; got != http.StatusOK {
		t.Fatalf("request to /b/: %d", got)
	}
	status, body, _ := ac.call(t, http.MethodGet, "/rate_limit_redis/state?zone=tokens&key=Bearer%20sk-b")
	if status != http.StatusOK {
		t.Fatalf("state: %d %s, want 200", status, body)
	}
	var entries []map[string]any
	if err := json.Unmarshal([]byte(body), &entries); err != nil {
		t.Fatal(err)
	}
	var read, failed int
	for _, e := range entries {
		switch {
		case e["error"] != nil:
			failed++
			if !strings.Contains(e["error"].(string), "from placeholders") {
				t.Fatalf("entry's error: %v", e["error"])
			}
		case e["limit"] == 100000.0 && e["remaining"] == 99999.0:
			read++
		default:
			t.Fatalf("unexpected entry %v in %s", e, body)
		}
	}
	if read != 1 || failed != 1 {
		t.Fatalf("state: %s, want one entry read (limit 100000, remaining 99999) and one with its error", body)
	}
}
