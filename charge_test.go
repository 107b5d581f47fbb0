package ratelimitredis

// Charging after the response (charge.go): count_status, charge header and charge
// openai_usage through Caddy in front of test upstreams, the usage of compressed bodies and the
// bounds of their decoding, holds, and the charged placeholder.

import (
	"bufio"
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/crypto/bcrypt"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/llmtest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/usage"
)

// llmUpstream is a real upstream behind reverse_proxy: /login answers 401 unless the password
// is right; /chat answers in OpenAI format, reporting `tokens` total tokens, as one JSON body
// or, with ?stream=1, as a chat completions event stream whose last chunk carries the usage.
type llmUpstream struct {
	*httptest.Server
	tokens   int64
	delay    time.Duration // before answering /chat
	hits     atomic.Int64  // requests that reached it
	inflight atomic.Int64
	peak     atomic.Int64 // the most requests in flight at once
	// gate, when set, is waited for between a stream's first event and the rest.
	gate chan struct{}
	// bodyBytes, when > 0, pads the JSON body of /chat to about that size, the usage last.
	bodyBytes int
}

func startUpstream(t *testing.T, tokens int64) *llmUpstream {
	u := &llmUpstream{tokens: tokens}
	u.Server = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.Close)
	return u
}

func (u *llmUpstream) serve(w http.ResponseWriter, r *http.Request) {
	u.hits.Add(1)
	n := u.inflight.Add(1)
	defer u.inflight.Add(-1)
	for p := u.peak.Load(); n > p && !u.peak.CompareAndSwap(p, n); p = u.peak.Load() {
	}
	if strings.HasSuffix(r.URL.Path, "/login") {
		if r.Header.Get("X-Password") != "right" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		_, _ = io.WriteString(w, "welcome")
		return
	}
	time.Sleep(u.delay)
	usage := fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}`, u.tokens/3, u.tokens-u.tokens/3, u.tokens)
	if r.URL.Query().Get("stream") == "" {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"`)
		pad := strings.Repeat("abcdefgh", 8192)
		for sent := 0; sent < u.bodyBytes; sent += len(pad) {
			_, _ = io.WriteString(w, pad)
		}
		_, _ = io.WriteString(w, `"}}],"usage":`+usage+`}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	rc := http.NewResponseController(w)
	_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}],\"usage\":null}\n\n")
	_ = rc.Flush()
	if u.gate != nil {
		select {
		case <-u.gate:
		case <-time.After(5 * time.Second):
		}
	}
	_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}],\"usage\":null}\n\n")
	_, _ = io.WriteString(w, "data: {\"choices\":[],\"usage\":"+usage+"}\n\ndata: [DONE]\n\n")
}

// TestCountStatusLogin: a login zone of 3 counting 401s only, for every algorithm: 10 correct
// logins all pass; then 3 wrong ones get the upstream's 401, and the 4th wrong one and a correct
// one are denied (the client is blocked until the window moves). Over 3 instances, 30
// concurrent wrong attempts of a fresh client: exactly 3 reach the upstream.
func TestCountStatusLogin(t *testing.T) {
	srv := redistest.Start(t)
	up := startUpstream(t, 0)
	for name, zone := range map[string]string{
		"sliding_window":         "algorithm sliding_window\n\t\t\tlimit 3\n\t\t\twindow 1h",
		"token_bucket":           "capacity 3\n\t\t\trefill_rate 3/1h",
		"fixed_window":           "algorithm fixed_window\n\t\t\tlimit 3\n\t\t\tperiod month",
		"sliding_window_counter": "algorithm sliding_window_counter\n\t\t\tlimit 3\n\t\t\twindow 366d",
	} {
		t.Run(name, func(t *testing.T) {
			cs := caddytest.Start(t, caddytest.Instances(srv.Addr, "key {http.request.header.X-Client}\n\t\t\tcount_status 401\n\t\t\t"+zone, up.URL))
			client := "alice-" + name
			if got := cs.Statuses(10, "/i1/login", "X-Client", client, "X-Password", "right"); got != strings.TrimSpace(strings.Repeat("200 ", 10)) {
				t.Fatalf("10 correct logins: %s", got)
			}
			if got := cs.Statuses(3, "/i2/login", "X-Client", client, "X-Password", "wrong"); got != "401 401 401" {
				t.Fatalf("3 wrong logins: %s", got)
			}
			if r := cs.Get("/i3/login", "X-Client", client, "X-Password", "wrong"); r.Status != 429 || r.Header.Get("Retry-After") == "" {
				t.Fatalf("4th wrong login: %d %v, want 429 with Retry-After", r.Status, r.Header)
			}
			if r := cs.Get("/i1/login", "X-Client", client, "X-Password", "right"); r.Status != 429 {
				t.Fatalf("a correct login after 3 wrong ones: %d, want 429", r.Status)
			}

			fresh := "mallory-" + name
			before := up.hits.Load()
			var wg sync.WaitGroup
			codes := make(chan int, 30)
			for i := range 30 {
				wg.Go(func() {
					req, _ := http.NewRequest(http.MethodGet, cs.Base+"/i"+strconv.Itoa(1+i%3)+"/login", nil)
					req.Header.Set("X-Client", fresh)
					req.Header.Set("X-Password", "wrong")
					resp, err := caddytest.Client(0).Do(req)
					if err != nil {
						t.Error(err)
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					codes <- resp.StatusCode
				})
			}
			wg.Wait()
			close(codes)
			count := map[int]int{}
			for c := range codes {
				count[c]++
			}
			if got := up.hits.Load() - before; got != 3 || count[401] != 3 || count[429] != 27 {
				t.Fatalf("30 concurrent wrong attempts: %d reached the upstream, statuses %v; want exactly 3 (401) and 27 × 429", got, count)
			}
		})
	}
}

// TestCountStatusBasicAuth: the login route of docs/charging.md: basic_auth answers a wrong password with
// an error (written by Caddy after the handler returns), which count_status counts; right ones
// are given back.
func TestCountStatusBasicAuth(t *testing.T) {
	srv := redistest.Start(t)
	hash, err := bcrypt.GenerateFromPassword([]byte("right"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone login {
			algorithm sliding_window
			limit 3
			window 15m
			count_status 401
		}
	}
	basic_auth {
		alice %s
	}
	respond "welcome"`, srv.Addr, hash))
	login := func(password string) int {
		req, _ := http.NewRequest(http.MethodGet, cs.Base+"/", nil)
		req.SetBasicAuth("alice", password)
		resp, err := caddytest.Client(0).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	var got []string
	for _, pw := range []string{"right", "right", "right", "right", "wrong", "wrong", "wrong", "wrong", "right"} {
		got = append(got, strconv.Itoa(login(pw)))
	}
	if s := strings.Join(got, " "); s != "200 200 200 200 401 401 401 429 429" {
		t.Fatalf("got %s, want 200 200 200 200 401 401 401 429 429", s)
	}
}

