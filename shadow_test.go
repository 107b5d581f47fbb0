package ratelimitredis

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// shadowZones are an enforced zone of capacity enforced and a shadow zone of capacity shadow,
// one client per X-API-Key, refilling once an hour.
func shadowZones(enforced, shadow int64) []*Zone {
	return []*Zone{
		{Name: "api", Key: []string{"{http.request.header.X-API-Key}"}, Capacity: NumberOf(enforced), RefillRate: NumberOf(1.0 / 3600)},
		{Name: "trial", Key: []string{"{http.request.header.X-API-Key}"}, Capacity: NumberOf(shadow), RefillRate: NumberOf(1.0 / 3600), DryRun: true},
	}
}

// testShadowZone: across 3 instances, a shadow zone never refuses and never stops the enforced
// zone (which admits exactly its capacity while the shadow zone would deny), is counted as
// dry_run_denied and named in shadow_denied, and is charged only by requests that every zone
// admitted.
func testShadowZone(t *testing.T, addrs []string, cluster bool) {
	var shadowDenied []string
	ok := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		v, _ := repl.GetString("http.rate_limit_redis.shadow_denied")
		shadowDenied = append(shadowDenied, v)
		_, err := io.WriteString(w, "ok")
		return err
	})
	var urls []string
	var hs []*Handler
	for range 3 {
		h, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: addrs, Cluster: cluster}, Headers: HeadersBoth, Zones: shadowZones(4, 1)}, ok)
		urls, hs = append(urls, s.URL), append(hs, h)
	}
	denied0 := testutil.ToFloat64(metrics.decisions.WithLabelValues("trial", "dry_run_denied"))
	for i, want := range []int{200, 200, 200, 200, 429, 429} {
		req, _ := http.NewRequest(http.MethodGet, urls[i%3], nil)
		req.Header.Set("X-API-Key", "carol")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Fatalf("request %d: %d, want %d (the shadow zone of capacity 1 must not stop the enforced zone of 4)", i+1, resp.StatusCode, want)
		}
		if want == 200 && (resp.Header.Get("X-RateLimit-Limit") != "4" || resp.Header.Get("RateLimit-Policy") != `"api";q=4;w=14400`) {
			t.Fatalf("request %d: X-RateLimit-Limit %q, RateLimit-Policy %q: want the enforced zone's only", i+1,
				resp.Header.Get("X-RateLimit-Limit"), resp.Header.Get("RateLimit-Policy"))
		}
	}
	if got := []string{shadowDenied[0], shadowDenied[1], shadowDenied[3]}; got[0] != "" || got[1] != "trial" || got[2] != "trial" {
		t.Fatalf("shadow_denied of the admitted requests: %q, want \"\" then trial", shadowDenied)
	}
	// 3 admitted requests and 2 refused ones would have been denied by the shadow zone.
	if d := testutil.ToFloat64(metrics.decisions.WithLabelValues("trial", "dry_run_denied")) - denied0; d != 5 {
		t.Fatalf("trial dry_run_denied: %v more, want 5", d)
	}
	// The shadow zone was charged by the first request only: the others it would have denied.
	st, err := hs[0].limiter.State(t.Context(), &hs[0].Zones[1].lz, "carol")
	if err != nil {
		t.Fatal(err)
	}
	if st.Remaining != 0 || st.Tokens < -1e-6 || st.Tokens > 0.01 {
		t.Fatalf("shadow zone state: %+v, want charged once (0 tokens left)", st)
	}
}

func TestShadowZone(t *testing.T) {
	srv := redistest.Start(t)
	testShadowZone(t, []string{srv.Addr}, false)
}

func TestShadowZoneOnCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	testShadowZone(t, c.Addrs(), true)
}

