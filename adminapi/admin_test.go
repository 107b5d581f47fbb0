package adminapi

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// noZones is a registry with no handler loaded: every request about a zone finds none.
type noZones struct{}

func (noZones) Zones(string) []Zone { return nil }

// TestModuleRegistered: the module is Caddy's admin.api.rate_limit_redis, and a module Caddy
// makes serves the registry given to Serve.
func TestModuleRegistered(t *testing.T) {
	old := served
	t.Cleanup(func() { served = old })
	Serve(noZones{})
	mi, err := caddy.GetModule("admin.api.rate_limit_redis")
	if err != nil {
		t.Fatal(err)
	}
	a, ok := mi.New().(*AdminAPI)
	if !ok {
		t.Fatalf("the module is a %T, want *AdminAPI", mi.New())
	}
	if a.registry() != Registry(noZones{}) {
		t.Fatal("a module Caddy makes does not serve the registry given to Serve")
	}
}

// TestRequestsCheckedBeforeZones: each endpoint checks its method and parameters before it
// looks a zone up, with the status, message and Allow header of Caddy's admin API errors; a
// zone that no handler has is a 404 for the endpoints about one client, a 400 for the
// listings and top.
func TestRequestsCheckedBeforeZones(t *testing.T) {
	t.Parallel()
	a := New(noZones{})
	for _, tc := range []struct {
		method, path string
		status       int
		msg, allow   string
	}{
		{"GET", "/rate_limit_redis/zones", http.StatusOK, "[]\n", ""},
		{"DELETE", "/rate_limit_redis/zones", 405, "method DELETE not allowed: use GET", "GET"},
		{"POST", "/rate_limit_redis/state?zone=api&key=a", 405, "method POST not allowed: use GET or DELETE", "GET, DELETE"},
		{"GET", "/rate_limit_redis/state?zone=api", 400, "query parameters zone and key are required", ""},
		{"GET", "/rate_limit_redis/state?zone=api&key=a", 404, `no rate_limit_redis zone named "api" is loaded`, ""},
		{"GET", "/rate_limit_redis/state?zone=api&key=0%3Da", 400,
			"key: candidates are counted from 1 (0= is no client key's): give the key as {http.rate_limit_redis.key} shows it", ""},
		{"PUT", "/rate_limit_redis/block?zone=api&key=a", 400, "query parameters zone, key and for are required", ""},
		{"PUT", "/rate_limit_redis/block?zone=api&key=a&for=10ms", 400, `for: "10ms" must be a duration between 1s and 366d`, ""},
		{"POST", "/rate_limit_redis/override?zone=api&key=a", 405, "method POST not allowed: use GET, PUT or DELETE", "GET, PUT, DELETE"},
		{"GET", "/rate_limit_redis/blocks", 400, "query parameter zone is required", ""},
		{"GET", "/rate_limit_redis/overrides?zone=api", 400, `no rate_limit_redis zone named "api" is loaded`, ""},
		{"PUT", "/rate_limit_redis/top?zone=api", 405, "method PUT not allowed: use GET", "GET"},
		{"GET", "/rate_limit_redis/top?zone=api", 400, `no rate_limit_redis zone named "api" is loaded`, ""},
	} {
		status, msg, allow := serve(t, a, tc.method, tc.path)
		if status != tc.status || msg != tc.msg || allow != tc.allow {
			t.Errorf("%s %s: %d %q (Allow %q), want %d %q (Allow %q)", tc.method, tc.path, status, msg, allow, tc.status, tc.msg, tc.allow)
		}
	}
}

// serve calls a's route for path (with its query) and returns the status, the body or the
// error's message, and the Allow header.
func serve(t *testing.T, a *AdminAPI, method, path string) (status int, msg, allow string) {
	t.Helper()
	r := httptest.NewRequest(method, path, nil)
	for _, route := range a.Routes() {
		if route.Pattern != r.URL.Path {
			continue
		}
		w := httptest.NewRecorder()
		err := route.Handler.ServeHTTP(w, r)
		var ae caddy.APIError
		switch {
		case errors.As(err, &ae):
			return ae.HTTPStatus, ae.Err.Error(), w.Header().Get("Allow")
		case err != nil:
			t.Fatalf("%s %s: %v, not an admin API error", method, path, err)
		}
		return http.StatusOK, w.Body.String(), w.Header().Get("Allow")
	}
	t.Fatalf("no admin route serves %s", r.URL.Path)
	return 0, "", ""
}

// TestNoRegistry: a module with no registry given (a binary with this package and not the
// handler's) answers as for a config without rate_limit_redis handlers, and does not panic.
func TestNoRegistry(t *testing.T) {
	old := served
	t.Cleanup(func() { served = old })
	served = nil
	a := new(AdminAPI)
	if status, msg, _ := serve(t, a, "GET", "/rate_limit_redis/zones"); status != http.StatusOK || msg != "[]\n" {
		t.Fatalf("GET /rate_limit_redis/zones: %d %q, want 200 []", status, msg)
	}
	if status, msg, _ := serve(t, a, "GET", "/rate_limit_redis/state?zone=api&key=a"); status != 404 {
		t.Fatalf("GET /rate_limit_redis/state: %d %q, want 404", status, msg)
	}
}
