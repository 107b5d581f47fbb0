package e2e_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/repocheck"
)

// runRecipe runs the Caddyfile of the cookbook recipe under heading (loadRecipe) against a real
// Redis with a password (REDIS_ADDR and REDIS_PASSWORD set, as the recipe reads them), in front
// of upstream. The pairs of replace are further replacements the test needs (a log file's path).
func runRecipe(t *testing.T, heading string, upstream http.HandlerFunc, replace ...string) *caddytest.Site {
	t.Helper()
	for _, r := range repocheck.Recipes(t) {
		if r.Heading == heading && len(r.Blocks) == 1 {
			srv := redistest.StartWithPassword(t, "cookbook-secret")
			t.Setenv("REDIS_ADDR", srv.Addr)
			t.Setenv("REDIS_PASSWORD", "cookbook-secret")
			return loadRecipe(t, r, upstream, replace...)
		}
	}
	t.Fatalf("%s has no recipe %q with one caddyfile block", repocheck.Cookbook, heading)
	return nil
}

// proxied is a reverse_proxy line of a recipe, its upstream in group 1.
var proxied = regexp.MustCompile(`(?m)^(\s*reverse_proxy )\S+$`)

// loadRecipe loads the Caddyfile of recipe r (its one block) as written, but for the site moved
// to a free loopback port, every reverse_proxy sent to upstream, the admin API off, each decision
// waiting for Redis up to 5 s (one failed open would admit a request too many) and the pairs of
// replace (each must match); the environment the recipe reads is the caller's to set.
func loadRecipe(t *testing.T, r repocheck.Recipe, upstream http.HandlerFunc, replace ...string) *caddytest.Site {
	t.Helper()
	block := r.Blocks[0]
	up := httptest.NewServer(upstream)
	t.Cleanup(up.Close)
	site := freeport.Must(t)
	address, _, _ := strings.Cut(block.Text, " {\n")
	caddyfile := "{\n\tadmin off\n\tpersist_config off\n\tlog {\n\t\tlevel ERROR\n\t}\n}\n\n" +
		proxied.ReplaceAllString(block.Text, "${1}"+strings.TrimPrefix(up.URL, "http://"))
	pairs := append([]string{
		address + " {\n", fmt.Sprintf(":%d {\n\tbind 127.0.0.1\n", site),
		"rate_limit_redis {\n", "rate_limit_redis {\n\t\ttimeout 5s\n",
	}, replace...)
	for i := 0; i+1 < len(pairs); i += 2 {
		if !strings.Contains(caddyfile, pairs[i]) {
			t.Fatalf("%s: recipe %q has no %q", block.Where, r.Heading, pairs[i])
		}
		caddyfile = strings.Replace(caddyfile, pairs[i], pairs[i+1], 1)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	if err := caddytest.LoadCaddyfile(t, caddyfile); err != nil {
		t.Fatalf("%s: recipe %q does not load: %v", block.Where, r.Heading, err)
	}
	return &caddytest.Site{T: t, Base: "http://127.0.0.1:" + strconv.Itoa(site)}
}

// TestCookbookRecipesServe: every recipe of the cookbook (but the caddy-l4 one, served by l4's
// TestCookbookSSHConnections) loads as written and serves a request
// through its zones, decided by Redis (no X-RateLimit-Degraded): a standalone Redis with a
// password, or for the Redis Cluster recipe a cluster of 3 primaries (without a password, so the
// recipe's password line is left out, as the cookbook says to for such a Redis).
func TestCookbookRecipesServe(t *testing.T) {
	for _, r := range repocheck.Recipes(t) {
		t.Run(r.Heading, func(t *testing.T) {
			if len(r.Blocks) != 1 {
				t.Fatalf("recipe %q has %d caddyfile blocks, want 1", r.Heading, len(r.Blocks))
			}
			if strings.HasPrefix(r.Blocks[0].Text, "{\n\tlayer4 {\n") {
				t.Skip("a caddy-l4 recipe: l4's TestCookbookSSHConnections serves it, with caddy-l4 in the test binary")
			}
			var replace []string
			if strings.Contains(r.Blocks[0].Text, "{env.REDIS_NODE_1}") {
				for i, addr := range redistest.StartCluster(t, 3).Addrs() {
					t.Setenv("REDIS_NODE_"+strconv.Itoa(i+1), addr)
				}
				replace = []string{"\t\t\tpassword {env.REDIS_PASSWORD}\n", ""}
				t.Setenv("RATE_LIMIT_KEY_SECRET", "cookbook-key-secret")
			} else {
				srv := redistest.StartWithPassword(t, "cookbook-secret")
				t.Setenv("REDIS_ADDR", srv.Addr)
				t.Setenv("REDIS_PASSWORD", "cookbook-secret")
			}
			if strings.Contains(r.Blocks[0].Text, "output file /var/log/caddy/api-access.log\n") {
				replace = append(replace, "/var/log/caddy/api-access.log", t.TempDir()+"/access.log")
			}
			cs := loadRecipe(t, r, ok, replace...)
			cs.Get("/", "X-API-Key", "key-1", "Authorization", "Bearer sk-1").Expect(t, "GET /", 200, "upstream", "X-Ratelimit-Degraded", "")
		})
	}
}

// ok is an upstream that answers 200 "upstream" to every request.
func ok(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "upstream") }

