package ratelimitredis

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/crypto/bcrypt"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
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

// instances is a site of three routes /i1/, /i2/, /i3/, each with its own rate_limit_redis
// handler (its own Limiter and deny cache) with the same zone, in front of upstream.
func instances(redisAddr, zone, upstream string) string {
	var b strings.Builder
	for i := 1; i <= 3; i++ {
		fmt.Fprintf(&b, `
	route /i%d/* {
		rate_limit_redis {
			redis {
				address %s
			}
			%s
		}
		reverse_proxy %s
	}`, i, redisAddr, zone, upstream)
	}
	return b.String()
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
			cs := startCaddy(t, instances(srv.Addr, "key {http.request.header.X-Client}\n\t\t\tcount_status 401\n\t\t\t"+zone, up.URL))
			client := "alice-" + name
			if got := cs.statuses(10, "/i1/login", "X-Client", client, "X-Password", "right"); got != strings.TrimSpace(strings.Repeat("200 ", 10)) {
				t.Fatalf("10 correct logins: %s", got)
			}
			if got := cs.statuses(3, "/i2/login", "X-Client", client, "X-Password", "wrong"); got != "401 401 401" {
				t.Fatalf("3 wrong logins: %s", got)
			}
			if r := cs.get("/i3/login", "X-Client", client, "X-Password", "wrong"); r.status != 429 || r.header.Get("Retry-After") == "" {
				t.Fatalf("4th wrong login: %d %v, want 429 with Retry-After", r.status, r.header)
			}
			if r := cs.get("/i1/login", "X-Client", client, "X-Password", "right"); r.status != 429 {
				t.Fatalf("a correct login after 3 wrong ones: %d, want 429", r.status)
			}

			fresh := "mallory-" + name
			before := up.hits.Load()
			var wg sync.WaitGroup
			codes := make(chan int, 30)
			for i := range 30 {
				wg.Go(func() {
					req, _ := http.NewRequest(http.MethodGet, cs.base+"/i"+strconv.Itoa(1+i%3)+"/login", nil)
					req.Header.Set("X-Client", fresh)
					req.Header.Set("X-Password", "wrong")
					resp, err := servingClient(0).Do(req)
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
	cs := startCaddy(t, fmt.Sprintf(`
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
		req, _ := http.NewRequest(http.MethodGet, cs.base+"/", nil)
		req.SetBasicAuth("alice", password)
		resp, err := servingClient(0).Do(req)
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
	cs := startCaddy(t, instances(srv.Addr, `key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage total`, up.URL))
	for _, path := range []string{"/i1/chat", "/i2/chat?stream=1"} {
		key := "key-" + path
		charged := testutil.ToFloat64(metrics.charged.WithLabelValues("default"))
		for i := range 4 {
			r := cs.get(path, "X-API-Key", key)
			if r.status != 200 || !strings.Contains(r.body, `"total_tokens":300`) {
				t.Fatalf("%s: request %d: %d %q", path, i+1, r.status, r.body)
			}
		}
		if got := testutil.ToFloat64(metrics.charged.WithLabelValues("default")) - charged; got != 1200 {
			t.Fatalf("%s: charged_total grew by %v, want 1200", path, got)
		}
		r := cs.get(strings.Replace(path, "/i1/", "/i3/", 1), "X-API-Key", key)
		ra, err := strconv.Atoi(r.header.Get("Retry-After"))
		if r.status != 429 || err != nil || ra < 1078 || ra > 1082 {
			t.Fatalf("%s: 5th request: %d, Retry-After %q; want 429 with 1080 (±2)", path, r.status, r.header.Get("Retry-After"))
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
	cs := startCaddy(t, instances(srv.Addr, `key {http.request.header.X-API-Key}
			algorithm fixed_window
			limit 1000
			window 366d
			cost 100
			charge openai_usage total`, up.URL))
	for _, path := range []string{"/i1/chat", "/i2/chat?stream=1"} {
		key := "fw-" + strconv.Itoa(len(path))
		for i := range 4 {
			if r := cs.get(path, "X-API-Key", key); r.status != 200 {
				t.Fatalf("%s: request %d: %d %q", path, i+1, r.status, r.body)
			}
		}
		if v, _ := srv.Do("GET", "rl:{"+key+"}:default:fw").(string); !strings.HasSuffix(v, ":1200") {
			t.Fatalf("%s: the window's count %q, want 1200 (200 in debt)", path, v)
		}
		r := cs.get(strings.Replace(path, "/i1/", "/i3/", 1), "X-API-Key", key)
		left := window - time.Duration(time.Now().UnixNano()%int64(window))
		ra, err := strconv.ParseInt(r.header.Get("Retry-After"), 10, 64)
		if r.status != 429 || err != nil || ra < int64(left.Seconds())-2 || ra > int64(left.Seconds())+2 {
			t.Fatalf("%s: 5th request: %d, Retry-After %q; want 429 with the window's end, %.0f s (±2)", path, r.status, r.header.Get("Retry-After"), left.Seconds())
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
	cs := startCaddy(t, instances(srv.Addr, `key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage`, up.URL))
	var wg sync.WaitGroup
	var admitted atomic.Int64
	for i := range 20 {
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodGet, cs.base+"/i"+strconv.Itoa(1+i%3)+"/chat", nil)
			req.Header.Set("X-API-Key", "shared")
			resp, err := servingClient(0).Do(req)
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
	cs := startCaddy(t, instances(srv.Addr, `key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage`, up.URL))
	req, _ := http.NewRequest(http.MethodGet, cs.base+"/i1/chat?stream=1", nil)
	req.Header.Set("X-API-Key", "streamer")
	resp, err := servingClient(0).Do(req)
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
	cs := startCaddy(t, instances(srv.Addr, `key {http.request.header.X-API-Key}
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
		cs.get(path, "X-API-Key", key+"-warm")
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
		req, _ := http.NewRequest(http.MethodGet, cs.base+path, nil)
		req.Header.Set("X-API-Key", key)
		resp, err := servingClient(0).Do(req)
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
	cs := startCaddy(t, fmt.Sprintf(`
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
		if r := cs.get(tc.path, "X-API-Key", tc.key); r.status != 200 {
			t.Fatalf("%s: %d", tc.path, r.status)
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
	cs := startCaddy(t, instances(srv.Addr, `key {http.request.header.X-API-Key}
			capacity 1000
			refill_rate 1000/1h
			cost 100
			charge openai_usage`, up.URL))
	req, _ := http.NewRequest(http.MethodGet, cs.base+"/i1/chat?stream=1", nil)
	req.Header.Set("X-API-Key", "leaver")
	resp, err := servingClient(0).Do(req)
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
	cs := startCaddy(t, fmt.Sprintf(`
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
func chatGzip(t *testing.T, cs *caddyServer, srv *redistest.Server, path, key string) float64 {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, cs.base+path, nil)
	req.Header.Set("X-API-Key", key)
	req.Header.Set("Accept-Encoding", "gzip")
	resp, err := servingClient(0).Do(req)
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
	cs := startCaddy(t, fmt.Sprintf(`
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
		req, _ := http.NewRequest(http.MethodGet, cs.base+path, nil)
		req.Header.Set("X-API-Key", "delay")
		resp, err := servingClient(0).Do(req)
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
	cs := startCaddy(t, fmt.Sprintf(`
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
	cs.get("/")
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
	cs := startCaddy(t, fmt.Sprintf(`
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
	conn, err := net.Dial("tcp", strings.TrimPrefix(cs.base, "http://"))
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
			z.Key, z.Capacity, z.RefillRate, z.MaxWait = []string{"{http.request.header.X-Client}"}, NumberOf(1), NumberOf(1.0/50), caddy.Duration(time.Minute)
			h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Zones: []*Zone{z}})
			if r := serveTimed(h, clientRequest("alice")); r.status != 200 { // the token, kept
				t.Fatalf("first request: %d %v", r.status, r.err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan timed, 1)
			go func() { done <- serveTimed(h, clientRequest("alice").WithContext(ctx)) }()
			waitFor(t, 5*time.Second, "the request to be held", func() bool { return waitingNow(t) == 1 })
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