// TestChargeOpenAIUsage: capacity 1000, 1000 tokens per hour, a reservation of 100 per request
// and an upstream reporting 300 tokens: exactly 4 requests are admitted (the 4th puts the bucket
// 200 in debt) and the 5th is denied with Retry-After 1080 s (the debt and its cost, 300 tokens
// at 1000/h), for a JSON body and for a chat completions stream alike.
func TestChargeOpenAIUsage(t *testing.T) {
	srv := redistest.Start(t)
	up := startUpstream(t, 300)
	cs := caddytest.Start(t, caddytest.Instances(srv.Addr, `key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage total`, up.URL))
	for _, path := range []string{"/i1/chat", "/i2/chat?stream=1"} {
		key := "key-" + path
		charged := testutil.ToFloat64(metrics.charged.WithLabelValues("default"))
		for i := range 4 {
			r := cs.Get(path, "X-API-Key", key)
			if r.Status != 200 || !strings.Contains(r.Body, `"total_tokens":300`) {
				t.Fatalf("%s: request %d: %d %q", path, i+1, r.Status, r.Body)
			}
		}
		if got := testutil.ToFloat64(metrics.charged.WithLabelValues("default")) - charged; got != 1200 {
			t.Fatalf("%s: charged_total grew by %v, want 1200", path, got)
		}
		r := cs.Get(strings.Replace(path, "/i1/", "/i3/", 1), "X-API-Key", key)
		ra, err := strconv.Atoi(r.Header.Get("Retry-After"))
		if r.Status != 429 || err != nil || ra < 1078 || ra > 1082 {
			t.Fatalf("%s: 5th request: %d, Retry-After %q; want 429 with 1080 (±2)", path, r.Status, r.Header.Get("Retry-After"))
		}
	}
}

// TestChargeFixedWindowDebt: a budget of 1000 tokens per window on a fixed window, a
// reservation of 100 per request and an upstream reporting 300: exactly 4 requests are admitted,
// the 4th leaving the window's count at 1200, 200 in debt; the 5th is denied with Retry-After
// the window's end, for a JSON body and for a chat completions stream alike.
func TestChargeFixedWindowDebt(t *testing.T) {
	srv := redistest.Start(t)
	up := startUpstream(t, 300)
	const window = 366 * 24 * time.Hour // windows aligned to the Unix epoch
	cs := caddytest.Start(t, caddytest.Instances(srv.Addr, `key {http.request.header.X-API-Key}
			algorithm fixed_window
			limit 1000
			window 366d
			cost 100
			charge openai_usage total`, up.URL))
	for _, path := range []string{"/i1/chat", "/i2/chat?stream=1"} {
		key := "fw-" + strconv.Itoa(len(path))
		for i := range 4 {
			if r := cs.Get(path, "X-API-Key", key); r.Status != 200 {
				t.Fatalf("%s: request %d: %d %q", path, i+1, r.Status, r.Body)
			}
		}
		if v, _ := srv.Do("GET", "rl:{"+key+"}:default:fw").(string); !strings.HasSuffix(v, ":1200") {
			t.Fatalf("%s: the window's count %q, want 1200 (200 in debt)", path, v)
		}
		r := cs.Get(strings.Replace(path, "/i1/", "/i3/", 1), "X-API-Key", key)
		left := window - time.Duration(time.Now().UnixNano()%int64(window))
		ra, err := strconv.ParseInt(r.Header.Get("Retry-After"), 10, 64)
		if r.Status != 429 || err != nil || ra < int64(left.Seconds())-2 || ra > int64(left.Seconds())+2 {
			t.Fatalf("%s: 5th request: %d, Retry-After %q; want 429 with the window's end, %.0f s (±2)", path, r.Status, r.Header.Get("Retry-After"), left.Seconds())
		}
	}
}

// TestChargeBoundUnderConcurrency: 20 concurrent requests over 3 instances, each reserving 100
// and reported 300: the total charged never exceeds capacity + in-flight × (300 − 100), nor twice
// the capacity (a bucket's debt is at most one capacity).
func TestChargeBoundUnderConcurrency(t *testing.T) {
	srv := redistest.Start(t)
	up := startUpstream(t, 300)
	up.delay = 50 * time.Millisecond
	cs := caddytest.Start(t, caddytest.Instances(srv.Addr, `key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage`, up.URL))
	var wg sync.WaitGroup
	var admitted atomic.Int64
	for i := range 20 {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, cs.Base+"/i"+strconv.Itoa(1+i%3)+"/chat", nil)
			req.Header.Set("X-API-Key", "shared")
			resp, err := caddytest.Client(0).Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				admitted.Add(1)
			}
		})
	}
	wg.Wait()
	n, peak := admitted.Load(), up.peak.Load()
	used, err := strconv.ParseFloat(srv.Do("HGET", "rl:{shared}:default:tb", "u").(string), 64)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("admitted %d, at most %d in flight, charged %.0f", n, peak, used)
	want := min(float64(n)*300, 2000)
	if n < 4 || used > 1000+float64(peak)*200 || used < want-1 || used > want {
		t.Fatalf("admitted %d with at most %d in flight: charged %.1f, want %d × 300 (at most 2000) and at most 1000 + %d × 200", n, peak, used, n, peak)
	}
}

// TestChargeStreamsEveryChunkAtOnce: the first event of a stream reaches the client before the
// upstream sends the second (the upstream waits for the client to have read it).
func TestChargeStreamsEveryChunkAtOnce(t *testing.T) {
	srv := redistest.Start(t)
	up := startUpstream(t, 300)
	up.gate = make(chan struct{})
	cs := caddytest.Start(t, caddytest.Instances(srv.Addr, `key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage`, up.URL))
	req, _ := http.NewRequest(http.MethodGet, cs.Base+"/i1/chat?stream=1", nil)
	req.Header.Set("X-API-Key", "streamer")
	resp, err := caddytest.Client(0).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	first := make(chan string, 1)
	br := bufio.NewReader(resp.Body)
	go func() {
		line, _ := br.ReadString('\n')
		first <- line
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
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), `"total_tokens":300`) {
		t.Fatalf("rest of the stream: %q", rest)
	}
	if u := srv.Do("HGET", "rl:{streamer}:default:tb", "u"); u == nil || !strings.HasPrefix(u.(string), "299.") && u != "300" {
		t.Fatalf("charged %v, want 300", u)
	}
}

