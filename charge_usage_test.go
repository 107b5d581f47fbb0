package ratelimitredis

import (
	"bufio"
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/usage"
)

// The tests of security review III's findings 2, 3 and 6 (../shared/repro/security-3:
// t_charge.sh b, c, d, e, f, g, h and t_holdmax.sh), through Caddy in front of openAIUpstream,
// with docs/charging.md's LLM zone (openAIZone).

// openAIUsage is the usage every completion of openAIUpstream reports.
const openAIUsage = `{"prompt_tokens":1000,"completion_tokens":4000,"total_tokens":5000}`

// openAIUpstream is an OpenAI-compatible upstream (upstream.py of the reproductions), a real
// HTTP server: completions of 5000 tokens, compressed as the request's Accept-Encoding asks
// (zstd, gzip, deflate; ?raw=1: raw deflate), as JSON or, for "stream": true, as a chat
// completions event stream whose usage chunk comes only with stream_options.include_usage. It
// records what it last received and the bytes of the last body it sent, as sent.
type openAIUpstream struct {
	*httptest.Server
	gate chan struct{} // when set, a stream waits for it after its first event

	mu     sync.Mutex
	accept []string // the Accept-Encoding of every request
	body   []byte   // the last request's body
	sent   []byte   // the last response's body, as sent
}

func startOpenAI(t *testing.T) *openAIUpstream {
	u := &openAIUpstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.Close)
	return u
}

// nopFlusher is a compressor that needs no flushing.
type nopFlusher struct{ io.Writer }

func (nopFlusher) Flush() error { return nil }
func (nopFlusher) Close() error { return nil }

func (u *openAIUpstream) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	ae := r.Header.Get("Accept-Encoding")
	u.mu.Lock()
	u.accept, u.body = append(u.accept, ae), body
	u.mu.Unlock()
	var sent bytes.Buffer
	defer func() {
		u.mu.Lock()
		u.sent = sent.Bytes()
		u.mu.Unlock()
	}()
	out := io.MultiWriter(w, &sent)
	var enc interface {
		io.WriteCloser
		Flush() error
	} = nopFlusher{out}
	switch {
	case strings.Contains(ae, "zstd"):
		w.Header().Set("Content-Encoding", "zstd")
		zw, _ := zstd.NewWriter(out)
		enc = zw
	case strings.Contains(ae, "gzip"):
		w.Header().Set("Content-Encoding", "gzip")
		enc = gzip.NewWriter(out)
	case strings.Contains(ae, "deflate") && r.URL.Query().Get("raw") != "":
		w.Header().Set("Content-Encoding", "deflate")
		fw, _ := flate.NewWriter(out, flate.DefaultCompression)
		enc = fw
	case strings.Contains(ae, "deflate"):
		w.Header().Set("Content-Encoding", "deflate")
		enc = zlib.NewWriter(out)
	case strings.Contains(ae, "br"):
		w.Header().Set("Content-Encoding", "br") // never asked for through the zone
	}
	defer enc.Close()
	rc := http.NewResponseController(w)
	switch r.URL.Path {
	case "/v1/echo": // any upstream that reflects the client's JSON
		w.Header().Set("Content-Type", "application/json")
		_, _ = enc.Write(body)
		return
	case "/v1/reflect": // the client's JSON after the upstream's own usage
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(enc, `{"id":"x","usage":%s,"echo":%s}`, openAIUsage, body)
		return
	case "/v1/neg":
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(enc, `{"usage":{"prompt_tokens":-100000,"completion_tokens":100001}}`)
		return
	case "/v1/small":
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(enc, `{"usage":{"total_tokens":1}}`)
		return
	case "/v1/nousage":
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(enc, `{"id":"x","choices":[]}`)
		return
	case "/v1/error":
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(enc, `{"error":{"message":"overloaded"}}`)
		return
	}
	var req struct {
		Stream        bool `json:"stream"`
		StreamOptions struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	if json.Unmarshal(body, &req) != nil {
		req.Stream = bytes.Contains(body, []byte(`"stream":true`)) // lenient: a trailing comma is fine
	}
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(enc, `{"id":"x","object":"chat.completion","choices":[{"message":{"content":"%s"}}],"usage":%s}`, strings.Repeat("y", 2000), openAIUsage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	event := func(data string) {
		fmt.Fprintf(enc, "data: %s\n\n", data)
		_ = enc.Flush()
		_ = rc.Flush()
	}
	event(`{"choices":[{"delta":{"content":"Hel"}}]}`)
	if u.gate != nil {
		select {
		case <-u.gate:
		case <-time.After(5 * time.Second):
		}
	}
	event(`{"choices":[{"delta":{"content":"lo"}}]}`)
	if req.StreamOptions.IncludeUsage {
		event(`{"choices":[],"usage":` + openAIUsage + `}`)
	}
	event("[DONE]")
}

// last returns what the upstream last received and sent.
func (u *openAIUpstream) last() (accept string, body, sent []byte) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.accept[len(u.accept)-1], u.body, u.sent
}

