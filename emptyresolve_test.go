package ratelimitredis

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestEmptyResolvedRedisSettingRefused: a Redis address, username, password (or sentinel, or tls
// file) that was written but is empty once its placeholders are replaced is a load error naming
// the placeholder, both in `caddy validate` (caddy.Validate) and in `caddy run` (caddy.Load),
// instead of dialling the default address or connecting without AUTH. With the variable set
// the same config loads, and with no address written the default applies.
func TestEmptyResolvedRedisSettingRefused(t *testing.T) {
	srv := redistest.Start(t)
	const zone = "\n\t\tzone a {\n\t\t\tcapacity 5\n\t\t\trefill_rate 1\n\t\t}\n\t}\n\trespond \"ok\""
	for name, tc := range map[string]struct{ redis, want string }{
		"address":      {"address {env.UNSET_NAME}", "redis address {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME is not set, or empty): set it, or leave out the address line"},
		"host":         {"address {env.UNSET_NAME}:6379", "redis address {env.UNSET_NAME}:6379: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME"},
		"cluster seed": {"address " + srv.Addr + " {env.UNSET_NAME}", "redis address {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME"},
		"quoted empty": {`address ""`, `redis address "" is empty: give host:port, or leave out the address line for the default 127.0.0.1:6379`},
		"username":     {"address " + srv.Addr + "\n\t\t\tusername {env.UNSET_NAME}", "redis username {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME"},
		"password":     {"address " + srv.Addr + "\n\t\t\tpassword {env.UNSET_NAME}", "redis password {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME is not set, or empty): set it, or leave out the password line"},
		"sentinel":     {"address " + srv.Addr + "\n\t\t\tsentinel {env.UNSET_NAME}", "redis sentinel {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME"},
		"tls ca":       {"address " + srv.Addr + "\n\t\t\ttls {\n\t\t\t\tca {env.UNSET_NAME}\n\t\t\t}", "redis tls ca {env.UNSET_NAME}: empty placeholder {env.UNSET_NAME} (environment variable UNSET_NAME is not set, or empty): set it, or leave out the ca line"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Setenv("UNSET_NAME", "")
			site := "\trate_limit_redis {\n\t\tredis {\n\t\t\t" + tc.redis + "\n\t\t}" + zone
			cs := &caddyServer{t: t}
			port := freeLoopbackPort(t)
			if err := validateSite(site, port); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("caddy validate: error %v, want one saying %q", err, tc.want)
			}
			err := cs.load(site, port)
			if err == nil {
				_ = caddy.Stop()
				t.Fatalf("caddy run: config loaded; want an error saying %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("caddy run: error %q does not say %q", err, tc.want)
			}
		})
	}

	t.Run("set", func(t *testing.T) {
		t.Setenv("UNSET_NAME", srv.Addr)
		cs := startCaddy(t, "\trate_limit_redis {\n\t\tredis {\n\t\t\taddress {env.UNSET_NAME}\n\t\t}"+zone)
		cs.get("/").expect(t, "address from the environment", 200, "ok", "X-RateLimit-Remaining", "4")
	})
}

// validateSite adapts the site as cs.load does and validates it as `caddy validate` does:
// provisioned, never started.
func validateSite(site string, port int) error {
	caddyfile := fmt.Sprintf("{\n\tadmin off\n\tauto_https off\n\tpersist_config off\n}\n:%d {\n\tbind 127.0.0.1\n%s\n}\n", port, site)
	cfgJSON, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), nil)
	if err != nil {
		return err
	}
	var cfg caddy.Config
	if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
		return err
	}
	return caddy.Validate(&cfg)
}
