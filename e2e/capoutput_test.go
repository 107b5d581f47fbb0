package e2e_test

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	ratelimitredis "github.com/rate-limit-redis/caddy-rate-limit-redis"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/llmtest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// capZone is a zone of a 10,000-token budget per API key, refilled over a day, whose requests
// are capped to what is left (cap_output with the arguments capArgs), charged the usage of
// source.
func capZone(source, capArgs string) string {
	return `key {http.request.header.X-API-Key}
			capacity 10000
			refill_rate 10000/24h
			charge ` + source + `
			cap_output ` + capArgs + `
			hold_max 1m`
}

// postJSON posts body to url with the API key key and the header pairs given, and returns the
// response's status, header and body (decoded when gzip-compressed). An empty key sends no
// X-API-Key field.
func postJSON(t *testing.T, url, key, body string, header ...string) (int, http.Header, []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("X-API-Key", key)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableCompression: true}}
	resp, err := client.Do(req)
	if err != nil {
		t.Error(err)
		return 0, nil, nil
	}
	defer resp.Body.Close()
	var rd io.Reader = resp.Body
	if resp.Header.Get("Content-Encoding") == "gzip" {
		if rd, err = gzip.NewReader(resp.Body); err != nil {
			t.Error(err)
			return 0, nil, nil
		}
	}
	b, err := io.ReadAll(rd)
	if err != nil {
		t.Error(err)
	}
	return resp.StatusCode, resp.Header, b
}

// TestCapOutputNeverOverdrawn: 30 concurrent chat completions over 3 instances, each asking for
// 4,000 output tokens against a budget of 10,000, streaming and not, gzip and not, through an
// upstream that generates exactly the cap it receives: what the upstream reports in total is at
// most the budget (its refill over the run is under 2 tokens), every request is answered 200 or
// 429, and each 200 was capped to at least min_output.
func TestCapOutputNeverOverdrawn(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartCapped(t)
	cs := caddytest.Start(t, caddytest.Instances(srv.Addr, capZone("openai_usage", ""), up.URL))
	var wg sync.WaitGroup
	var mu sync.Mutex
	statuses := map[int]int{}
	for i := range 30 {
		wg.Go(func() {
			stream := i%2 == 1
			body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"Write a long story, number %d."}],"max_tokens":4000,"stream":%v}`, i, stream)
			var header []string
			if i%3 == 0 {
				header = []string{"Accept-Encoding", "gzip"}
			}
			status, _, out := postJSON(t, cs.Base+"/i"+strconv.Itoa(1+i%3)+"/v1/chat/completions", "shared", body, header...)
			mu.Lock()
			statuses[status]++
			mu.Unlock()
			if status == 200 && !bytes.Contains(out, []byte(`"length"`)) {
				t.Errorf("request %d: a 200 without its finish_reason length: %s", i, out)
			}
		})
	}
	wg.Wait()
	reported, caps := up.Reported()
	t.Logf("statuses %v, reported %d tokens, caps received %v", statuses, reported, caps)
	if statuses[200]+statuses[429] != 30 || statuses[200] < 2 {
		t.Fatalf("statuses %v, want 30 answered 200 or 429, at least 2 of them 200", statuses)
	}
	if reported > 10_002 {
		t.Fatalf("the upstream reported %d tokens in total, want at most the budget of 10000 (and 2 of refill)", reported)
	}
	for _, c := range caps {
		if c < ratelimitredis.DefaultMinOutput || c > 4000 {
			t.Fatalf("caps received %v, want each between min_output %d and the 4000 asked", caps, ratelimitredis.DefaultMinOutput)
		}
	}
	if used := tokensOf(t, srv, "shared", "default"); used > float64(reported)+0.1 || used < float64(reported)-2 {
		t.Fatalf("the bucket used %.1f, want what was reported, %d (less the refill)", used, reported)
	}
}

// zoneSite is a site with one rate_limit_redis zone named name, of the lines zone, on the Redis at
// redisAddr, in front of upstream.
func zoneSite(redisAddr, name, zone, upstream string) string {
	return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone %s {
			%s
		}
	}
	reverse_proxy %s`, redisAddr, name, zone, upstream)
}

// tokensOf is what zone's bucket of key has used once no charge of it is held.
func tokensOf(t *testing.T, srv *redistest.Server, key, zone string) float64 {
	t.Helper()
	return srv.BucketUsed(t, "rl:{"+key+"}:"+zone+":tb")
}