// retryAfter returns r's Retry-After in seconds, failing t unless it is one.
func retryAfter(t *testing.T, step string, r caddytest.Response) int {
	t.Helper()
	s, err := strconv.Atoi(r.Header.Get("Retry-After"))
	if err != nil {
		t.Fatalf("%s: Retry-After %q, want seconds", step, r.Header.Get("Retry-After"))
	}
	return s
}

// TestCookbookPerAddress: the recipe "A limit per client address" admits 60 requests of an
// address, and the 61st within the minute gets a 429 with a Retry-After of at most a minute.
func TestCookbookPerAddress(t *testing.T) {
	cs := runRecipe(t, "A limit per client address", ok)
	for n := 1; n <= 60; n++ {
		cs.Get("/").Expect(t, "request "+strconv.Itoa(n), 200, "upstream")
	}
	r := cs.Get("/")
	if r.Status != 429 {
		t.Fatalf("request 61: %d %q, want 429", r.Status, r.Body)
	}
	if s := retryAfter(t, "request 61", r); s < 1 || s > 60 {
		t.Fatalf("request 61: Retry-After %d, want 1 to 60", s)
	}
}

// TestCookbookLoginPenaltyBox: the recipe "Login attempts, then a penalty box" does not count
// successful logins, admits 5 failed ones (401) of an address, refuses the 6th (429), and then
// refuses that address even with the right password for the block (a Retry-After above the
// minute of the window, at most 15 minutes); other paths are not limited.
func TestCookbookLoginPenaltyBox(t *testing.T) {
	cs := runRecipe(t, "Login attempts, then a penalty box", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/login" && r.URL.Query().Get("password") != "right" {
			http.Error(w, "wrong password", http.StatusUnauthorized)
			return
		}
		fmt.Fprint(w, "upstream")
	})
	for n := 1; n <= 10; n++ {
		cs.Get("/login?password=right").Expect(t, "successful login "+strconv.Itoa(n), 200, "upstream")
	}
	for n := 1; n <= 5; n++ {
		cs.Get("/login?password=wrong").Expect(t, "failed login "+strconv.Itoa(n), 401, "wrong password\n")
	}
	r := cs.Get("/login?password=wrong")
	if r.Status != 429 {
		t.Fatalf("failed login 6: %d %q, want 429", r.Status, r.Body)
	}
	r = cs.Get("/login?password=right")
	if r.Status != 429 {
		t.Fatalf("the right password after the 6th failure: %d %q, want 429 (blocked)", r.Status, r.Body)
	}
	if s := retryAfter(t, "blocked login", r); s <= 60 || s > 15*60 {
		t.Fatalf("blocked login: Retry-After %d, want the block's 15 minutes (above the window's 60 s, at most 900)", s)
	}
	cs.Get("/").Expect(t, "another path", 200, "upstream")
}

// TestCookbookPlans: the recipe "Limits per plan" admits 100 requests an hour of a free key
// (the map's default) and refuses the 101st, while the paid key is admitted past 100.
func TestCookbookPlans(t *testing.T) {
	cs := runRecipe(t, "Limits per plan", ok)
	for n := 1; n <= 100; n++ {
		cs.Get("/", "X-API-Key", "key-free").Expect(t, "free request "+strconv.Itoa(n), 200, "upstream")
	}
	if r := cs.Get("/", "X-API-Key", "key-free"); r.Status != 429 {
		t.Fatalf("free request 101: %d %q, want 429", r.Status, r.Body)
	}
	for n := 1; n <= 150; n++ {
		cs.Get("/", "X-API-Key", "key-3f9a1c").Expect(t, "paid request "+strconv.Itoa(n), 200, "upstream")
	}
}