// openAIZone is docs/charging.md's LLM zone (security-3's site S8), in front of up, with extra
// lines.
func openAIZone(redisAddr, up, extra string) string {
	return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone tokens {
			key {http.request.header.Authorization}
			capacity 100000
			refill_rate 100000/24h
			cost 500
			hold_max 30m
			%s
		}
	}
	reverse_proxy %s`, redisAddr, extra, up)
}

// rawResponse is a response as it reached the client, its body as sent (never decoded).
type rawResponse struct {
	status int
	header http.Header
	body   []byte
}

// send sends a request of method to cs with key in Authorization, the header pairs given and
// body (GET when nil), and returns the response undecoded.
func (cs *caddyServer) send(path, key string, body []byte, header ...string) rawResponse {
	cs.t.Helper()
	method := http.MethodGet
	var rd io.Reader
	if body != nil {
		method, rd = http.MethodPost, bytes.NewReader(body)
	}
	req, err := http.NewRequest(method, cs.base+path, rd)
	if err != nil {
		cs.t.Fatal(err)
	}
	req.Header.Set("Authorization", key)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableCompression: true}}
	resp, err := client.Do(req)
	if err != nil {
		cs.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		cs.t.Fatalf("%s %s: reading the body: %v", method, path, err)
	}
	return rawResponse{status: resp.StatusCode, header: resp.Header, body: b}
}

// tokensUsed is what the tokens zone's bucket of key has used, once no charge of it is held:
// what it was charged (less the refill since, under 0.1 token in these tests' few seconds... or
// a few tokens for the slow ones).
func tokensUsed(t *testing.T, srv *redistest.Server, key string) float64 {
	t.Helper()
	state := "rl:{" + key + "}:tokens:tb"
	var u float64
	waitFor(t, 5*time.Second, "the charge of "+key+" settled", func() bool {
		m, _ := srv.Do("HGETALL", state).(map[any]any)
		_, held := m["h"]
		u, _ = strconv.ParseFloat(fmt.Sprint(m["u"]), 64)
		return m != nil && !held
	})
	return u
}

// charged checks that key's bucket was charged want tokens, less the refill of the request's
// time in flight: at most 2 tokens, 1.7s of openAIZone's 100000/24h (a request that streams
// megabytes under -race on a busy machine takes that long).
func charged(t *testing.T, srv *redistest.Server, step, key string, want float64) {
	t.Helper()
	if u := tokensUsed(t, srv, key); u > want || u < want-2 {
		t.Fatalf("%s: charged %v, want %v", step, u, want)
	}
}

// TestChargeCompressedUsage (security review III, finding 2, t_charge.sh b): a client accepting
// a compression the upstream uses is charged the usage reported, 5000, not the reservation
// (500): gzip (the OpenAI SDKs' default), deflate (zlib and raw) and zstd bodies are decoded as
// they pass, and the client receives exactly the bytes the upstream sent. Brotli, which the
// module does not decode, is taken off the Accept-Encoding the upstream sees, which then answers
// in another coding the client accepts (or none).
func TestChargeCompressedUsage(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	cs := startCaddy(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	chat := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	for _, tc := range []struct {
		name, accept, path  string
		upstreamGot, coding string // the Accept-Encoding the upstream gets, the coding the client gets
	}{
		{"gzip", "gzip", "/v1/chat/completions", "gzip", "gzip"},
		{"gzip, deflate (Python SDK)", "gzip, deflate", "/v1/chat/completions", "gzip, deflate", "gzip"},
		{"deflate", "deflate", "/v1/chat/completions", "deflate", "deflate"},
		{"raw deflate", "deflate", "/v1/chat/completions?raw=1", "deflate", "deflate"},
		{"zstd", "zstd", "/v1/chat/completions", "zstd", "zstd"},
		{"br, gzip (Node SDK)", "gzip, deflate, br", "/v1/chat/completions", "gzip, deflate", "gzip"},
		{"br only", "br;q=1.0, *;q=0.1", "/v1/chat/completions", "identity", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "gz-" + strings.NewReplacer(" ", "", ",", "", "(", "", ")", "").Replace(tc.name)
			r := cs.send(tc.path, key, chat, "Accept-Encoding", tc.accept)
			accept, _, sent := up.last()
			if r.status != 200 || r.header.Get("Content-Encoding") != tc.coding {
				t.Fatalf("%d, Content-Encoding %q; want 200, %q", r.status, r.header.Get("Content-Encoding"), tc.coding)
			}
			if accept != tc.upstreamGot {
				t.Fatalf("the upstream got Accept-Encoding %q, want %q", accept, tc.upstreamGot)
			}
			if !bytes.Equal(r.body, sent) {
				t.Fatalf("the client got %d bytes, not the %d the upstream sent", len(r.body), len(sent))
			}
			charged(t, srv, tc.name, key, 5000)
		})
	}
}

// TestChargeCompressedStream: through Caddy, a client accepting gzip streams a completion from
// an upstream that compresses it (flushing each event): the first event reaches the client
// before the upstream sends the second (the upstream waits for the client to have read it), the
// client receives exactly the bytes the upstream sent, and it is charged the usage reported.
func TestChargeCompressedStream(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	up.gate = make(chan struct{})
	cs := startCaddy(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	req, _ := http.NewRequest(http.MethodPost, cs.base+"/v1/chat/completions",
		strings.NewReader(`{"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true}}`))
	req.Header.Set("Authorization", "gzstream")
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept-Encoding", "gzip")
	resp, err := (&http.Client{Transport: &http.Transport{DisableCompression: true}}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.Header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("Content-Encoding %q, want gzip", resp.Header.Get("Content-Encoding"))
	}
	var raw bytes.Buffer
	first := make(chan string, 1)
	zr := make(chan *bufio.Reader, 1)
	go func() {
		gz, err := gzip.NewReader(io.TeeReader(resp.Body, &raw))
		if err != nil {
			first <- err.Error()
			return
		}
		br := bufio.NewReader(gz)
		line, _ := br.ReadString('\n')
		first <- line
		zr <- br
	}()
	select {
	case line := <-first:
		if !strings.Contains(line, `"Hel"`) {
			t.Fatalf("first event: %q", line)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the first event did not arrive before the upstream sent the second")
	}
	close(up.gate)
	rest, err := io.ReadAll(<-zr)
	if err != nil || !strings.Contains(string(rest), `"total_tokens":5000`) {
		t.Fatalf("rest of the stream: %q, %v", rest, err)
	}
	if _, _, sent := up.last(); !bytes.Equal(raw.Bytes(), sent) {
		t.Fatalf("the client got %d bytes, not the %d the upstream sent", raw.Len(), len(sent))
	}
	charged(t, srv, "gzip stream", "gzstream", 5000)
}

// TestChargeStreamWithoutIncludeUsage (security review III, finding 2, t_charge.sh c): a
// streaming chat completion whose client did not ask for stream_options.include_usage is asked
// for it on its way to the upstream, and charged the usage reported (5000), not the reservation
// (500); a request that needs no change, or cannot be read, reaches the upstream byte for byte
// as sent, and a stream that then reports no usage is charged the zone's missing amount.
func TestChargeStreamWithoutIncludeUsage(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	cs := startCaddy(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total missing 8000"))
	big := `{"model":"m","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", usage.MaxIncludeUsageBody) + `"}]}`
	for _, tc := range []struct {
		name, body  string
		upstreamGot string  // the body the upstream gets; "" when unchanged
		want        float64 // charged
	}{
		{"without stream_options", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`,
			`{"stream_options":{"include_usage":true},"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`, 5000},
		{"include_usage false", ` {"model":"m", "stream_options": {"include_usage": false, "x": 1}, "messages":[], "stream": true}`,
			` {"model":"m", "stream_options": {"include_usage":true,"x":1}, "messages":[], "stream": true}`, 5000},
		{"stream_options null", `{"stream_options":null,"messages":[],"stream":true}`,
			`{"stream_options":{"include_usage":true},"messages":[],"stream":true}`, 5000},
		{"include_usage true", `{"messages":[],"stream":true,"stream_options":{"include_usage":true}}`, "", 5000},
		{"not streamed", `{"messages":[],"stream":false}`, "", 5000},
		{"stream false last", `{"messages":[],"stream":true,"stream":false}`, "", 5000},
		{"not JSON (a trailing comma)", `{"messages":[],"stream":true,}`, "", 8000},
		{"too large", big, "", 8000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "s-" + strings.NewReplacer(" ", "-", "(", "", ")", "").Replace(tc.name)
			if r := cs.send("/v1/chat/completions", key, []byte(tc.body)); r.status != 200 {
				t.Fatalf("%d %q", r.status, r.body)
			}
			_, got, _ := up.last()
			want := tc.upstreamGot
			if want == "" {
				want = tc.body
			}
			if string(got) != want {
				t.Fatalf("the upstream got %.200q, want %.200q", got, want)
			}
			charged(t, srv, tc.name, key, tc.want)
		})
	}
}

// TestChargeUsageNotSteerable (security review III, finding 3, t_charge.sh d, e, f, g): the
// client's JSON reflected by the upstream cannot set its charge; a usage with a negative part is
// charged the zone's missing amount, never less.
func TestChargeUsageNotSteerable(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	cs := startCaddy(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total missing 8000"))
	for _, tc := range []struct {
		name, path, body string
		want             float64
	}{
		{"d: the client's usage after the upstream's", "/v1/reflect", `{"usage":{"total_tokens":0}}`, 5000},
		{`e: a key a\"usage after the usage`, "/v1/echo", `{"usage":{"total_tokens":5000},"meta":{"a\"usage":{"total_tokens":0}}}`, 5000},
		{"f: usage in a string", "/v1/echo", `{"usage":{"total_tokens":5000},"c":"\"usage\":{\"total_tokens\":0}"}`, 5000},
		{"g: negative prompt_tokens", "/v1/neg", `{}`, 8000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "steer-" + tc.name[:1]
			if r := cs.send(tc.path, key, []byte(tc.body)); r.status != 200 {
				t.Fatalf("%d %q", r.status, r.body)
			}
			charged(t, srv, tc.name, key, tc.want)
		})
	}
}

// TestChargeAmountCapped (security review III, finding 6, t_charge.sh h): a usage of 2^63 − 1
// tokens on a bucket of 100,000 refilled in 24 h is charged max_cost (the capacity): the key's
// TTL is at most two windows (48 h), not 285,000 years, and the capping is counted.
func TestChargeAmountCapped(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	cs := startCaddy(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	before := testutil.ToFloat64(metrics.chargeCapped.WithLabelValues("tokens"))
	if r := cs.send("/v1/echo", "huge", []byte(`{"usage":{"total_tokens":9223372036854775807}}`)); r.status != 200 {
		t.Fatalf("%d %q", r.status, r.body)
	}
	charged(t, srv, "2^63 − 1 reported", "huge", 100000)
	if ttl := srv.Do("PTTL", "rl:{huge}:tokens:tb").(int64); ttl > 48*3600*1000 {
		t.Fatalf("TTL %d ms, want at most two windows (172,800,000 ms)", ttl)
	}
	if got := testutil.ToFloat64(metrics.chargeCapped.WithLabelValues("tokens")) - before; got != 1 {
		t.Fatalf("charge_capped_total grew by %v, want 1", got)
	}
	r := cs.send("/v1/chat/completions", "huge", []byte(`{"messages":[]}`))
	if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); r.status != 429 || ra > 24*3600+1 {
		t.Fatalf("next request: %d, Retry-After %q; want 429 within a window", r.status, r.header.Get("Retry-After"))
	}
}

// TestChargeLateResponse (security review III, finding 2, t_holdmax.sh): a 5000-token response
// that completes after hold_max (1 s), while other requests of the client touch its bucket (and
// so commit its hold as the 500 reserved), is charged 5000 all the same, and no settlement
// fails for want of its hold.
func TestChargeLateResponse(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	up.gate = make(chan struct{})
	cs := startCaddy(t, strings.Replace(openAIZone(srv.Addr, up.URL, "charge openai_usage total"), "hold_max 30m", "hold_max 1s", 1))
	noHold := testutil.ToFloat64(metrics.settleFailures.WithLabelValues("no_hold"))
	slow := make(chan rawResponse, 1)
	go func() {
		slow <- cs.send("/v1/chat/completions", "late", []byte(`{"messages":[],"stream":true,"stream_options":{"include_usage":true}}`))
	}()
	state := "rl:{late}:tokens:tb"
	waitFor(t, 5*time.Second, "the slow request's hold", func() bool {
		m, _ := srv.Do("HGETALL", state).(map[any]any)
		_, held := m["h"]
		return held
	})
	others := 0
	waitFor(t, 10*time.Second, "another request to commit the slow one's hold, past hold_max", func() bool {
		if r := cs.send("/v1/small", "late", []byte(`{}`)); r.status != 200 {
			t.Fatalf("other request: %d", r.status)
		}
		others++
		m, _ := srv.Do("HGETALL", state).(map[any]any)
		_, held := m["h"]
		return !held
	})
	close(up.gate)
	if r := <-slow; r.status != 200 || !strings.Contains(string(r.body), `"total_tokens":5000`) {
		t.Fatalf("slow request: %d %q", r.status, r.body)
	}
	// 5000 for the slow one and 1 for each other, less the refill of a few seconds.
	want := 5000 + float64(others)
	if u := tokensUsed(t, srv, "late"); u > want || u < want-20 {
		t.Fatalf("charged %v after %d other requests, want %v", u, others, want)
	}
	if got := testutil.ToFloat64(metrics.settleFailures.WithLabelValues("no_hold")) - noHold; got != 0 {
		t.Fatalf("settle_failures_total{reason=no_hold} grew by %v, want 0", got)
	}
}

// TestChargeMissing: a successful response that reports no usage is charged the zone's missing
// amount (default: max_cost, itself the capacity by default), counted in charge_missing_total
// (exported at 0 from the load of a zone that charges) and logged at most once a minute per
// zone; an unsuccessful one keeps the reservation.
func TestChargeMissing(t *testing.T) {
	srv := redistest.Start(t)
	seven := int64(700)
	zone := func(name string, maxCost int64, missing *int64) *Zone {
		return &Zone{Name: name, Key: []string{"{http.request.header.X-Client}"}, Capacity: NumberOf(10000), RefillRate: NumberOf(10000.0 / 3600),
			Cost: "100", MaxCost: NumberOf(maxCost), Charge: &Charge{Source: ChargeOpenAIUsage, Missing: missing}}
	}
	h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}},
		Zones: []*Zone{zone("mdefault", 0, nil), zone("mmaxcost", 2000, nil), zone("mset", 0, &seven)}})
	core, logs := observer.New(zapcore.WarnLevel)
	h.logger = zap.New(core)
	reg := prometheus.NewRegistry()
	if err := registerMetrics(reg); err != nil {
		t.Fatal(err)
	}
	mfs, _ := reg.Gather()
	exported := map[string]bool{}
	for _, mf := range mfs {
		if mf.GetName() == "caddy_rate_limit_redis_charge_missing_total" {
			for _, m := range mf.GetMetric() {
				exported[m.GetLabel()[0].GetValue()] = true
			}
		}
	}
	for _, z := range []string{"mdefault", "mmaxcost", "mset"} {
		if !exported[z] {
			t.Fatalf("charge_missing_total{zone=%q} not exported at load: %v", z, exported)
		}
	}
	before := testutil.ToFloat64(metrics.chargeMissing.WithLabelValues("mdefault"))
	respond := func(client string, status int, body string) {
		t.Helper()
		r := clientRequest(client)
		caddyhttp.NewTestReplacer(r) // puts itself in r's context
		w := httptest.NewRecorder()
		err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, err := io.WriteString(w, body)
			return err
		}))
		if err != nil || w.Code != status {
			t.Fatalf("%s: %d %v", client, w.Code, err)
		}
	}
	respond("a", 200, `{"id":"x","choices":[]}`)
	respond("b", 200, `{"usage":{"total_tokens":-1}}`)
	respond("c", 503, `{"error":{}}`)
	for _, tc := range []struct {
		zone, client string
		want         float64
	}{
		{"mdefault", "a", 10000}, {"mmaxcost", "a", 2000}, {"mset", "a", 700},
		{"mdefault", "b", 10000}, {"mset", "b", 700},
		{"mdefault", "c", 100}, {"mset", "c", 100},
	} {
		u, _ := strconv.ParseFloat(fmt.Sprint(srv.Do("HGET", "rl:{"+tc.client+"}:"+tc.zone+":tb", "u")), 64)
		if u > tc.want || u < tc.want-0.1 {
			t.Errorf("zone %s, client %s: charged %v, want %v", tc.zone, tc.client, u, tc.want)
		}
	}
	if got := testutil.ToFloat64(metrics.chargeMissing.WithLabelValues("mdefault")) - before; got != 2 {
		t.Errorf("charge_missing_total{zone=mdefault} grew by %v, want 2", got)
	}
	perZone := map[string]int{}
	for _, e := range logs.All() {
		perZone[fmt.Sprint(e.ContextMap()["zone"])]++
	}
	if len(perZone) != 3 || perZone["mdefault"] != 1 || perZone["mmaxcost"] != 1 || perZone["mset"] != 1 {
		t.Errorf("warnings per zone: %v, want one for each of the 3 zones", perZone)
	}
}

