package ratelimitredis

// The handler's lifecycle (module.go): configs refused at load, naming the field, and Cleanup.

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

func TestConfigErrorsAtLoad(t *testing.T) {
	for name, tc := range map[string]struct{ json, want string }{
		"no zone":        {`{}`, "at least one zone is required"},
		"fail mode":      {`{"fail_mode":"maybe","zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, `fail_mode "maybe" must be open, closed or local`},
		"cluster db":     {`{"redis":{"addresses":["a:1","b:2"],"db":3},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis db 3: Redis Cluster has only database 0"},
		"tls ca":         {`{"redis":{"tls":{"ca":"/nonexistent/ca.pem"}},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis tls ca: open /nonexistent/ca.pem: no such file or directory"},
		"sentinel":       {`{"redis":{"sentinel":"m"},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis sentinel m needs the addresses of its Sentinels"},
		"dup zone":       {`{"zones":[{"name":"a","capacity":1,"refill_rate":1},{"name":"a","capacity":1,"refill_rate":1}]}`, `zone name "a" is used twice`},
		"braces":         {`{"key_prefix":"{x}","zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "key_prefix \"{x}\" must not contain { or }"},
		"both algos":     {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"limit":3}]}`, "zone a: limit belongs to algorithm sliding_window, not token_bucket"},
		"cost > cap":     {`{"zones":[{"name":"a","capacity":2,"refill_rate":1,"cost":"3"}]}`, "zone a: cost 3 is larger than capacity 2: no request could ever be admitted"},
		"cost":           {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"cost":"0"}]}`, `zone a: cost: "0" must be > 0`},
		"zone fail mode": {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"fail_mode":"maybe"}]}`, `zone a: fail_mode "maybe" must be open, closed or local`},
		"empty key":      {`{"zones":[{"name":"a","capacity":1,"refill_rate":1,"empty_key":"drop"}]}`, `zone a: empty_key "drop" must be shared, skip or deny`},
	} {
		t.Run(name, func(t *testing.T) { wantLoadError(t, tc.json, tc.want) })
	}
}

// TestCleanupLogsUnreturnedGrants: when a handler is cleaned up (a reload) while Redis is gone,
// the unspent tokens of its lease grants cannot be given back; it says so at warn level.
func TestCleanupLogsUnreturnedGrants(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{
		Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Timeout: caddy.Duration(2 * time.Second),
		Zones: []*Zone{{Name: "api", Key: []string{"k"}, Capacity: NumberOf(100), RefillRate: NumberOf(1.0 / 3600),
			Lease: &Lease{Max: 20, TTL: caddy.Duration(time.Minute)}}},
	})
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	key := limiter.StateKey("rl:", &h.Zones[0].lz, "k")
	for i := 0; srv.Do("HGET", key, "h") == nil; i++ { // a hot client: soon served from grants
		if i == 100 {
			t.Fatal("no grant taken after 100 requests of one client")
		}
		if w, err, _ := serve(h, httptest.NewRequest(http.MethodGet, "/", nil)); err != nil || w.Code != 200 {
			t.Fatalf("request %d: %d %v", i, w.Code, err)
		}
	}
	srv.Stop()
	if err := h.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if n := logs.FilterMessageSnippet("lease grants not returned to redis").FilterLevelExact(zapcore.WarnLevel).Len(); n != 1 {
		t.Fatalf("%d warnings of grants not returned, want 1: %v", n, logs.All())
	}
}

// TestConfigPrefixesAndJitterAtLoad: the JSON config's values out of range are errors when it
// loads, naming the field: prefixes, jitter, no_retry_over, a charge's weight.
func TestConfigPrefixesAndJitterAtLoad(t *testing.T) {
	zone := func(fields string) string {
		return `{"zones":[{"name":"a","capacity":1,"refill_rate":1` + fields + `}]}`
	}
	for name, tc := range map[string]struct{ json, want string }{
		"ipv4_prefix above 32":         {`{"ipv4_prefix":33,` + zone("")[1:], "ipv4_prefix 33 must be between 1 and 32"},
		"ipv4_prefix negative":         {`{"ipv4_prefix":-1,` + zone("")[1:], "ipv4_prefix -1 must be between 1 and 32"},
		"ipv6_prefix above 128":        {`{"ipv6_prefix":129,` + zone("")[1:], "ipv6_prefix 129 must be between 1 and 128"},
		"zone ipv6_prefix above 128":   {zone(`,"ipv6_prefix":200`), "zone a: ipv6_prefix 200 must be between 1 and 128"},
		"zone ipv4_prefix negative":    {zone(`,"ipv4_prefix":-8`), "zone a: ipv4_prefix -8 must be between 1 and 32"},
		"jitter negative":              {`{"jitter":"-1s",` + zone("")[1:], "jitter -1s must be a whole number of seconds, >= 0"},
		"jitter a fraction":            {`{"jitter":"1.5s",` + zone("")[1:], "jitter 1.5s must be a whole number of seconds, >= 0"},
		"zone jitter a fraction":       {zone(`,"jitter":"10ms"`), "zone a: jitter 10ms must be a whole number of seconds, >= 0"},
		"no_retry_over negative":       {`{"no_retry_over":"-1m",` + zone("")[1:], "no_retry_over -1m0s must be > 0, or off"},
		"zone no_retry_over negative":  {zone(`,"no_retry_over":-1`), "zone a: no_retry_over -1ns must be > 0, or off"},
		"zone charge weight above 1e6": {zone(`,"charge":{"source":"openai_usage","weights":{"completion":2e6}}`), "zone a: charge weight completion 2e+06 must be between 0 and 1000000"},
	} {
		t.Run(name, func(t *testing.T) {
			err := loadHandlerJSON(t, tc.json)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one saying %q", err, tc.want)
			}
		})
	}
}

