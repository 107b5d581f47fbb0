package ratelimitredis

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// provisioned returns h provisioned and validated as Caddy would, cleaned up when the test ends.
// Unless h has one, it is given a registry of its own, which AdminAPI{live: h.live} serves.
func provisioned(t testing.TB, h *Handler) *Handler {
	t.Helper()
	if h.live == nil {
		h.live = newRegistry()
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Cleanup() })
	if err := h.Validate(); err != nil {
		t.Fatal(err)
	}
	return h
}

func serve(h *Handler, r *http.Request) (*httptest.ResponseRecorder, error, bool) {
	repl := caddy.NewReplacer()
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
	w := httptest.NewRecorder()
	nextCalled := false
	err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		nextCalled = true
		return nil
	}))
	return w, err, nextCalled
}

// TestClientGoneIsNotARedisFailure: a request whose client disconnected before the decision ends
// with 499, and neither applies fail_mode nor counts as a failure in the circuit breaker.
func TestClientGoneIsNotARedisFailure(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{
		Redis:    &RedisConfig{Addresses: []string{srv.Addr}},
		FailMode: FailOpen,
		Zones:    []*Zone{{Name: "z", Capacity: NumberOf(5), RefillRate: NumberOf(1)}},
	})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r := httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx)
	_, err, nextCalled := serve(h, r)
	var he caddyhttp.HandlerError
	if !errors.As(err, &he) || he.StatusCode != 499 || nextCalled {
		t.Fatalf("got err %v (next called: %t), want a 499 HandlerError and no fail-open", err, nextCalled)
	}
	if c := h.client.breaker.Counts(); c.TotalFailures != 0 {
		t.Fatalf("a client that went away counted as a Redis failure: %+v", c)
	}
	// The same handler with a live request decides normally.
	w, err, nextCalled := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
	if err != nil || !nextCalled || w.Header().Get("X-RateLimit-Remaining") != "4" {
		t.Fatalf("live request: err %v, next %t, remaining %q; want allowed with 4 left", err, nextCalled, w.Header().Get("X-RateLimit-Remaining"))
	}
}