// TestChargeLargeBodyBoundedMemory: a 100 MB JSON body with its usage at the end passes through
// the zone, which charges the usage; the process's resident memory grows by less than 4 MB more
// than for the same body through a route without the zone (the upstream, Caddy and the client are
// this one test process, whose own growth the plain route measures).
func TestChargeLargeBodyBoundedMemory(t *testing.T) {
	srv := redistest.Start(t)
	up := startUpstream(t, 300)
	cs := caddytest.Start(t, caddytest.Instances(srv.Addr, `key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage`, up.URL)+fmt.Sprintf(`
	route /plain/* {
		reverse_proxy %s
	}`, up.URL))
	// Garbage of the chunks passing through is collected early: the figure is what stays in use.
	defer debug.SetGCPercent(debug.SetGCPercent(10))
	grow := func(path, key string) int64 {
		up.bodyBytes = 0 // warm up: the connections, buffers and goroutines of one small request
		cs.Get(path, "X-API-Key", key+"-warm")
		up.bodyBytes = 100 << 20
		before := rss(t)
		var peak atomic.Int64
		done := make(chan struct{})
		go func() {
			for {
				select {
				case <-done:
					return
				case <-time.After(5 * time.Millisecond):
					if r := rss(t); r > peak.Load() {
						peak.Store(r)
					}
				}
			}
		}()
		req, _ := http.NewRequest(http.MethodGet, cs.Base+path, nil)
		req.Header.Set("X-API-Key", key)
		resp, err := caddytest.Client(0).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		n, err := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		close(done)
		if err != nil || n < 100<<20 {
			t.Fatalf("%s: read %d bytes: %v", path, n, err)
		}
		return max(0, peak.Load()-before)
	}
	plain := grow("/plain/chat", "plain")
	charged := grow("/i1/chat", "big")
	t.Logf("100 MB body: RSS grew %d kB through the charging zone, %d kB through a plain route", charged>>10, plain>>10)
	if u := srv.Do("HGET", "rl:{big}:default:tb", "u"); u == nil || !strings.HasPrefix(u.(string), "299.") && u != "300" {
		t.Fatalf("charged %v, want 300 (the usage at the end of the body)", u)
	}
	if charged-plain >= 4<<20 {
		t.Fatalf("RSS grew by %d kB more through the zone than through a plain route, want < 4096 kB", (charged-plain)>>10)
	}
}

// rss is the process's resident set size in bytes (Linux).
func rss(t *testing.T) int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Skip("no /proc/self/status: RSS cannot be measured here")
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	t.Skip("no VmRSS")
	return 0
}

