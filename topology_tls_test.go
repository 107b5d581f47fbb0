package ratelimitredis

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestTLSAndACL: over TLS with a client certificate and an ACL user, decisions work; a wrong
// CA, a missing client certificate, a wrong password and an unreadable CA file each fail with an
// error that says what is wrong, and the password appears in none of them.
func TestTLSAndACL(t *testing.T) {
	const password = "s3cret-Pa55word"
	// An ACL user with the rules of docs/security.md: the limiter's keys and the scripts' commands only (the
	// default user stays open, for the test's own plain connection).
	srv := redistest.StartTLS(t, append([]string{"--user", "limiter", "on", ">" + password}, aclRules()...)...)
	zone := func() []*Zone { return []*Zone{{Name: "z", Capacity: NumberOf(2), RefillRate: NumberOf(0.001)}} }
	tlsOK := func() *TLSConfig {
		return &TLSConfig{CA: srv.CA, Cert: srv.ClientCert, Key: srv.ClientKey}
	}

	t.Run("works", func(t *testing.T) {
		for _, algo := range []string{"token_bucket", "sliding_window"} {
			z := zone()
			if algo == "sliding_window" {
				z = []*Zone{{Name: "w", Algorithm: algo, Limit: NumberOf(2), Window: NumberOf(caddy.Duration(time.Hour))}}
			}
			h := provisioned(t, &Handler{
				Redis:    &RedisConfig{Addresses: []string{srv.TLSAddr}, Username: "limiter", Password: password, TLS: tlsOK()},
				FailMode: FailClosed,
				Timeout:  caddy.Duration(time.Second), // the first decision dials and shakes hands, under -race
				Zones:    z,
			})
			for i, want := range []int{200, 200, 429} {
				if got := status(t, h); got != want {
					t.Fatalf("%s request %d: %d, want %d; ACL LOG: %v", algo, i+1, got, want, srv.Do("ACL", "LOG"))
				}
			}
			srv.Do("SCRIPT", "FLUSH") // the next handler meets NOSCRIPT, and EVAL
		}
	})

	for _, tc := range []struct {
		name string
		cfg  *RedisConfig
		want string
	}{
		{"wrong CA", &RedisConfig{Addresses: []string{srv.TLSAddr}, Username: "limiter", Password: password,
			TLS: &TLSConfig{CA: srv.OtherCA, Cert: srv.ClientCert, Key: srv.ClientKey}},
			"tls: failed to verify certificate: x509: certificate signed by unknown authority"},
		// TLS 1.3: the client's handshake is done before the server checks its certificate, so the
		// client sends its first command, and the server's alert ("certificate required") races
		// the reset of a socket closed with that command unread: the client reports either.
		{"no client certificate", &RedisConfig{Addresses: []string{srv.TLSAddr}, Username: "limiter", Password: password,
			TLS: &TLSConfig{CA: srv.CA}},
			"certificate required|connection reset by peer"},
		{"wrong password", &RedisConfig{Addresses: []string{srv.TLSAddr}, Username: "limiter", Password: password + "x", TLS: tlsOK()},
			"WRONGPASS invalid username-password pair or user is disabled"},
		{"plain to the TLS port", &RedisConfig{Addresses: []string{srv.TLSAddr}, Username: "limiter", Password: password},
			"redis decide script"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A timeout long enough for go-redis to finish its one retry (a TLS handshake
			// under -race takes tens of ms): with a shorter one the decision ends first, and
			// reports a timeout instead of the cause.
			h := provisioned(t, &Handler{Redis: tc.cfg, FailMode: FailClosed, Zones: zone(), Timeout: caddy.Duration(time.Second)})
			_, err, next := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
			var he caddyhttp.HandlerError
			if !errors.As(err, &he) || he.StatusCode != 503 || next {
				t.Fatalf("got err %v, next %t; want 503 (fail_mode closed)", err, next)
			}
			if !slices.ContainsFunc(strings.Split(tc.want, "|"), func(w string) bool { return strings.Contains(err.Error(), w) }) {
				t.Fatalf("error %q does not say %q", err, tc.want)
			}
			if strings.Contains(err.Error(), password) {
				t.Fatalf("error %q shows the password", err)
			}
		})
	}

	t.Run("unreadable CA at load", func(t *testing.T) {
		ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
		defer cancel()
		bad := srv.ClientKey // a PEM file with no certificate
		h := &Handler{Redis: &RedisConfig{Addresses: []string{srv.TLSAddr}, Password: password, TLS: &TLSConfig{CA: bad}}, Zones: zone()}
		err := h.Provision(ctx)
		if err == nil || !strings.Contains(err.Error(), "redis tls ca "+bad+": no PEM certificate found") {
			t.Fatalf("Provision: %v; want the CA file named as holding no certificate", err)
		}
		if strings.Contains(err.Error(), password) {
			t.Fatalf("error %q shows the password", err)
		}
		_ = h.Cleanup()
	})
}

// status serves one request and returns its status: the next handler's 200, or the handler
// error's status code.
func status(t *testing.T, h *Handler) int {
	t.Helper()
	_, err, next := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
	var he caddyhttp.HandlerError
	switch {
	case err == nil && next:
		return 200
	case errors.As(err, &he):
		return he.StatusCode
	}
	t.Fatalf("serve: err %v, next %t", err, next)
	return 0
}