// TestChargeClientLeavesBeforeResponse: a client that hangs up while the upstream is still
// working on a completion that sends nothing until it is done (a non-streaming completion of a
// long prompt) is charged the zone's missing amount (by default max_cost, the capacity: 100000),
// as a successful response without usage is, not the reservation (500): the upstream may have
// done all of its work. It is counted in charge_missing_total.
func TestChargeClientLeavesBeforeResponse(t *testing.T) {
	srv := redistest.Start(t)
	arrived := make(chan struct{}, 1)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body) // read to its end, so that the server sees the connection close
		arrived <- struct{}{}
		select {
		case <-r.Context().Done(): // the proxy gave up: its client left
			return
		case <-time.After(10 * time.Second):
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","choices":[],"usage":`+openAIUsage+`}`)
	}))
	t.Cleanup(up.Close)
	cs := startCaddy(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	before := testutil.ToFloat64(metrics.chargeMissing.WithLabelValues("tokens"))

	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-arrived // the upstream is working on it
		cancel()
	}()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, cs.base+"/v1/chat/completions", strings.NewReader(`{"model":"m","messages":[]}`))
	req.Header.Set("Authorization", "leaver")
	req.Header.Set("Content-Type", "application/json")
	if resp, err := servingClient(0).Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("got %d; the client was to hang up before the response", resp.StatusCode)
	}
	charged(t, srv, "a client that hung up before the response", "leaver", 100000)
	if d := testutil.ToFloat64(metrics.chargeMissing.WithLabelValues("tokens")) - before; d != 1 {
		t.Fatalf("charge_missing_total grew by %v, want 1", d)
	}
}

