package ratelimitredis

// The request's model as a placeholder (model.go): budgets per user and model, a zone matched
// or sized by the model, and the body read only for the zones that use it.

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/usage"
)

// modelSite is the site of TestModelPlaceholder: zones keyed on the user and the model (sized
// by a map of the model), matched on the model, keyed on the model alone (empty_key deny), and
// one that does not use the model; an echo upstream under /echo/ that gets the model as a header.
func modelSite(redisAddr, upstream string) string {
	return fmt.Sprintf(`
	map {http.rate_limit_redis.request.model} {model_capacity} {
		gpt-4o 3
		default 2
	}
	rate_limit_redis {
		redis {
			address %s
		}
		zone permodel {
			match path /llm/* /echo/*
			key {http.request.header.X-User}:{http.rate_limit_redis.request.model}
			capacity {model_capacity} 1
			refill_rate 1/1h
		}
		zone gpt4o {
			match {
				path /m/*
				expression {http.rate_limit_redis.request.model} == "gpt-4o"
			}
			key {http.request.header.X-User}
			capacity 1
			refill_rate 1/1h
		}
		zone modelonly {
			match path /only/*
			key {http.rate_limit_redis.request.model}
			empty_key deny
			capacity 100
			refill_rate 1
		}
		zone plain {
			match path /plain/*
			key {http.request.header.X-User}
			capacity 100
			refill_rate 1
		}
	}
	handle /echo/* {
		reverse_proxy %s {
			header_up X-Model {http.rate_limit_redis.request.model}
		}
	}
	respond "model={http.rate_limit_redis.request.model}"`, redisAddr, upstream)
}