// TestCapOutputRewritesEachAPI: a request asking for more than its client has left reaches the
// upstream with its cap, in its API's field, rewritten to what is left after its prompt's bound
// (its body's length); one asking for less goes on with its own; one asking for none gets one.
func TestCapOutputRewritesEachAPI(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartCapped(t)
	for _, api := range []struct {
		name, source, path, body string
	}{
		{"chat", "openai_usage", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]%s}`},
		{"responses", "openai_usage", "/v1/responses", `{"model":"m","input":"hi"%s}`},
		{"anthropic", "anthropic_usage", "/v1/messages", `{"model":"claude","messages":[{"role":"user","content":"hi"}]%s}`},
	} {
		t.Run(api.name, func(t *testing.T) {
			cs := caddytest.Start(t, zoneSite(srv.Addr, api.name, capZone(api.source, ""), up.URL))
			field := map[string]string{"chat": "max_completion_tokens", "responses": "max_output_tokens", "anthropic": "max_tokens"}[api.name]
			// ask sends a request of a fresh client asking for cap output tokens (0: none), and
			// returns its status, the cap the upstream received and the prompt's bound.
			ask := func(key string, cap int) (int, int64, int64) {
				extra := ""
				if cap > 0 {
					extra = fmt.Sprintf(`,"%s":%d`, field, cap)
				}
				body := fmt.Sprintf(api.body, extra)
				status, _, _ := postJSON(t, cs.Base+api.path, key, body)
				_, caps := up.Reported()
				return status, caps[len(caps)-1], int64(len(body))
			}
			if status, got, _ := ask(api.name+"-a", 100); status != 200 || got != 100 {
				t.Fatalf("100 asked: %d, cap %d; want 200 and 100, as asked", status, got)
			}
			// Capped so that the prompt's bound and the cap are the client's whole budget.
			if status, got, prompt := ask(api.name+"-b", 20000); status != 200 || got != 10000-prompt {
				t.Fatalf("20000 asked: %d, cap %d; want 200 and 10000 − %d", status, got, prompt)
			}
			if status, got, prompt := ask(api.name+"-c", 0); status != 200 || got != 10000-prompt {
				t.Fatalf("none asked: %d, cap %d; want 200 and 10000 − %d", status, got, prompt)
			}
		})
	}
}

// TestCapOutputRefuses: a request whose prompt's bound and min_output do not fit in what is
// left is refused with 429 and never reaches the upstream; one whose prompt's bound is above
// the whole budget is refused without Retry-After and with X-Should-Retry: false.
func TestCapOutputRefuses(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartCapped(t)
	cs := caddytest.Start(t, zoneSite(srv.Addr, "default", capZone("openai_usage", "min_output 100"), up.URL))
	small := `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":9900}`
	if status, _, _ := postJSON(t, cs.Base+"/v1/chat/completions", "k", small); status != 200 {
		t.Fatalf("first: %d, want 200", status)
	}
	// Settled to a quarter of its 76 bytes and 9900: 81 are left, under its 76 bytes and 100.
	before, _ := up.Reported()
	status, h, _ := postJSON(t, cs.Base+"/v1/chat/completions", "k", small)
	if after, _ := up.Reported(); status != 429 || after != before || h.Get("Retry-After") == "" {
		t.Fatalf("second: %d (Retry-After %q), upstream reported %d then %d; want 429 with Retry-After, the upstream not reached", status, h.Get("Retry-After"), before, after)
	}
	huge := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 10_000) + `"}]}`
	status, h, _ = postJSON(t, cs.Base+"/v1/chat/completions", "fresh", huge)
	if status != 429 || h.Get("Retry-After") != "" || h.Get("X-Should-Retry") != "false" {
		t.Fatalf("a prompt above the budget: %d, Retry-After %q, X-Should-Retry %q; want 429, none, false", status, h.Get("Retry-After"), h.Get("X-Should-Retry"))
	}
}

// TestCapOutputWeights: with weights, the cap is what the weighted budget leaves: prompt bytes
// at 1 and output tokens at 4 units each.
func TestCapOutputWeights(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartCapped(t)
	cs := caddytest.Start(t, zoneSite(srv.Addr, "default", `key {http.request.header.X-API-Key}
			capacity 10000
			refill_rate 10000/24h
			charge openai_usage weights prompt 1 completion 4
			cap_output`, up.URL))
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":100000}`
	if status, _, _ := postJSON(t, cs.Base+"/v1/chat/completions", "w", body); status != 200 {
		t.Fatalf("status %d, want 200", status)
	}
	_, caps := up.Reported()
	if want := int64((10000 - len(body)) / 4); caps[0] != want {
		t.Fatalf("cap %d, want (10000 − %d) / 4 = %d", caps[0], len(body), want)
	}
}