// laxStream reads a request's "stream" as an upstream validating it with pydantic in lax mode
// does (vLLM): true, the number 1, or one of pydantic's true strings in any case.
func laxStream(v any) bool {
	switch v := v.(type) {
	case bool:
		return v
	case float64:
		return v == 1
	case string:
		return slices.Contains([]string{"1", "t", "y", "on", "yes", "true"}, strings.ToLower(v))
	}
	return false
}

// TestChargeDocsLLMExample: docs/charging.md's LLM example, as written there, in front of a
// vLLM-like upstream (it reads "stream" as pydantic does, and reports a stream's usage only when
// asked for it) whose completion has a 90,000-token prompt and a 10,000-token completion:
// whatever the client does to its streaming request, it is charged at least the 100,000 it
// used. A request is charged its usage; "stream" as 1, "yes" or "True" is read as the upstream
// reads it, so the request is asked for the usage; a body over 1 MiB (whitespace) is not
// rewritten, and its stream without usage is charged the example's missing amount, which must
// then be at least the largest total (in the tokens zone, whose max_cost is below it, 100,000).
func TestChargeDocsLLMExample(t *testing.T) {
	var site string
	for _, b := range docBlocks(t, "caddyfile") {
		if strings.HasPrefix(b.where, "docs/charging.md:") && strings.HasPrefix(b.text, "llm.example.com {") {
			site = b.text
		}
	}
	if site == "" {
		t.Fatal("docs/charging.md has no Caddyfile example of site llm.example.com")
	}
	srv := redistest.Start(t)
	var mu sync.Mutex
	var got []byte // the body the upstream last received
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = body
		mu.Unlock()
		var req map[string]any
		if json.Unmarshal(body, &req) != nil {
			http.Error(w, "bad JSON", http.StatusBadRequest)
			return
		}
		usage := `{"prompt_tokens":90000,"completion_tokens":10000,"total_tokens":100000}`
		if !laxStream(req["stream"]) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"x","choices":[],"usage":`+usage+`}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"tok\"}}]}\n\n")
		if opts, _ := req["stream_options"].(map[string]any); opts != nil && laxStream(opts["include_usage"]) {
			_, _ = io.WriteString(w, "data: {\"choices\":[],\"usage\":"+usage+"}\n\n")
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(up.Close)
	// The site's contents, with the test's Redis and upstream.
	body := site[strings.Index(site, "\n")+1 : strings.LastIndex(site, "}")]
	body = strings.Replace(body, "rate_limit_redis {", "rate_limit_redis {\n\t\tredis {\n\t\t\taddress "+srv.Addr+"\n\t\t}", 1)
	body = strings.Replace(body, "reverse_proxy localhost:8000", "reverse_proxy "+up.URL, 1)
	cs := startCaddy(t, body)

	padded := `{"model":"m","messages":[{"role":"user","content":"a long prompt"}],"stream":true` + strings.Repeat(" ", usage.MaxIncludeUsageBody) + `}`
	for _, tc := range []struct {
		name, body string
		rewritten  bool // the upstream is asked for the usage
	}{
		{"stream true", `{"model":"m","messages":[],"stream":true}`, true},
		{"stream 1", `{"model":"m","messages":[],"stream":1}`, true},
		{"stream 1.0", `{"model":"m","messages":[],"stream":1.0}`, true},
		{`stream "yes"`, `{"model":"m","messages":[],"stream":"yes"}`, true},
		{`stream "True"`, `{"model":"m","messages":[],"stream":"True"}`, true},
		{`stream "on"`, `{"model":"m","messages":[],"stream":"on"}`, true},
		{"stream 0 (not streamed)", `{"model":"m","messages":[],"stream":0}`, false},
		{`stream "no" (not streamed)`, `{"model":"m","messages":[],"stream":"no"}`, false},
		{"body over 1 MiB", padded, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv.Do("DEL", "rl:{127.0.0.1}:tokens_ip:tb") // the address's budget: each case is a new day
			key := "docs-" + strings.NewReplacer(" ", "-", `"`, "", "(", "", ")", "", ".", "").Replace(tc.name)
			if r := cs.send("/v1/chat/completions", key, []byte(tc.body)); r.status != 200 {
				t.Fatalf("%d %q", r.status, r.body)
			}
			mu.Lock()
			asked := bytes.Contains(got, []byte(`"stream_options":{"include_usage":true}`))
			mu.Unlock()
			if asked != tc.rewritten {
				t.Fatalf("the upstream was asked for the usage: %t, want %t", asked, tc.rewritten)
			}
			charged(t, srv, tc.name, key, 100000)
		})
	}
}