// TestModelPlaceholder: {http.rate_limit_redis.request.model} holds the model of the request's
// JSON body: a zone keyed on the user and the model gives each pair its own budget (sized here
// by a map of the model), a matcher can select a model, and the upstream gets the body as it
// came. A body that is not JSON or is too large has the unreadable model, whose budget is the
// map's default; one whose model upstreams read apart is refused with 400, by a key or a matcher
// of the model alike. A body that names no model has an empty model: a key with other parts still has
// them, and a key of the model alone is empty (empty_key deny: 403).
func TestModelPlaceholder(t *testing.T) {
	srv := redistest.Start(t)
	var echoed []string // the bodies and X-Model the upstream received
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		echoed = append(echoed, r.Header.Get("X-Model")+" "+string(body))
		_, _ = io.WriteString(w, "echo")
	}))
	t.Cleanup(up.Close)
	cs := caddytest.Start(t, modelSite(srv.Addr, up.URL))
	post := func(path, user, body string) caddytest.Response {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, cs.Base+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-User", user)
		req.Header.Set("Content-Type", "application/json")
		resp, err := caddytest.Client(10 * time.Second).Do(req)
		if err != nil {
			t.Fatalf("POST %s: %v", path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return caddytest.Response{Status: resp.StatusCode, Header: resp.Header, Body: string(b)}
	}
	statuses := func(n int, path, user, body string) string {
		var s []string
		for range n {
			s = append(s, fmt.Sprint(post(path, user, body).Status))
		}
		return strings.Join(s, " ")
	}
	gpt, claude := `{"model":"gpt-4o","messages":[]}`, `{"messages":[],"model":"claude-sonnet-4-5"}`
	for _, tc := range []struct{ step, path, user, body, want string }{
		{"alice, gpt-4o: capacity 3 (the map)", "/llm/chat", "alice", gpt, "200 200 200 429"},
		{"alice, another model: its own budget of 2", "/llm/chat", "alice", claude, "200 200 429"},
		{"bob, gpt-4o: his own", "/llm/chat", "bob", gpt, "200 200 200 429"},
		{"alice, not JSON: the model is unreadable, the map's default", "/llm/chat", "alice", `model=gpt-4o`, "200 200 429"},
		{"alice, over 1 MiB: alike", "/llm/chat", "alice", `{"model":"gpt-4o","pad":"` + strings.Repeat(" ", usage.MaxRequestBody) + `"}`, "429"},
		{"a matcher of gpt-4o", "/m/x", "carol", gpt, "200 429"},
		{"the matcher, another model", "/m/x", "carol", claude, "200 200 200"},
		{"the matcher, an ambiguous model: refused", "/m/x", "carol", `{"model":"claude","Model":"gpt-4o"}`, "400 400"},
		{"a key of the model alone, an ambiguous model: refused", "/only/x", "dave", `{"model":"gpt-4o","MODEL":"x"}`, "400"},
		{"a key of the model alone, no model", "/only/x", "dave", `{"messages":[]}`, "403 403"},
		{"a key of the model alone", "/only/x", "dave", gpt, "200 200"},
	} {
		if got := statuses(len(strings.Fields(tc.want)), tc.path, tc.user, tc.body); got != tc.want {
			t.Fatalf("%s: %s, want %s", tc.step, got, tc.want)
		}
	}
	unreadable := limiter.StateKey("rl:", tbZone("permodel"), "alice:"+usage.UnreadableModel)
	for _, k := range []string{"rl:{alice:gpt-4o}:permodel:tb", "rl:{alice:claude-sonnet-4-5}:permodel:tb", unreadable, "rl:{gpt-4o}:modelonly:tb"} {
		if srv.Do("EXISTS", k).(int64) != 1 {
			t.Errorf("no state %s: %v", k, srv.Keys(t))
		}
	}
	post("/llm/chat", "erin", gpt).Expect(t, "the model for the next handlers", 200, "model=gpt-4o")
	post("/plain/x", "erin", gpt).Expect(t, "a zone that does not use the model: not read", 200, "model={http.rate_limit_redis.request.model}")
	post("/echo/x", "erin", claude).Expect(t, "proxied", 200, "echo")
	if want := "claude-sonnet-4-5 " + claude; len(echoed) != 1 || echoed[0] != want {
		t.Fatalf("the upstream received %q, want %q", echoed, want)
	}
}

// TestModelReadOnlyWhenUsed: the body is read before the decision for a zone that uses the model
// in its key (once its matchers matched) or in a matcher (once the set's other matchers
// matched), and not for a request that only zones not using it apply to, nor one whose path
// no such zone matches: the next handler then gets a body nobody has read. Whatever was read,
// the next handler reads the body as it came.
func TestModelReadOnlyWhenUsed(t *testing.T) {
	srv := redistest.Start(t)
	match := func(matchers ...string) caddyhttp.RawMatcherSets {
		set := caddy.ModuleMap{}
		for i := 0; i+1 < len(matchers); i += 2 {
			set[matchers[i]] = json.RawMessage(matchers[i+1])
		}
		return caddyhttp.RawMatcherSets{set}
	}
	zone := func(name string, m caddyhttp.RawMatcherSets, key string) *Zone {
		return &Zone{Name: name, MatcherSetsRaw: m, Key: []string{key}, Capacity: NumberOf(100), RefillRate: NumberOf(1)}
	}
	h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Zones: []*Zone{
		zone("permodel", match("path", `["/llm/*"]`), "{http.request.header.X-User}:{http.rate_limit_redis.request.model}"),
		zone("gpt4o", match("path", `["/m/*"]`, "expression", `"{http.rate_limit_redis.request.model} == 'gpt-4o'"`), "{http.request.header.X-User}"),
		zone("plain", match("path", `["/plain/*"]`), "{http.request.header.X-User}"),
	}})
	const body = `{"model":"gpt-4o","messages":[]}`
	for _, tc := range []struct {
		path    string
		read    bool
		applies string // the deciding zone, "" when none applies
	}{
		{"/plain/x", false, "plain"},
		{"/other", false, ""},
		{"/llm/x", true, "permodel"},
		{"/m/x", true, "gpt4o"},
	} {
		cb := &countingBody{Reader: strings.NewReader(body)}
		r := httptest.NewRequest(http.MethodPost, tc.path, nil)
		r.Body, r.ContentLength = cb, int64(len(body))
		r.Header.Set("Content-Type", "application/json")
		r.Header.Set("X-User", "frank")
		repl := caddyhttp.NewTestReplacer(r)
		var readBefore int
		var got []byte
		err := h.ServeHTTP(httptest.NewRecorder(), r, caddyhttp.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) error {
			readBefore = cb.reads
			got, _ = io.ReadAll(r.Body)
			return nil
		}))
		zone, _ := repl.GetString("http.rate_limit_redis.zone")
		if err != nil || (readBefore > 0) != tc.read || string(got) != body || zone != tc.applies {
			t.Errorf("%s: %v, %d reads before the next handler, which read %q; zone %q", tc.path, err, readBefore, got, zone)
		}
	}
	if srv.Do("EXISTS", "rl:{frank:gpt-4o}:permodel:tb").(int64) != 1 {
		t.Fatalf("no state keyed on the model: %v", srv.Keys(t))
	}
}