// TestCapOutputUnbounded: a request with content whose tokens its bytes do not bound (an image)
// is reserved at max_cost (here the whole budget), and its output is still capped: to what
// max_cost leaves after its body's bytes, or to default_output when it asks for no cap.
func TestCapOutputUnbounded(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartCapped(t)
	up.NoCap = 10
	cs := caddytest.Start(t, zoneSite(srv.Addr, "default", capZone("openai_usage", ""), up.URL))
	img := `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://example.com/a.png"}}]}]}`
	if status, _, _ := postJSON(t, cs.Base+"/v1/chat/completions", "img", img); status != 200 {
		t.Fatalf("status %d, want 200", status)
	}
	if _, caps := up.Reported(); caps[0] != int64(10000-len(img)) {
		t.Fatalf("cap %d, want what max_cost leaves after the body's bytes: 10000 − %d", caps[0], len(img))
	}
	dflt := caddytest.Start(t, zoneSite(srv.Addr, "dflt", capZone("openai_usage", "default_output 100"), up.URL))
	if status, _, _ := postJSON(t, dflt.Base+"/v1/chat/completions", "img", img); status != 200 {
		t.Fatalf("with default_output: status %d, want 200", status)
	}
	if _, caps := up.Reported(); caps[1] != 100 {
		t.Fatalf("with default_output 100: cap %d, want 100", caps[1])
	}
}

// TestCapOutputConfig: cap_output needs a charge of usage, no cost, and a token_bucket or
// fixed_window zone; min_output 0 is refused.
func TestCapOutputConfig(t *testing.T) {
	for _, c := range []struct{ zone, want string }{
		{"capacity 100\n refill_rate 1\n cap_output", "cap_output needs charge openai_usage"},
		{"capacity 100\n refill_rate 1\n charge header X-Cost\n cap_output", "cap_output needs charge openai_usage"},
		{"capacity 100\n refill_rate 1\n cost 5\n charge openai_usage\n cap_output", "leave cost out"},
		{"algorithm sliding_window_counter\n limit 100\n window 1m\n charge openai_usage\n cap_output", "cap_output needs algorithm token_bucket or fixed_window"},
		{"capacity 100\n refill_rate 1\n charge openai_usage\n cap_output min_output 0", "min_output 0 must be between 1"},
		{"capacity 100\n refill_rate 1\n charge openai_usage\n cap_output min_output 100 default_output 50", "default_output 50 is below min_output 100"},
		{"capacity 100\n refill_rate 1\n charge openai_usage\n cap_output max 5", "expected min_output <tokens>, default_output <tokens>, unreadable refuse|pass or insert_max_tokens"},
		{"capacity 100\n refill_rate 1\n charge openai_usage\n cap_output unreadable maybe", "cap_output unreadable \"maybe\" must be refuse or pass"},
	} {
		var h ratelimitredis.Handler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("rate_limit_redis {\n zone z {\n " + c.zone + "\n }\n}"))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want an error containing %q", c.zone, err, c.want)
		}
	}
}

// TestCapOutputMissingAtMostReserved: a successful response that reports no usage is charged
// missing, but at most what its request reserved, which bounds what it used: its prompt's bound
// and its cap, here 100.
func TestCapOutputMissingAtMostReserved(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartCapped(t)
	cs := caddytest.Start(t, zoneSite(srv.Addr, "default", capZone("openai_usage", ""), up.URL))
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":100}`
	if status, _, _ := postJSON(t, cs.Base+"/v1/chat/completions", "m", body, "X-No-Usage", "1"); status != 200 {
		t.Fatalf("status %d, want 200", status)
	}
	want := float64(len(body) + 100)
	if used := tokensOf(t, srv, "m", "default"); used > want || used < want-1 {
		t.Fatalf("charged %.1f, want the reservation, %v (not max_cost, 10000)", used, want)
	}
}

// TestCapOutputBesideAnUnboundedZone: a zone whose bound cannot be known (its weight's
// placeholder is unusable) reserves its max_cost, and the request is still capped to what the
// other zone with cap_output granted.
func TestCapOutputBesideAnUnboundedZone(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartCapped(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone unpriced {
			key {http.request.header.X-API-Key}
			capacity 100000
			refill_rate 100000/24h
			charge openai_usage weights prompt 1 completion {http.request.header.X-Price}
			cap_output
		}
		zone small {
			key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/24h
			charge openai_usage
			cap_output
		}
	}
	reverse_proxy %s`, srv.Addr, up.URL))
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4000}`
	if status, _, _ := postJSON(t, cs.Base+"/v1/chat/completions", "u", body, "X-Price", "lots"); status != 200 {
		t.Fatalf("status %d, want 200", status)
	}
	if _, caps := up.Reported(); caps[0] != int64(1000-len(body)) {
		t.Fatalf("cap %d, want what zone small granted: 1000 − %d", caps[0], len(body))
	}
}