// TestConfigAbuseJSON: the JSON path (unmarshal, Provision, Validate, as `caddy run` with a JSON
// config does) rejects the out-of-range values the Caddyfile parser rejects, names the field,
// and leaves no Redis client behind.
func TestConfigAbuseJSON(t *testing.T) {
	tb := func(fields string) string { return `{"zones":[{"name":"a",` + fields + `}]}` }
	sw := func(fields string) string { return tb(`"algorithm":"sliding_window",` + fields) }
	for name, tc := range map[string]struct{ json, want string }{
		"capacity 0":        {tb(`"capacity":0,"refill_rate":1`), "zone a: capacity is required for algorithm token_bucket (the default when no algorithm is given)"},
		"capacity negative": {tb(`"capacity":-5,"refill_rate":1`), `zone a: capacity: "-5" is out of range (1 to 9007199254740992)`},
		// caddy.Load passes numbers through float64: 2^53+1 would arrive as 2^53, 2^53+2 as itself.
		"capacity beyond 2^53":  {tb(`"capacity":9007199254740994,"refill_rate":1`), `zone a: capacity: "9007199254740994" is out of range (1 to 9007199254740992)`},
		"capacity beyond int64": {tb(`"capacity":99999999999999999999,"refill_rate":1`), `zone a: capacity: "100000000000000000000" is out of range (1 to 9007199254740992)`},
		"capacity a float":      {tb(`"capacity":1.5,"refill_rate":1`), `zone a: capacity: "1.5" is not an integer`},
		"refill_rate 0":         {tb(`"capacity":1`), "zone a: refill_rate is required for algorithm token_bucket (the default when no algorithm is given)"},
		"refill_rate negative":  {tb(`"capacity":1,"refill_rate":-1`), `zone a: refill_rate: "-1" must be > 0`},
		"refill_rate tiny":      {tb(`"capacity":1,"refill_rate":5e-324`), "zone a: an empty bucket takes +Infs to refill (capacity / refill_rate); at most 366d is supported"},
		"refill_rate beyond float64": {tb(`"capacity":1,"refill_rate":1e309`),
			"cannot unmarshal number 1e309 into Go value of type float64"},
		"limit 0":               {sw(`"limit":0,"window":"1m"`), "zone a: limit is required for algorithm sliding_window"},
		"limit negative":        {sw(`"limit":-1,"window":"1m"`), `zone a: limit: "-1" is out of range (1 to 1000000)`},
		"limit beyond 2^53":     {sw(`"limit":9007199254740994,"window":"1m"`), `zone a: limit: "9007199254740994" is out of range (1 to 1000000)`},
		"window 0":              {sw(`"limit":1`), "zone a: window is required for algorithm sliding_window"},
		"window below 1ms":      {sw(`"limit":1,"window":"999us"`), `zone a: window: "999us" is out of range (1ms to 366d)`},
		"window 1ns":            {sw(`"limit":1,"window":1`), `zone a: window: "1ns" is out of range (1ms to 366d)`},
		"window negative":       {sw(`"limit":1,"window":"-1s"`), `zone a: window: "-1s" is out of range (1ms to 366d)`},
		"window above 366d":     {sw(`"limit":1,"window":"367d"`), `zone a: window: "367d" is out of range (1ms to 366d)`},
		"window not a duration": {sw(`"limit":1,"window":"soon"`), `zone a: window: "soon" is not a duration`},
		"zone name with a space": {`{"zones":[{"name":"a b","capacity":1,"refill_rate":1}]}`,
			`zone name "a b" must be 1 to 64 characters of A-Z a-z 0-9 _ . -`},
		"zone name in braces": {`{"zones":[{"name":"{a}","capacity":1,"refill_rate":1}]}`,
			`zone name "{a}" must be 1 to 64 characters of A-Z a-z 0-9 _ . -`},
		"zone name with a brace": {`{"zones":[{"name":"a}","capacity":1,"refill_rate":1}]}`,
			`zone name "a}" must be 1 to 64 characters of A-Z a-z 0-9 _ . -`},
		"zone name empty": {`{"zones":[{"capacity":1,"refill_rate":1}]}`,
			`zone name "" must be 1 to 64 characters of A-Z a-z 0-9 _ . -`},
		"zone name too long": {`{"zones":[{"name":"` + strings.Repeat("a", 65) + `","capacity":1,"refill_rate":1}]}`,
			`zone name "` + strings.Repeat("a", 65) + `" must be 1 to 64 characters of A-Z a-z 0-9 _ . -`},
		"duplicate zone names": {`{"zones":[{"name":"a","capacity":1,"refill_rate":1},{"name":"a","algorithm":"sliding_window","limit":1,"window":"1s"}]}`,
			`zone name "a" is used twice`},
		"cost 0":              {tb(`"capacity":1,"refill_rate":1,"cost":"0"`), `zone a: cost: "0" must be > 0`},
		"cost negative":       {tb(`"capacity":1,"refill_rate":1,"cost":"-1"`), `zone a: cost: "-1" must be > 0`},
		"cost NaN":            {tb(`"capacity":1,"refill_rate":1,"cost":"NaN"`), `zone a: cost: "NaN" is not an integer or a placeholder`},
		"cost beyond int64":   {tb(`"capacity":1,"refill_rate":1,"cost":"99999999999999999999"`), `zone a: cost: "99999999999999999999" is out of range`},
		"cost an empty brace": {tb(`"capacity":1,"refill_rate":1,"cost":"x{}"`), `zone a: cost: "x{}" is not an integer or a placeholder`},
		"cost an open brace":  {tb(`"capacity":1,"refill_rate":1,"cost":"{"`), `zone a: cost: "{" is not an integer or a placeholder`},
		"cost above capacity": {tb(`"capacity":5,"refill_rate":1,"cost":"6"`), "zone a: cost 6 is larger than capacity 5: no request could ever be admitted"},
		"key_prefix with a brace": {`{"key_prefix":"rl{","zones":[{"name":"a","capacity":1,"refill_rate":1}]}`,
			`key_prefix "rl{" must not contain { or }`},
		"timeout negative": {`{"timeout":"-1s","zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "timeout must be > 0"},
		"db negative":      {`{"redis":{"db":-1},"zones":[{"name":"a","capacity":1,"refill_rate":1}]}`, "redis db -1 must be >= 0"},
		"algorithm":        {`{"zones":[{"name":"a","algorithm":"leaky_bucket","capacity":1,"refill_rate":1}]}`, `zone a: algorithm "leaky_bucket" must be token_bucket, sliding_window, fixed_window, sliding_window_counter, concurrency or adaptive_concurrency`},
	} {
		t.Run(name, func(t *testing.T) {
			// Raw, so that numbers reach Caddy as written.
			handler := json.RawMessage(`{"handler":"rate_limit_redis",` + strings.TrimPrefix(tc.json, "{"))
			cfg, err := json.Marshal(map[string]any{
				"admin": map[string]any{"disabled": true},
				"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"s": map[string]any{
					"listen": []string{"127.0.0.1:0"},
					"routes": []any{map[string]any{"handle": []any{handler}}},
				}}}},
			})
			if err != nil {
				t.Fatal(err)
			}
			before := clientCount()
			err = caddy.Load(cfg, true)
			if err == nil {
				_ = caddy.Stop()
				t.Fatalf("config loaded; want error %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not say %q", err, tc.want)
			}
			if after := clientCount(); after != before {
				t.Fatalf("%d shared Redis clients after the failed load, %d before", after, before)
			}
		})
	}
}

// TestKeySecretConfigErrors: the JSON path rejects a key_secret that is short once its
// placeholders are replaced, or that holds a placeholder not known at load, and names the field.
func TestKeySecretConfigErrors(t *testing.T) {
	t.Setenv("RL_TEST_EMPTY", "")
	for name, tc := range map[string]struct{ secret, want string }{
		"short literal":         {"fifteen bytes..", errKeySecretShort.Error()},
		"unset variable":        {"{env.RL_TEST_EMPTY}", errKeySecretShort.Error()},
		"request placeholder":   {"{http.request.header.X-Secret}", errKeySecretPlaceholder.Error()},
		"braces left by escape": {`\{0123456789abcdef}`, errKeySecretPlaceholder.Error()},
	} {
		t.Run(name, func(t *testing.T) {
			err := provisionErr(t, &Handler{KeySecret: tc.secret, Zones: []*Zone{{Name: "a", Capacity: NumberOf(1), RefillRate: NumberOf(1)}}})
			if err == nil || err.Error() != tc.want {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
		})
	}
	if errKeySecretShort.Error() != "key_secret must be at least 16 bytes, placeholders replaced: use 32 random bytes, such as the output of `openssl rand -base64 32`" {
		t.Fatalf("error text: %q", errKeySecretShort)
	}
}

// clientCount is the number of shared Redis clients alive.
func clientCount() int {
	n := 0
	clients.Range(func(any, any) bool { n++; return true })
	return n
}