// countingBody is a request body that counts its reads.
type countingBody struct {
	io.Reader
	reads int
}

func (b *countingBody) Read(p []byte) (int, error) {
	b.reads++
	return b.Reader.Read(p)
}

func (*countingBody) Close() error { return nil }

// TestModelBudgetCannotBeSplit: a budget per user and model cannot be split by how the body is
// sent. The same model sent without a Content-Type, or as text/plain, is charged to the same
// budget; a body whose model upstreams read apart ("Model" beside "model", a model that is not a
// string) is refused with 400 naming the member, and charged to no budget; a body that is not
// read as one JSON object (bytes after it) is charged to the unreadable model's budget, the
// map's default, never to the budget of the model it names.
func TestModelBudgetCannotBeSplit(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	map {http.rate_limit_redis.request.model} {model_capacity} {
		small 5
		default 2
	}
	rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-User}:{http.rate_limit_redis.request.model}
		capacity {model_capacity} 1
		refill_rate 1/1h
	}
	respond "model={http.rate_limit_redis.request.model}"`, srv.Addr))
	post := func(step, ct, body string, status int, model, limit string, hdr ...string) {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, cs.Base+"/v1/chat/completions", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-User", "alice")
		if ct != "" {
			req.Header.Set("Content-Type", ct)
		}
		resp, err := caddytest.Client(10 * time.Second).Do(req)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		want := ""
		if status == 200 {
			want = "model=" + model
		}
		caddytest.Response{Status: resp.StatusCode, Header: resp.Header, Body: string(b)}.Expect(t, step, status, want, append([]string{"X-RateLimit-Limit", limit}, hdr...)...)
	}
	big := `{"model":"big","messages":[]}`
	post("big, JSON", "application/json", big, 200, "big", "2")
	post("big, no Content-Type", "", big, 200, "big", "2")
	post("big, text/plain: the same budget, spent", "text/plain", big, 429, "big", "2")
	post("big, a form type: the same", "application/x-www-form-urlencoded", big, 429, "big", "2")

	for body, member := range map[string]string{`{"model":"small","Model":"big"}`: `"Model"`, `{"MODEL":"big","model":"small"}`: `"MODEL"`, `{"model":["big"]}`: `"model"`, `{"model":"big","model":null}`: `"model"`} {
		resp, err := caddytest.Client(10*time.Second).Post(cs.Base+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || !strings.Contains(string(b), strings.ReplaceAll(member, `"`, `\"`)) || resp.Header.Get("X-RateLimit-Limit") != "" {
			t.Errorf("ambiguous %s: %d %s (X-RateLimit-Limit %q), want 400 naming %s, no zone decided", body, resp.StatusCode, b, resp.Header.Get("X-RateLimit-Limit"), member)
		}
	}
	post("ambiguous: refused, so big's budget is untouched", "application/json", big, 429, "big", "2")
	post("bytes after the object: the unreadable model", "application/json", `{"model":"small"} x`, 200, usage.UnreadableModel, "2")
	post("the unreadable model's own budget", "application/json", `{"model":"small"} y`, 200, usage.UnreadableModel, "2")
	post("the unreadable model's budget, spent", "application/json", `{"model":"small"} z`, 429, usage.UnreadableModel, "2")
	post("small, JSON: its own budget, untouched", "application/json", `{"model":"small"}`, 200, "small", "5", "X-RateLimit-Remaining", "4")
}