// TestCookbookShadow: the recipe "Trying a new limit in the shadow" admits 10 requests of an
// address a minute and refuses the 11th (the enforced zone), and its access log names the shadow
// zone in shadow_denied for the 6th to the 10th, which the shadow zone alone would have refused,
// and for none of the first 5.
func TestCookbookShadow(t *testing.T) {
	logFile := t.TempDir() + "/access.log"
	cs := runRecipe(t, "Trying a new limit in the shadow", ok, "/var/log/caddy/api-access.log", logFile)
	for n := 1; n <= 10; n++ {
		cs.Get("/?n="+strconv.Itoa(n)).Expect(t, "request "+strconv.Itoa(n), 200, "upstream")
	}
	if r := cs.Get("/?n=11"); r.Status != 429 {
		t.Fatalf("request 11: %d %q, want 429 from the enforced zone", r.Status, r.Body)
	}
	shadowDenied := map[string]string{} // request URI → its shadow_denied
	redistest.WaitFor(t, 10*time.Second, "the access log lines of requests 1 to 10", func() bool {
		b, _ := os.ReadFile(logFile)
		for line := range strings.SplitSeq(strings.TrimSpace(string(b)), "\n") {
			var entry struct {
				Request struct {
					URI string `json:"uri"`
				} `json:"request"`
				ShadowDenied *string `json:"shadow_denied"`
			}
			if json.Unmarshal([]byte(line), &entry) == nil && entry.ShadowDenied != nil {
				shadowDenied[entry.Request.URI] = *entry.ShadowDenied
			}
		}
		for n := 1; n <= 10; n++ {
			if _, ok := shadowDenied["/?n="+strconv.Itoa(n)]; !ok {
				return false
			}
		}
		return true
	})
	for n := 1; n <= 10; n++ {
		want := ""
		if n > 5 {
			want = "trial_minute"
		}
		if got := shadowDenied["/?n="+strconv.Itoa(n)]; got != want {
			t.Errorf("request %d: shadow_denied %q, want %q", n, got, want)
		}
	}
}

// TestCookbookLLMKeys: the recipe "An LLM token budget: OpenAI, Anthropic and Gemini clients"
// refuses a request of each API with no key (403), and admits one whose key is in any field the
// recipe names for that API's SDKs. Each request carries the body its API's SDK sends: the zones
// have cap_output, which refuses a body that is not one JSON object (docs/security.md).
func TestCookbookLLMKeys(t *testing.T) {
	cs := runRecipe(t, "An LLM token budget: OpenAI, Anthropic and Gemini clients", ok)
	gemini := "/v1beta/models/gemini-2.0-flash:generateContent"
	bodies := map[string]string{
		"/v1/chat/completions": `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`,
		"/v1/messages":         `{"model":"claude-sonnet-4","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`,
		gemini:                 `{"contents":[{"parts":[{"text":"hi"}]}]}`,
	}
	for _, path := range []string{"/v1/chat/completions", "/v1/messages", gemini} {
		if status, _, body := postJSON(t, cs.Base+path, "", bodies[path]); status != 403 {
			t.Fatalf("POST %s with no key: %d %q, want 403", path, status, body)
		}
	}
	for _, c := range []struct{ path, query, field, value string }{
		{"/v1/chat/completions", "", "Authorization", "Bearer sk-openai"},
		{"/v1/messages", "", "X-Api-Key", "sk-ant-python"},
		{"/v1/messages", "", "Authorization", "Bearer sk-ant-node"},
		{gemini, "", "X-Goog-Api-Key", "gemini-genai"},
		{gemini, "?key=gemini-rest", "", ""},
	} {
		var header []string
		if c.field != "" {
			header = []string{c.field, c.value}
		}
		status, _, body := postJSON(t, cs.Base+c.path+c.query, "", bodies[c.path], header...)
		if status != 200 || string(body) != "upstream" {
			t.Fatalf("POST %s keyed in %s%s: got %d %q, want 200 \"upstream\"", c.path, c.field, c.query, status, body)
		}
	}
}