// TestChargeHeader: charge header takes the amount from a response header; a response without
// it keeps the reservation.
func TestChargeHeader(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		key {http.request.header.X-API-Key}
		capacity 1000
		refill_rate 1000/1h
		cost 100
		charge header X-Tokens-Used
	}
	@reported path /reported
	header @reported X-Tokens-Used 250
	respond "ok"`, srv.Addr))
	for _, tc := range []struct {
		path, key string
		want      float64
	}{{"/reported", "a", 250}, {"/silent", "b", 100}} {
		if r := cs.Get(tc.path, "X-API-Key", tc.key); r.Status != 200 {
			t.Fatalf("%s: %d", tc.path, r.Status)
		}
		u, _ := strconv.ParseFloat(srv.Do("HGET", "rl:{"+tc.key+"}:default:tb", "u").(string), 64)
		if u < tc.want-0.1 || u > tc.want || srv.Do("HGET", "rl:{"+tc.key+"}:default:tb", "h") != nil {
			t.Fatalf("%s: charged %v, want %v and no hold left", tc.path, u, tc.want)
		}
	}
}

// TestChargeClientGoneMidStream: a client that disconnects mid-stream is settled as soon as the
// proxy gives up on the response: charged the usage if the upstream's report passed through
// before the proxy noticed, else the zone's missing amount (by default max_cost, the capacity);
// no hold is left waiting for hold_max.
func TestChargeClientGoneMidStream(t *testing.T) {
	srv := redistest.Start(t)
	up := startUpstream(t, 300)
	up.gate = make(chan struct{})
	cs := caddytest.Start(t, caddytest.Instances(srv.Addr, `key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage`, up.URL))
	req, _ := http.NewRequest(http.MethodGet, cs.Base+"/i1/chat?stream=1", nil)
	req.Header.Set("X-API-Key", "leaver")
	resp, err := caddytest.Client(0).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	if !strings.Contains(line, `"Hel"`) {
		t.Fatalf("first event: %q", line)
	}
	resp.Body.Close() // gone before the usage
	close(up.gate)
	var u float64
	var state map[any]any
	defer func() {
		if t.Failed() {
			t.Logf("state: %v", state)
		}
	}()
	redistest.WaitFor(t, 5*time.Second, "the reservation settled", func() bool {
		state, _ = srv.Do("HGETALL", "rl:{leaver}:default:tb").(map[any]any)
		_, held := state["h"]
		u, _ = strconv.ParseFloat(fmt.Sprint(state["u"]), 64)
		return state != nil && !held
	})
	if !(u > 999.9 && u <= 1000) && !(u > 299.9 && u <= 300) {
		t.Fatalf("charged %v, want the missing amount (1000) or the usage reported (300)", u)
	}
	t.Logf("charged %.0f", u)
}

// TestChargeBehindEncode: the zone reads the usage of a response the client gets gzipped by
// encode, whether encode compresses outside rate_limit_redis (written first in a route) or
// inside it (the directive order: the zone decodes the body as it passes).
func TestChargeBehindEncode(t *testing.T) {
	srv := redistest.Start(t)
	up := startUpstream(t, 300)
	zone := fmt.Sprintf(`rate_limit_redis {
			redis {
				address %s
			}
			key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage
		}`, srv.Addr)
	cs := caddytest.Start(t, fmt.Sprintf(`
	handle /outside/* {
		route {
			encode gzip
			%s
			reverse_proxy %s
		}
	}
	handle {
		encode gzip
		%s
		reverse_proxy %s
	}`, zone, up.URL, zone, up.URL))
	up.bodyBytes = 1 << 16 // large enough to be compressed
	if u := chatGzip(t, cs, srv, "/inside/chat", "in"); u < 299.9 || u > 300 {
		t.Fatalf("encode inside: charged %v, want 300", u)
	}
	if u := chatGzip(t, cs, srv, "/outside/chat", "out"); u < 299.9 || u > 300 {
		t.Fatalf("encode outside: charged %v, want 300", u)
	}
}

// chatGzip sends a request accepting gzip with API key key and returns what its zone charged
// (in srv).
func chatGzip(t *testing.T, cs *caddytest.Site, srv *redistest.Server, path, key string) float64 {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, cs.Base+path, nil)
	req.Header.Set("X-API-Key", key)
	req.Header.Set("Accept-Encoding", "gzip")
	resp, err := caddytest.Client(0).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("%s: %d, Content-Encoding %q, want 200 gzip", path, resp.StatusCode, resp.Header.Get("Content-Encoding"))
	}
	u, _ := strconv.ParseFloat(fmt.Sprint(srv.Do("HGET", "rl:{"+key+"}:default:tb", "u")), 64)
	return u
}

// TestChargeStreamingDelay measures each event's delay from the upstream's flush to the client,
// through a route with the zone and one without: the zone adds no buffering (both small, and
// alike). The figures are logged.
func TestChargeStreamingDelay(t *testing.T) {
	srv := redistest.Start(t)
	const events = 20
	var mu sync.Mutex
	sent := make([]time.Time, events)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for i := range events {
			usage := "null"
			if i == events-1 {
				usage = `{"total_tokens":300}`
			}
			mu.Lock()
			sent[i] = time.Now()
			mu.Unlock()
			fmt.Fprintf(w, "data: {\"i\":%d,\"usage\":%s}\n\n", i, usage)
			_ = rc.Flush()
			time.Sleep(5 * time.Millisecond)
		}
	}))
	t.Cleanup(up.Close)
	cs := caddytest.Start(t, fmt.Sprintf(`
	route /zone/* {
		rate_limit_redis {
			redis {
				address %s
			}
			key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage
		}
		reverse_proxy %s
	}
	route /plain/* {
		reverse_proxy %s
	}`, srv.Addr, up.URL, up.URL))
	measure := func(path string) (median, worst time.Duration) {
		req, _ := http.NewRequest(http.MethodGet, cs.Base+path, nil)
		req.Header.Set("X-API-Key", "delay")
		resp, err := caddytest.Client(0).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		var delays []time.Duration
		for i := 0; i < events; {
			line, err := br.ReadString('\n')
			if err != nil {
				t.Fatalf("%s: after %d events: %v", path, i, err)
			}
			if strings.HasPrefix(line, "data: ") {
				mu.Lock()
				delays = append(delays, time.Since(sent[i]))
				mu.Unlock()
				i++
			}
		}
		slices.Sort(delays)
		return delays[len(delays)/2], delays[len(delays)-1]
	}
	measure("/plain/warm")
	pm, pw := measure("/plain/x")
	zm, zw := measure("/zone/x")
	t.Logf("per-event delay, upstream flush to client: without the zone median %v max %v; with it median %v max %v", pm, pw, zm, zw)
	if zw > 100*time.Millisecond {
		t.Fatalf("with the zone an event took %v to arrive: buffered", zw)
	}
}

// TestChargedPlaceholder: {http.rate_limit_redis.charged} holds what the zone was charged after
// the response, in time for the access log.
func TestChargedPlaceholder(t *testing.T) {
	srv := redistest.Start(t)
	logFile := t.TempDir() + "/access.log"
	cs := caddytest.Start(t, fmt.Sprintf(`
	log {
		output file %s
		format json
	}
	log_append charged {http.rate_limit_redis.charged}
	rate_limit_redis {
		redis {
			address %s
		}
		capacity 1000
		refill_rate 1000/1h
		cost 100
		charge header X-Tokens-Used
	}
	header X-Tokens-Used 250
	respond "ok"`, logFile, srv.Addr))
	cs.Get("/")
	redistest.WaitFor(t, 5*time.Second, `the access log line with "charged":250`, func() bool {
		b, _ := os.ReadFile(logFile)
		return strings.Contains(string(b), `"charged":250`)
	})
}

// TestChargedPlaceholderStreamLeft: a stream whose client leaves mid-way, which reverse_proxy
// ends with a panic (so log_append never runs), still has what it was charged, `missing`, in
// its access log line, under the field name the docs give log_append.
func TestChargedPlaceholderStreamLeft(t *testing.T) {
	srv := redistest.Start(t)
	logFile := t.TempDir() + "/access.log"
	sent := make(chan struct{}, 1)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"tok\"}}]}\n\n")
		w.(http.Flusher).Flush()
		sent <- struct{}{}
		<-r.Context().Done() // the rest never comes: the client leaves first
	}))
	t.Cleanup(up.Close)
	cs := caddytest.Start(t, fmt.Sprintf(`
	log {
		output file %s
		format json
	}
	log_append charged {http.rate_limit_redis.charged}
	rate_limit_redis {
		redis {
			address %s
		}
		capacity 100000
		refill_rate 100000/1h
		cost 500
		charge openai_usage total missing 777
	}
	reverse_proxy %s`, logFile, srv.Addr, up.URL))
	conn, err := net.Dial("tcp", strings.TrimPrefix(cs.Base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, "GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-sent:
	case <-time.After(10 * time.Second):
		t.Fatal("the upstream was not asked within 10s")
	}
	if _, err := bufio.NewReader(conn).ReadString('\n'); err != nil { // the status line: the stream is under way
		t.Fatal(err)
	}
	conn.Close()
	redistest.WaitFor(t, 10*time.Second, `the access log line with "charged":777`, func() bool {
		b, _ := os.ReadFile(logFile)
		return strings.Contains(string(b), `"charged":777`)
	})
}

// TestChargeClientLeavesWhileHeld: a request held for its turn (max_wait) in a zone that
// charges after the response, whose client leaves before its turn, is settled at once as the
// 499 it is, not left held until hold_max (while no refill drains a hold): charge keeps its
// reservation, count_status (here of 200s only) gives it back.
func TestChargeClientLeavesWhileHeld(t *testing.T) {
	srv := redistest.Start(t)
	for _, tc := range []struct {
		name string
		zone *Zone
		used float64 // tokens used once the client has left: the first request's, and the held one's if kept
	}{
		{"charge", &Zone{Name: "heldcharge", Charge: &Charge{Source: ChargeHeader, Header: "X-Used"}}, 2},
		{"count_status", &Zone{Name: "heldcount", CountStatus: []string{"200"}}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			z := tc.zone
			z.Key, z.Capacity, z.RefillRate, z.MaxWait = []string{"{http.request.header.X-Client}"}, NumberOf(1), NumberOf(1.0/50), new(caddy.Duration(time.Minute))
			h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Zones: []*Zone{z}})
			if r := serveTimed(h, clientRequest("alice")); r.status != 200 { // the token, kept
				t.Fatalf("first request: %d %v", r.status, r.err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan timed, 1)
			go func() { done <- serveTimed(h, clientRequest("alice").WithContext(ctx)) }()
			redistest.WaitFor(t, 5*time.Second, "the request to be held", func() bool { return waitingNow(t) == 1 })
			cancel()
			if r := <-done; r.status != 499 {
				t.Fatalf("the held request: %d %v, want 499", r.status, r.err)
			}
			state, _ := srv.Do("HGETALL", "rl:{alice}:"+z.Name+":tb").(map[any]any)
			u, _ := strconv.ParseFloat(fmt.Sprint(state["u"]), 64)
			if _, held := state["h"]; held || u > tc.used || u < tc.used-0.01 {
				t.Fatalf("bucket after the client left: %v; want no hold, and %v used", state, tc.used)
			}
		})
	}
}

// TestChargeCompressedUsage (t_charge.sh b): a client accepting
// a compression the upstream uses is charged the usage reported, 5000, not the reservation
// (500): gzip (the OpenAI SDKs' default), deflate (zlib and raw) and zstd bodies are decoded as
// they pass, and the client receives exactly the bytes the upstream sent. Brotli, which the
// module does not decode, is taken off the Accept-Encoding the upstream sees, which then answers
// in another coding the client accepts (or none).
func TestChargeCompressedUsage(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	cs := caddytest.Start(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
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
			r := send(cs, tc.path, key, chat, "Accept-Encoding", tc.accept)
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
	cs := caddytest.Start(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	req, _ := http.NewRequest(http.MethodPost, cs.Base+"/v1/chat/completions",
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

// TestChargeStreamWithoutIncludeUsage (t_charge.sh c): a
// streaming chat completion whose client did not ask for stream_options.include_usage is asked
// for it on its way to the upstream, and charged the usage reported (5000), not the reservation
// (500); a request that needs no change, or cannot be read, reaches the upstream byte for byte
// as sent, and a stream that then reports no usage is charged the zone's missing amount.
func TestChargeStreamWithoutIncludeUsage(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	cs := caddytest.Start(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total missing 8000"))
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
			if r := send(cs, "/v1/chat/completions", key, []byte(tc.body)); r.status != 200 {
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

// TestChargeUsageNotSteerable (t_charge.sh d, e, f, g): the
// client's JSON reflected by the upstream cannot set its charge; a usage with a negative part is
// charged the zone's missing amount, never less.
func TestChargeUsageNotSteerable(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	cs := caddytest.Start(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total missing 8000"))
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
			if r := send(cs, tc.path, key, []byte(tc.body)); r.status != 200 {
				t.Fatalf("%d %q", r.status, r.body)
			}
			charged(t, srv, tc.name, key, tc.want)
		})
	}
}

// TestChargeAmountCapped (t_charge.sh h): a usage of 2^63 − 1
// tokens on a bucket of 100,000 refilled in 24 h is charged max_cost (the capacity): the key's
// TTL is at most two windows (48 h), not 285,000 years, and the capping is counted.
func TestChargeAmountCapped(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	cs := caddytest.Start(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	before := testutil.ToFloat64(metrics.chargeCapped.WithLabelValues("tokens"))
	if r := send(cs, "/v1/echo", "huge", []byte(`{"usage":{"total_tokens":9223372036854775807}}`)); r.status != 200 {
		t.Fatalf("%d %q", r.status, r.body)
	}
	charged(t, srv, "2^63 − 1 reported", "huge", 100000)
	if ttl := srv.Do("PTTL", "rl:{huge}:tokens:tb").(int64); ttl > 48*3600*1000 {
		t.Fatalf("TTL %d ms, want at most two windows (172,800,000 ms)", ttl)
	}
	if got := testutil.ToFloat64(metrics.chargeCapped.WithLabelValues("tokens")) - before; got != 1 {
		t.Fatalf("charge_capped_total grew by %v, want 1", got)
	}
	r := send(cs, "/v1/chat/completions", "huge", []byte(`{"messages":[]}`))
	if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); r.status != 429 || ra > 24*3600+1 {
		t.Fatalf("next request: %d, Retry-After %q; want 429 within a window", r.status, r.header.Get("Retry-After"))
	}
}

// TestChargeLateResponse (t_holdmax.sh): a 5000-token response
// that completes after hold_max (1 s), while other requests of the client touch its bucket (and
// so commit its hold as the 500 reserved), is charged 5000 all the same, and no settlement
// fails for want of its hold.
func TestChargeLateResponse(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	up.gate = make(chan struct{})
	cs := caddytest.Start(t, strings.Replace(openAIZone(srv.Addr, up.URL, "charge openai_usage total"), "hold_max 30m", "hold_max 1s", 1))
	noHold := testutil.ToFloat64(metrics.settleFailures.WithLabelValues("no_hold"))
	slow := make(chan rawResponse, 1)
	go func() {
		slow <- send(cs, "/v1/chat/completions", "late", []byte(`{"messages":[],"stream":true,"stream_options":{"include_usage":true}}`))
	}()
	state := "rl:{late}:tokens:tb"
	redistest.WaitFor(t, 5*time.Second, "the slow request's hold", func() bool {
		m, _ := srv.Do("HGETALL", state).(map[any]any)
		_, held := m["h"]
		return held
	})
	others := 0
	redistest.WaitFor(t, 10*time.Second, "another request to commit the slow one's hold, past hold_max", func() bool {
		if r := send(cs, "/v1/small", "late", []byte(`{}`)); r.status != 200 {
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

// TestChargeSettleLostStaysCharged: a streaming response whose settlement fails (Redis stalled
// as it ends: a timeout) leaves its hold of 500 tokens (hold_max 1s) unsettled. The bucket's key
// must then live until those 500 would have drained once charged (432 s at 100000/24h), not the
// hold time and a few seconds, after which the key, and the charge, would be gone.
func TestChargeSettleLostStaysCharged(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	up.gate = make(chan struct{})
	cs := caddytest.Start(t, strings.Replace(openAIZone(srv.Addr, up.URL, "charge openai_usage total"), "hold_max 30m", "hold_max 1s", 1))
	timeouts := testutil.ToFloat64(metrics.settleFailures.WithLabelValues(string(failTimeout)))
	slow := make(chan rawResponse, 1)
	go func() {
		slow <- send(cs, "/v1/chat/completions", "lost", []byte(`{"messages":[],"stream":true,"stream_options":{"include_usage":true}}`))
	}()
	state := "rl:{lost}:tokens:tb"
	redistest.WaitFor(t, 5*time.Second, "the slow request's hold", func() bool {
		m, _ := srv.Do("HGETALL", state).(map[any]any)
		_, held := m["h"]
		return held
	})
	srv.Pause()
	close(up.gate)
	if r := <-slow; r.status != 200 {
		t.Fatalf("slow request: %d %q", r.status, r.body)
	}
	redistest.WaitFor(t, 10*time.Second, "the settlement to fail", func() bool {
		return testutil.ToFloat64(metrics.settleFailures.WithLabelValues(string(failTimeout))) > timeouts
	})
	srv.Resume()
	if m, _ := srv.Do("HGETALL", state).(map[any]any); m["h"] != "500" {
		t.Fatalf("state after the lost settlement: %v, want the hold of 500 left", m)
	}
	if ttl, _ := srv.Do("PTTL", state).(int64); ttl < 432_000 {
		t.Fatalf("TTL %d ms with 500 tokens unsettled: want at least 432,000 (their drain time), or the charge expires with the key", ttl)
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
	cs := caddytest.Start(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	before := testutil.ToFloat64(metrics.chargeMissing.WithLabelValues("tokens"))

	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-arrived // the upstream is working on it
		cancel()
	}()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, cs.Base+"/v1/chat/completions", strings.NewReader(`{"model":"m","messages":[]}`))
	req.Header.Set("Authorization", "leaver")
	req.Header.Set("Content-Type", "application/json")
	if resp, err := caddytest.Client(0).Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("got %d; the client was to hang up before the response", resp.StatusCode)
	}
	charged(t, srv, "a client that hung up before the response", "leaver", 100000)
	if d := testutil.ToFloat64(metrics.chargeMissing.WithLabelValues("tokens")) - before; d != 1 {
		t.Fatalf("charge_missing_total grew by %v, want 1", d)
	}
}

// TestChargeDocsLLMExample: docs/charging.md's LLM example, as written there, in front of a
// vLLM-like upstream (it reads "stream" as pydantic does, and reports a stream's usage only when
// asked for it) whose completion has a 90,000-token prompt and a 10,000-token completion:
// whatever the client does to its streaming request, it is charged at least the 100,000 it
// used. A request is charged its usage; "stream" as 1, "yes" or "True" is read as the upstream
// reads it, so the request is asked for the usage; a body over 1 MiB (whitespace) is not
// rewritten, and its stream without usage is charged the example's missing amount, which must
// then be at least the largest total (in the openai_tokens zone, whose max_cost is below it, 100,000).
func TestChargeDocsLLMExample(t *testing.T) {
	site := docExample(t, "docs/charging.md", func(text string) bool { return strings.HasPrefix(text, "llm.example.com {") })
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
	cs := caddytest.Start(t, body)

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
			if r := send(cs, "/v1/chat/completions", key, []byte(tc.body)); r.status != 200 {
				t.Fatalf("%d %q", r.status, r.body)
			}
			mu.Lock()
			asked := bytes.Contains(got, []byte(`"stream_options":{"include_usage":true}`))
			mu.Unlock()
			if asked != tc.rewritten {
				t.Fatalf("the upstream was asked for the usage: %t, want %t", asked, tc.rewritten)
			}
			if u := srv.BucketUsed(t, "rl:{"+key+"}:openai_tokens:tb"); u > 100000 || u < 100000-2 {
				t.Fatalf("%s: charged %v, want 100000", tc.name, u)
			}
		})
	}
}

// TestChargeDecodingBounded: an upstream answers a charge openai_usage zone with a gzip body of
// 10 MB that inflates to 10 GiB, its usage at the end (generated as it is sent: 1280 gzip members
// of 8 MiB of 'a'). The zone stops decoding once the body inflates more than 100 times the
// bytes received (past 8 MiB), so Caddy decodes megabytes, not gigabytes; the client still
// receives every byte the upstream sent, unchanged (their SHA-256); the request is charged the
// zone's missing amount (the capacity, 100000: what the undecoded rest reports is unknown), not
// the 7 at the end; and the stop is counted in charge_undecoded_total{reason="ratio"}.
func TestChargeDecodingBounded(t *testing.T) {
	srv := redistest.Start(t)
	parts := gzipBombParts()
	var sent hash.Hash
	var sentMu sync.Mutex
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		out := io.MultiWriter(w, h)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Content-Length", fmt.Sprint(len(parts.head)+(gzipBombMembers-2)*len(parts.mid)+len(parts.tail)))
		_, _ = out.Write(parts.head)
		for range gzipBombMembers - 2 {
			if _, err := out.Write(parts.mid); err != nil {
				return
			}
		}
		_, _ = out.Write(parts.tail)
		sentMu.Lock()
		sent = h
		sentMu.Unlock()
	}))
	t.Cleanup(up.Close)
	cs := caddytest.Start(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	before := testutil.ToFloat64(metrics.chargeUndecoded.WithLabelValues("tokens", usage.StopRatio))

	req, _ := http.NewRequest(http.MethodGet, cs.Base+"/v1/chat/completions", nil)
	req.Header.Set("Authorization", "bomb")
	req.Header.Set("Accept-Encoding", "gzip")
	tr := &http.Transport{DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got := sha256.New()
	n, err := io.Copy(got, resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d, read %d bytes: %v", resp.StatusCode, n, err)
	}
	sentMu.Lock()
	want := sent
	sentMu.Unlock()
	if want == nil || !bytes.Equal(got.Sum(nil), want.Sum(nil)) {
		t.Fatalf("the client got %d bytes that are not the upstream's", n)
	}
	charged(t, srv, "a 10 GiB gzip bomb", "bomb", 100000)
	if d := testutil.ToFloat64(metrics.chargeUndecoded.WithLabelValues("tokens", usage.StopRatio)) - before; d != 1 {
		t.Fatalf("charge_undecoded_total{reason=ratio} grew by %v, want 1", d)
	}
}

// TestChargeZstdWindowsBounded: 16 responses at once, each a zstd frame asking for an 8 MiB
// window (the default of klauspost/compress's encoder), are held open by the upstream after
// their first blocks. The windows of the responses decoded at once are at most 64 MiB, 8 such
// responses: the process's heap grows by less than 96 MiB, the windows and the decoders' buffers
// of about 1 MiB each (without a bound, 16 decoders take about 150 MiB), the 8 decoded are charged the usage their bodies end with (7), the 8 that found
// no room are charged the zone's missing amount (100000) and counted in
// charge_undecoded_total{reason="memory"}, and every client gets the upstream's bytes unchanged.
func TestChargeZstdWindowsBounded(t *testing.T) {
	const n = 16
	srv := redistest.Start(t)
	gate := make(chan struct{})
	blocks := [][]byte{
		append(append([]byte{}, zstdFrameHeader...), zstdRawBlock(bombHead, false)...),
		zstdRawBlock(strings.Repeat("a", 64<<10), false), // more than a read of the decoder's 4 kB buffer
		zstdRawBlock(strings.Repeat("b", 1000), false),
		zstdRawBlock(bombTail, true),
	}
	body := bytes.Join(blocks, nil)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "zstd")
		rc := http.NewResponseController(w)
		for i, b := range blocks {
			if i == len(blocks)-1 {
				select {
				case <-gate:
				case <-r.Context().Done():
					return
				}
			}
			_, _ = w.Write(b)
			_ = rc.Flush()
		}
	}))
	t.Cleanup(up.Close)
	cs := caddytest.Start(t, openAIZone(srv.Addr, up.URL, "charge openai_usage total"))
	before := testutil.ToFloat64(metrics.chargeUndecoded.WithLabelValues("tokens", usage.StopMemory))
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapInuse
	}
	heapBefore := heap()

	type result struct {
		body []byte
		err  error
	}
	results := make([]chan result, n)
	started := make(chan error, n)
	tr := &http.Transport{DisableCompression: true, MaxConnsPerHost: n}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr}
	for i := range n {
		results[i] = make(chan result, 1)
		go func() {
			req, _ := http.NewRequest(http.MethodGet, cs.Base+"/v1/chat/completions", nil)
			req.Header.Set("Authorization", fmt.Sprintf("zw-%d", i))
			req.Header.Set("Accept-Encoding", "zstd")
			resp, err := client.Do(req)
			if err != nil {
				started <- err
				results[i] <- result{nil, err}
				return
			}
			defer resp.Body.Close()
			// The first three blocks: once the third reached the client, the zone's decoder has
			// taken the second (the writer writes to the client first, then to the decoder, one
			// write at a time, and the proxy flushes after each), and it reads a block's 64 kB
			// only once it has decoded the block before in its window, or found no room for the
			// window and stopped, which lets the write return at once.
			first := make([]byte, len(blocks[0])+len(blocks[1])+len(blocks[2]))
			_, err = io.ReadFull(resp.Body, first)
			started <- err
			rest, err2 := io.ReadAll(resp.Body)
			results[i] <- result{append(first, rest...), errors.Join(err, err2)}
		}()
	}
	for range n {
		if err := <-started; err != nil {
			close(gate)
			t.Fatal(err)
		}
	}
	grown := int64(heap()) - int64(heapBefore)
	close(gate)
	for i := range n {
		r := <-results[i]
		if r.err != nil || !bytes.Equal(r.body, body) {
			t.Fatalf("client %d: %v, %d bytes; want the upstream's %d", i, r.err, len(r.body), len(body))
		}
	}
	decoded, refused := 0, 0
	for i := range n {
		switch u := tokensUsed(t, srv, fmt.Sprintf("zw-%d", i)); { // less the refill while held
		case u > 5 && u <= 7:
			decoded++
		case u > 99998 && u <= 100000:
			refused++
		default:
			t.Fatalf("client %d charged %v, want 7 (decoded) or 100000 (missing)", i, u)
		}
	}
	t.Logf("%d held zstd responses with 8 MiB windows: the heap grew by %d MiB; %d decoded, %d refused", n, grown>>20, decoded, refused)
	if decoded != zstdWindowBudget/maxZstdWindow || refused != n-decoded {
		t.Fatalf("%d decoded and %d refused, want %d decoded (64 MiB of 8 MiB windows) and the rest refused", decoded, refused, zstdWindowBudget/maxZstdWindow)
	}
	if grown >= zstdWindowBudget*3/2 {
		t.Fatalf("the heap grew by %d MiB with %d responses held, want less than 96 (64 MiB of windows and their buffers)", grown>>20, n)
	}
	if d := testutil.ToFloat64(metrics.chargeUndecoded.WithLabelValues("tokens", usage.StopMemory)) - before; d != float64(refused) {
		t.Fatalf("charge_undecoded_total{reason=memory} grew by %v, want %d", d, refused)
	}
	// Every window was given back as its response ended: the next response is decoded.
	if r := send(cs, "/v1/chat/completions", "zw-after", nil, "Accept-Encoding", "zstd"); r.status != 200 || !bytes.Equal(r.body, body) {
		t.Fatalf("the next response: %d, %d bytes", r.status, len(r.body))
	}
	charged(t, srv, "the next response", "zw-after", 7)
}

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

// send sends a request to cs with key in Authorization, the header pairs given and body (GET
// when nil, else a POST), and returns the response undecoded.
func send(cs *caddytest.Site, path, key string, body []byte, header ...string) rawResponse {
	cs.T.Helper()
	method := http.MethodGet
	var rd io.Reader
	if body != nil {
		method, rd = http.MethodPost, bytes.NewReader(body)
	}
	req, err := http.NewRequest(method, cs.Base+path, rd)
	if err != nil {
		cs.T.Fatal(err)
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
		cs.T.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		cs.T.Fatalf("%s %s: reading the body: %v", method, path, err)
	}
	return rawResponse{status: resp.StatusCode, header: resp.Header, body: b}
}

// tokensUsed is what the tokens zone's bucket of key has used, once no charge of it is held:
// what it was charged (less the refill since, under 0.1 token in these tests' few seconds... or
// a few tokens for the slow ones).
func tokensUsed(t *testing.T, srv *redistest.Server, key string) float64 {
	t.Helper()
	return srv.BucketUsed(t, "rl:{"+key+"}:tokens:tb")
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

// The JSON document of the hostile bodies below: a string of padding between head and tail,
// the usage (7 tokens) at the end, where a decoder that reads everything finds it.
const (
	bombHead = `{"id":"x","pad":"`
	bombTail = `","usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}`
)

// gzipMember returns one gzip member (RFC 1952) of prefix, n bytes of 'a', then suffix, at the
// best compression: 8 MiB of 'a' take about 8 kB.
func gzipMember(prefix string, n int, suffix string) []byte {
	var b bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&b, gzip.BestCompression) // a valid level; a Buffer never fails
	_, _ = io.WriteString(zw, prefix)
	_, _ = zw.Write(bytes.Repeat([]byte("a"), n))
	_, _ = io.WriteString(zw, suffix)
	_ = zw.Close()
	return b.Bytes()
}

// gzipBombParts are the members of a gzip body of about 10 GiB decoded: a first member with
// the JSON's head, 1278 of padding and a last with the usage, each of 8 MiB of 'a' (built
// once: they are the same in every run).
var gzipBombParts = sync.OnceValue(func() (p struct{ head, mid, tail []byte }) {
	p.head = gzipMember(bombHead, 8<<20, "")
	p.mid = gzipMember("", 8<<20, "")
	p.tail = gzipMember("", 8<<20, bombTail)
	return p
})

// gzipBombMembers is how many members the gzip bomb has: 1280 × 8 MiB, 10 GiB decoded.
const gzipBombMembers = 1280

// zstdFrameHeader is the header of a zstd frame (RFC 8878 section 3.1.1.1) asking for a window
// of 8 MiB (Window_Descriptor 13 << 3: 2^(10+13)), no content size, no checksum, no dictionary:
// the frame klauspost/compress's encoder writes by default.
var zstdFrameHeader = []byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, 13 << 3}

// zstdRawBlock is a zstd block (RFC 8878 section 3.1.1.2) holding data as it is: its 3-byte
// header (Last_Block, Block_Type 0 (raw), Block_Size), then data.
func zstdRawBlock(data string, last bool) []byte {
	h := uint32(len(data)) << 3
	if last {
		h |= 1
	}
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], h)
	return append(b[:3], data...)
}

// The bounds of the zstd windows decoded at once (docs/charging.md): 8 MiB a window, 64 MiB for
// every response of the process.
const (
	maxZstdWindow    = 8 << 20
	zstdWindowBudget = 64 << 20
)

// TestChargeWeights: `charge openai_usage weights prompt 1 completion 4 cached 0.1` charges the
// weighted sum, rounded up: the uncached prompt tokens at 1, the cached ones at 0.1 (a chat
// completion's prompt_tokens_details, a Responses API body's input_tokens_details), the
// completion at 4; an embeddings usage its prompt; a stream's usage chunk alike; a usage whose
// cached tokens exceed its prompt is charged missing, and an amount above max_cost max_cost.
func TestChargeWeights(t *testing.T) {
	srv := redistest.Start(t)
	up := startOpenAI(t)
	cs := caddytest.Start(t, openAIZone(srv.Addr, up.URL, "charge openai_usage weights prompt 1 completion 4 cached 0.1 missing 8000"))
	for i, tc := range []struct {
		name, path, body string
		want             float64
	}{
		{"chat, 600 of 1000 cached: 400 + 60 + 1600", "/v1/echo", `{"usage":{"prompt_tokens":1000,"completion_tokens":400,"total_tokens":1400,"prompt_tokens_details":{"cached_tokens":600}}}`, 2060},
		{"responses, 999 of 1000 cached: 1 + 99.9 + 4, rounded up", "/v1/echo", `{"object":"response","usage":{"input_tokens":1000,"input_tokens_details":{"cached_tokens":999},"output_tokens":1,"total_tokens":1001}}`, 105},
		{"embeddings", "/v1/echo", `{"object":"list","usage":{"prompt_tokens":8,"total_tokens":8}}`, 8},
		{"stream, asked for its usage: 1000 + 16000", "/v1/chat/completions", `{"model":"m","messages":[],"stream":true}`, 17000},
		{"cached above the prompt: missing", "/v1/echo", `{"usage":{"prompt_tokens":10,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":11}}}`, 8000},
		{"above max_cost", "/v1/echo", `{"usage":{"prompt_tokens":1,"completion_tokens":30000}}`, 100000},
	} {
		key := fmt.Sprintf("w-%d", i) // of the client key's characters: never a digest
		t.Run(tc.name, func(t *testing.T) {
			if r := send(cs, tc.path, key, []byte(tc.body), "Accept-Encoding", "gzip"); r.status != 200 {
				t.Fatalf("%d %q", r.status, r.body)
			}
			charged(t, srv, tc.name, key, tc.want)
		})
	}
}

// TestChargeAnthropicUsage: `charge anthropic_usage` in front of an upstream speaking
// Anthropic's Messages API charges its usage, for a message and for a stream (input counts in
// message_start, output in message_delta), compressed or not: total is every input token,
// cached or not, and the output; weights charge each kind at its weight. The request goes on as
// it came (the upstream, which refuses unknown fields, is never asked for stream_options), and
// a stream cut short before its message_delta is charged missing.
func TestChargeAnthropicUsage(t *testing.T) {
	srv := redistest.Start(t)
	up := llmtest.StartAnthropic(t, llmtest.AnthropicUsage{Input: 100, CacheWrite: 20, CacheRead: 300, Output: 50})
	cs := caddytest.StartSites(t, "", openAIZone(srv.Addr, up.URL, "charge anthropic_usage total missing 9000"),
		openAIZone(srv.Addr, up.URL, "charge anthropic_usage weights prompt 3 completion 15 cached 0.3 cache_write 3.75"))
	total, weighted := cs[0], cs[1]
	const message = `{"model":"claude-sonnet-4-5","max_tokens":1024,"messages":[{"role":"user","content":"Hello"}]}`
	const stream = `{"model":"claude-sonnet-4-5","max_tokens":1024,"stream":true,"messages":[{"role":"user","content":"Hello"}]}`
	for _, tc := range []struct {
		name        string
		cs          *caddytest.Site
		body, gzip  string
		cut         bool
		want        float64
		contentType string
	}{
		{"message", total, message, "", false, 470, "application/json"},
		{"message, gzip", total, message, "gzip", false, 470, "application/json"},
		{"stream", total, stream, "", false, 470, "text/event-stream"},
		{"stream, gzip", total, stream, "gzip", false, 470, "text/event-stream"},
		{"stream cut short", total, stream, "gzip", true, 9000, "text/event-stream"},
		{"weights: 300 + 75 + 90 + 750", weighted, message, "gzip", false, 1215, "application/json"},
		{"weights, stream", weighted, stream, "", false, 1215, "text/event-stream"},
	} {
		key := "a-" + strings.NewReplacer(" ", "-", ",", "", ":", "", "+", "").Replace(tc.name) // never a digest
		t.Run(tc.name, func(t *testing.T) {
			header := []string{"Accept-Encoding", tc.gzip}
			if tc.cut {
				header = append(header, "X-Cut-Short", "1")
			}
			r := send(tc.cs, "/v1/messages", key, []byte(tc.body), header...)
			if r.status != 200 || r.header.Get("Content-Encoding") != tc.gzip || !strings.HasPrefix(r.header.Get("Content-Type"), tc.contentType) {
				t.Fatalf("%d %v %q", r.status, r.header, r.body)
			}
			bodies, _ := up.Received()
			if got := bodies[len(bodies)-1]; string(got) != tc.body {
				t.Fatalf("the upstream received %s, not the request as it came", got)
			}
			charged(t, srv, tc.name, key, tc.want)
		})
	}
}

// TestChargeHeaderScale: `charge header x-litellm-response-cost scale 1000000` charges a cost in
// dollars as micro-dollars, ceil(value × 1000000), exactly; a value that is not a decimal, a
// negative, or an overflow keeps the reservation, as `charge header` does; an amount above
// max_cost is charged max_cost.
func TestChargeHeaderScale(t *testing.T) {
	srv := redistest.Start(t)
	var routes strings.Builder
	for _, tc := range scaleCases {
		fmt.Fprintf(&routes, "\n\t@%s path /%s\n\theader @%s x-litellm-response-cost %q", tc.name, tc.name, tc.name, tc.value)
	}
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone tokens {
			key {http.request.header.Authorization}
			capacity 5000000
			refill_rate 5000000/24h
			cost 100
			max_cost 1000000
			charge header x-litellm-response-cost scale 1000000
		}
	}%s
	respond "ok"`, srv.Addr, routes.String()))
	for _, tc := range scaleCases {
		t.Run(tc.name, func(t *testing.T) {
			if r := send(cs, "/"+tc.name, "s-"+tc.name, nil); r.status != 200 {
				t.Fatalf("%d", r.status)
			}
			charged(t, srv, tc.name, "s-"+tc.name, tc.want)
		})
	}
}

// scaleCases are the values of x-litellm-response-cost of TestChargeHeaderScale, and what each
// is charged (the reservation is 100; max_cost 1000000).
var scaleCases = []struct {
	name, value string
	want        float64
}{
	{"exact", "0.000124", 124},
	{"rounded_up", "0.0001234", 124},
	{"python_repr", "1.23e-05", 13},
	{"zero", "0.0", 0},
	{"above_max_cost", "2.5", 1000000},
	{"not_a_number", "n/a", 100},
	{"negative", "-0.5", 100},
	{"overflow", "1e300", 100},
	{"empty", "", 100},
}