// TestShadowZoneNotChargedByRefusal: a request the enforced zone refuses charges no zone, the
// shadow zone included (all-or-nothing, as enforcement would charge it).
func TestShadowZoneNotChargedByRefusal(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Zones: shadowZones(1, 10)})
	for i, want := range []int{200, 429, 429, 429} {
		req, _ := http.NewRequest(http.MethodGet, "/", nil)
		req.Header.Set("X-API-Key", "dave")
		w, err, _ := serve(h, req)
		code := w.Code
		if he, ok := err.(caddyhttp.HandlerError); ok {
			code = he.StatusCode
		}
		if code != want {
			t.Fatalf("request %d: %d %v, want %d", i+1, code, err, want)
		}
	}
	st, err := h.limiter.State(t.Context(), &h.Zones[1].lz, "dave")
	if err != nil {
		t.Fatal(err)
	}
	if st.Remaining != 9 {
		t.Fatalf("shadow zone remaining after 1 admitted and 3 refused requests: %d, want 9", st.Remaining)
	}
}

// TestCaddyfileOverridesAndDryRun: overrides and dry_run in a zone block, and what each
// excludes, reported at the subdirective.
func TestCaddyfileOverridesAndDryRun(t *testing.T) {
	var h Handler
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(`rate_limit_redis {
		zone api {
			key {http.request.header.X-API-Key}
			capacity 100
			refill_rate 10
			overrides
		}
		zone trial {
			capacity 10
			refill_rate 1
			dry_run
		}
	}`)); err != nil {
		t.Fatal(err)
	}
	if !h.Zones[0].Overrides || h.Zones[0].DryRun || !h.Zones[1].DryRun || h.Zones[1].Overrides || h.DryRun {
		t.Fatalf("zones %+v %+v, handler dry_run %v", h.Zones[0], h.Zones[1], h.DryRun)
	}
	for _, c := range []struct{ block, want string }{
		{"capacity 1\n refill_rate 1\n max_wait 1s\n dry_run", "zone z: dry_run excludes max_wait: a shadow zone must never change the response, and holding a request would, at Testfile:6"},
		{"capacity 4\n refill_rate 1\n lease {\n max 2\n ttl 1s\n }\n dry_run", "dry_run excludes lease"},
		{"capacity 4\n refill_rate 1\n lease {\n max 2\n ttl 1s\n }\n overrides", "overrides excludes lease"},
		{"capacity 4\n refill_rate 1\n empty_key deny\n dry_run", "dry_run excludes empty_key deny"},
		{"capacity 4\n refill_rate 1\n overrides on", `overrides: unexpected argument "on"`},
	} {
		var h Handler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("rate_limit_redis {\n zone z {\n " + c.block + "\n }\n}"))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want %q", c.block, err, c.want)
		}
	}
}

// TestShadowZoneLeftOutLoggedOnceAMinute: a shadow zone whose number cannot be resolved is left
// out of every request, and that is logged once a minute per zone, not once per request.
func TestShadowZoneLeftOutLoggedOnceAMinute(t *testing.T) {
	srv := redistest.Start(t)
	key := []string{"{http.request.header.X-API-Key}"}
	h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Zones: []*Zone{
		{Name: "api", Key: key, Capacity: NumberOf(100), RefillRate: NumberOf(1)},
		{Name: "trial", Key: key, Capacity: NumberText("{http.request.header.X-Trial-Capacity}"), RefillRate: NumberOf(1), DryRun: true},
	}})
	core, logs := observer.New(zapcore.ErrorLevel)
	h.logger = zap.New(core)
	send := func(n int) {
		t.Helper()
		for range n {
			r := httptest.NewRequest(http.MethodGet, "/", nil)
			r.Header.Set("X-API-Key", "alice")
			if w, err, next := serve(h, r); err != nil || !next || w.Code != http.StatusOK {
				t.Fatalf("request: %d %v, next called %v: want the next handler", w.Code, err, next)
			}
		}
	}
	send(20)
	if n := logs.FilterMessageSnippet("shadow zone left out").Len(); n != 1 {
		t.Fatalf("%d log lines for 20 requests, want 1", n)
	}
	h.Zones[1].shadowLogged.Add(-int64(time.Minute)) // as if a minute had passed
	send(5)
	if n := logs.FilterMessageSnippet("shadow zone left out").Len(); n != 2 {
		t.Fatalf("%d log lines a minute later, want 2", n)
	}
}
