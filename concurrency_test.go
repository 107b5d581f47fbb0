package ratelimitredis

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// slotZone is the concurrency zone: one client per Authorization header.
func slotZone(name string, limit int64, hold time.Duration) *Zone {
	return &Zone{Name: name, Key: []string{"{http.request.header.Authorization}"}, Algorithm: concurrencyName,
		Limit: NumberOf(limit), HoldMax: caddy.Duration(hold)}
}

// slotInstance is one "Caddy instance" of a test: a handler of its own (its own Limiter,
// refresher and in-process state), provisioned as Caddy would, served over HTTP on a loopback
// port with next behind it. A HandlerError (the 429) is written as its status.
func slotInstance(t *testing.T, h *Handler, next caddyhttp.HandlerFunc) (*Handler, *httptest.Server) {
	t.Helper()
	h = provisioned(t, h)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		repl := caddyhttp.NewTestReplacer(r)
		r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
		defer func() {
			if p := recover(); p != nil && p != http.ErrAbortHandler {
				w.WriteHeader(http.StatusBadGateway) // the test's "panicking upstream"
			}
		}()
		if err := h.ServeHTTP(w, r, next); err != nil {
			var he caddyhttp.HandlerError
			if errors.As(err, &he) && he.StatusCode != 0 {
				w.WriteHeader(he.StatusCode)
			} else {
				w.WriteHeader(http.StatusInternalServerError)
			}
		}
	}))
	t.Cleanup(srv.Close)
	return h, srv
}

// liveSlots is the number of slots of the client's key whose deadline is after Redis's now.
func liveSlots(t *testing.T, srv *redistest.Server, key string) int64 {
	t.Helper()
	tm := srv.Client().Time(context.Background()).Val()
	return srv.Do("ZCOUNT", key, fmt.Sprintf("(%d", tm.UnixMicro()), "+inf").(int64)
}

func slotKey(name string) string {
	return limiter.StateKey(DefaultKeyPrefix, &limiter.Zone{Name: name, Algorithm: limiter.Concurrency}, "Bearer k")
}

// getAuth sends a GET of the test's client ("Authorization: Bearer k") on a connection of its
// own: never a kept-alive one that a server of an earlier test, on the same port, closed.
func getAuth(t *testing.T, url string) (*http.Response, error) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer k")
	req.Close = true
	return http.DefaultClient.Do(req)
}

// getAuthLeaving sends getAuth's request in the background, reading its response to the end;
// cancel makes its client go away, and done is closed once the request has returned.
func getAuthLeaving(url string) (cancel context.CancelFunc, done <-chan struct{}) {
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	req.Header.Set("Authorization", "Bearer k")
	req.Close = true // a connection of its own (see getAuth)
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	return cancel, finished
}

// slowGate is the next handler of a test that keeps requests in flight: a request to /slow is
// held until release is closed; the others pass at once.
type slowGate struct{ arrived, release chan struct{} }

func newSlowGate() *slowGate {
	return &slowGate{arrived: make(chan struct{}, 4), release: make(chan struct{})}
}

func (g *slowGate) next(w http.ResponseWriter, r *http.Request) error {
	if r.URL.Path == "/slow" {
		g.arrived <- struct{}{}
		<-g.release
	}
	return nil
}

// holdOne sends one request to base's /slow and returns once the gate holds it; done is closed
// when its response has come, after release.
func (g *slowGate) holdOne(t *testing.T, base string) (done chan struct{}) {
	done = make(chan struct{})
	go func() {
		defer close(done)
		if resp, err := getAuth(t, base+"/slow"); err == nil {
			resp.Body.Close()
		}
	}()
	<-g.arrived
	return done
}

// TestConcurrencyThreeInstances is the first check: three instances, one client,
// limit 5, 30 concurrent requests to an upstream that takes 1.5 s and counts its concurrent
// requests: exactly 5 × 200 and 25 × 429 (with Retry-After 1 and the RateLimit fields), the
// upstream never serves more than 5 at once, and once they finish 5 more pass at once.
func TestConcurrencyThreeInstances(t *testing.T) {
	srv := redistest.Start(t)
	var cur, most atomic.Int64
	upstream := func(w http.ResponseWriter, r *http.Request) error {
		n := cur.Add(1)
		defer cur.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		time.Sleep(1500 * time.Millisecond)
		_, err := io.WriteString(w, "done")
		return err
	}
	var urls []string
	for range 3 {
		// A decision waits for Redis up to 5 s: one failed open on a loaded machine would admit a
		// sixth request, which the test counts.
		_, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Headers: HeadersBoth,
			Timeout: caddy.Duration(5 * time.Second), Zones: []*Zone{slotZone("completions", 5, 10*time.Minute)}}, upstream)
		urls = append(urls, s.URL)
	}
	burst := func(n int) (codes map[int]int, denial http.Header) {
		var mu sync.Mutex
		codes = map[int]int{}
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				resp, err := getAuth(t, urls[i%3]+"/v1/chat/completions")
				if err != nil {
					t.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				mu.Lock()
				codes[resp.StatusCode]++
				if resp.StatusCode == 429 {
					denial = resp.Header
				}
				mu.Unlock()
			})
		}
		wg.Wait()
		return codes, denial
	}
	codes, denial := burst(30)
	if codes[200] != 5 || codes[429] != 25 || most.Load() != 5 {
		t.Fatalf("30 concurrent requests: %v, upstream's most at once %d; want 5 × 200, 25 × 429, 5", codes, most.Load())
	}
	for h, want := range map[string]string{"Retry-After": "1", "X-RateLimit-Limit": "5", "X-RateLimit-Remaining": "0",
		"X-RateLimit-Reset": "1", "RateLimit-Policy": `"completions";q=5;qu="concurrent-requests"`, "RateLimit": `"completions";r=0;t=1`} {
		if got := denial.Get(h); got != want {
			t.Errorf("denial's %s: %q, want %q", h, got, want)
		}
	}
	if n := liveSlots(t, srv, slotKey("completions")); n != 0 {
		t.Fatalf("slots after every response: %d, want 0", n)
	}
	most.Store(0)
	codes, _ = burst(5)
	if codes[200] != 5 || most.Load() != 5 {
		t.Fatalf("5 more after they finished: %v, upstream's most at once %d; want 5 × 200 at once", codes, most.Load())
	}
}

// TestConcurrencySlotGivenBackOnEveryEnd: the slot is given back, and the in-flight gauge falls
// back to 0, when the response ends normally, when the upstream fails, when a handler panics,
// and when the client goes away mid-stream; each time the next request is admitted.
func TestConcurrencySlotGivenBackOnEveryEnd(t *testing.T) {
	srv := redistest.Start(t)
	var mode atomic.Value
	started := make(chan struct{}, 1)
	h, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}},
		Zones: []*Zone{slotZone("ends", 1, time.Minute)}}, func(w http.ResponseWriter, r *http.Request) error {
		switch mode.Load() {
		case "error":
			return caddyhttp.Error(http.StatusBadGateway, errors.New("upstream failed"))
		case "panic":
			panic("upstream handler panicked")
		case "gone":
			w.WriteHeader(200)
			http.NewResponseController(w).Flush()
			started <- struct{}{}
			<-r.Context().Done()
			panic(http.ErrAbortHandler) // as reverse_proxy does for a client gone mid-stream
		}
		_, err := io.WriteString(w, "ok")
		return err
	})
	gauge := h.Zones[0].after.inFlight
	key := slotKey("ends")
	for _, m := range []string{"ok", "error", "panic", "gone"} {
		mode.Store(m)
		if m == "gone" {
			cancel, done := getAuthLeaving(s.URL)
			<-started
			if n := liveSlots(t, srv, key); n != 1 || testutil.ToFloat64(gauge) != 1 {
				t.Fatalf("mid-stream: %d slots, gauge %v; want 1, 1", n, testutil.ToFloat64(gauge))
			}
			cancel()
			<-done
		} else {
			resp, err := getAuth(t, s.URL)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
		}
		redistest.WaitFor(t, time.Second, m+": the slot given back", func() bool {
			return liveSlots(t, srv, key) == 0 && testutil.ToFloat64(gauge) == 0
		})
		mode.Store("ok")
		resp, err := getAuth(t, s.URL)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("after %s: %v %v, want 200", m, resp, err)
		}
		resp.Body.Close()
	}
	if h.limiter.LiveSlots() != 0 {
		t.Fatalf("slots still refreshed: %d", h.limiter.LiveSlots())
	}
}

// TestConcurrencyLongStreamKeepsSlot is the third check: a 60 s SSE stream through one
// instance with hold_max 10s keeps its slot for the whole stream (another instance denies the
// client's second request throughout, and the slot's deadline stays ahead), and the slot is
// free within 1 s of the stream's end. Parallel: it lasts a minute.
func TestConcurrencyLongStreamKeepsSlot(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	const stream = 60 * time.Second
	// timeout 5s: this test is about the slot, not timeouts; with the default 100ms a probe on a
	// loaded machine (other packages' tests alongside) was once decided fail open (200).
	cfg := func() *Handler {
		return &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Timeout: caddy.Duration(5 * time.Second),
			Zones: []*Zone{slotZone("sse", 1, 10*time.Second)}}
	}
	_, a := slotInstance(t, cfg(), func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		end := time.Now().Add(stream)
		for i := 0; time.Now().Before(end); i++ {
			if _, err := fmt.Fprintf(w, "data: %d\n\n", i); err != nil {
				return err
			}
			if err := http.NewResponseController(w).Flush(); err != nil {
				return err
			}
			time.Sleep(time.Second)
		}
		_, err := io.WriteString(w, "data: [DONE]\n\n")
		return err
	})
	_, b := slotInstance(t, cfg(), func(w http.ResponseWriter, r *http.Request) error {
		_, err := io.WriteString(w, "ok")
		return err
	})
	resp, err := getAuth(t, a.URL)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("stream: %v %v", resp, err)
	}
	defer resp.Body.Close()
	ended := make(chan time.Time, 1)
	go func() {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if sc.Text() == "data: [DONE]" {
				break
			}
		}
		_, _ = io.Copy(io.Discard, resp.Body) // the end of the body: the response is complete
		ended <- time.Now()
	}()
	key := slotKey("sse")
	probes := 0
	for {
		select {
		case end := <-ended:
			if probes < 25 {
				t.Fatalf("only %d probes during the stream", probes)
			}
			redistest.WaitFor(t, time.Second, "the slot free after the stream", func() bool {
				p, err := getAuth(t, b.URL)
				if err != nil {
					t.Fatal(err)
				}
				p.Body.Close()
				return p.StatusCode == 200
			})
			t.Logf("slot free %v after the stream's end; %d probes denied during it", time.Since(end), probes)
			return
		case <-time.After(2 * time.Second):
		}
		p, err := getAuth(t, b.URL)
		if err != nil {
			t.Fatal(err)
		}
		p.Body.Close()
		score := srv.Do("ZRANGE", key, 0, -1, "WITHSCORES").([]any)
		if p.StatusCode != 429 || len(score) != 1 || liveSlots(t, srv, key) != 1 {
			t.Fatalf("probe %d during the stream: %d, slots %v; want 429 and the stream's slot live", probes, p.StatusCode, score)
		}
		probes++
	}
}

// TestConcurrencyFailModeLocal: while Redis is unreachable, fail_mode local holds a semaphore of
// limit per client in process: 2 requests in flight pass, the 3rd is denied, and a slot given
// back admits the next.
func TestConcurrencyFailModeLocal(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan struct{}, 4)
	h, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: []string{"127.0.0.1:1"}}, FailMode: FailLocal,
		Zones: []*Zone{slotZone("local", 2, time.Minute)}}, func(w http.ResponseWriter, r *http.Request) error {
		arrived <- struct{}{}
		<-release
		return nil
	})
	var wg sync.WaitGroup
	codes := make(chan int, 2)
	for range 2 {
		wg.Go(func() {
			resp, err := getAuth(t, s.URL)
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
			codes <- resp.StatusCode
		})
	}
	<-arrived
	<-arrived
	if g := testutil.ToFloat64(h.Zones[0].after.inFlight); g != 2 {
		t.Fatalf("in-flight gauge: %v, want 2", g)
	}
	resp, err := getAuth(t, s.URL)
	if err != nil || resp.StatusCode != 429 || resp.Header.Get("X-RateLimit-Degraded") != "true" {
		t.Fatalf("third request: %v %v, want a degraded 429", resp, err)
	}
	resp.Body.Close()
	close(release)
	wg.Wait()
	if c1, c2 := <-codes, <-codes; c1 != 200 || c2 != 200 {
		t.Fatalf("the two in flight: %d %d", c1, c2)
	}
	if g := testutil.ToFloat64(h.Zones[0].after.inFlight); g != 0 {
		t.Fatalf("in-flight gauge after: %v, want 0", g)
	}
	resp, err = getAuth(t, s.URL)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("after the release: %v %v", resp, err)
	}
	resp.Body.Close()
}

// TestConcurrencyDryRun: with dry_run, a request beyond the limit passes (reported as denied:
// Remaining 0), and takes no slot; the admitted one's slot is given back as usual.
func TestConcurrencyDryRun(t *testing.T) {
	srv := redistest.Start(t)
	g := newSlowGate()
	_, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, DryRun: true,
		Zones: []*Zone{slotZone("dry", 1, time.Minute)}}, g.next)
	done := g.holdOne(t, s.URL)
	resp, err := getAuth(t, s.URL)
	if err != nil || resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != "0" {
		t.Fatalf("second request in dry_run: %v %v, want 200 with Remaining 0", resp, err)
	}
	resp.Body.Close()
	if n := liveSlots(t, srv, slotKey("dry")); n != 1 {
		t.Fatalf("slots: %d, want 1 (the dry-run denial takes none)", n)
	}
	close(g.release)
	<-done
	redistest.WaitFor(t, time.Second, "the slot given back", func() bool { return liveSlots(t, srv, slotKey("dry")) == 0 })
}

// TestConcurrencyWithOtherZones: a request of a concurrency zone and a token bucket zone is
// decided all-or-nothing: a bucket's denial takes no slot, and a concurrency denial charges no
// token.
func TestConcurrencyWithOtherZones(t *testing.T) {
	srv := redistest.Start(t)
	g := newSlowGate()
	_, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Zones: []*Zone{
		slotZone("conc", 1, time.Minute),
		{Name: "bucket", Key: []string{"{http.request.header.Authorization}"}, Capacity: NumberOf(2), RefillRate: NumberOf(1.0 / 3600)},
	}}, g.next)
	done := g.holdOne(t, s.URL)
	resp, _ := getAuth(t, s.URL)
	resp.Body.Close()
	if resp.StatusCode != 429 || resp.Header.Get("X-RateLimit-Limit") != "1" {
		t.Fatalf("second request in flight: %d %v, want 429 by the concurrency zone", resp.StatusCode, resp.Header)
	}
	close(g.release)
	<-done
	resp, _ = getAuth(t, s.URL) // the bucket's second and last token
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("X-RateLimit-Remaining") != "0" {
		t.Fatalf("third request: %d %v, want 200 with the bucket empty (the denial took no token)", resp.StatusCode, resp.Header)
	}
	resp, _ = getAuth(t, s.URL)
	resp.Body.Close()
	if resp.StatusCode != 429 || liveSlots(t, srv, slotKey("conc")) != 0 {
		t.Fatalf("fourth request: %d, slots %d; want 429 by the bucket and no slot taken", resp.StatusCode, liveSlots(t, srv, slotKey("conc")))
	}
}

// TestConcurrencyZoneConfig: the Caddyfile takes algorithm concurrency with a limit, a hold_max,
// a max_wait (its queue) and priority classes, and refuses what does not apply, each with a
// clear error; JSON's checks agree, and refuse priority on a token bucket without max_wait, or
// beside overrides.
func TestConcurrencyZoneConfig(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{"algorithm concurrency\n limit 5\n hold_max 10m", ""},
		{"algorithm concurrency\n limit 5", ""},
		{"algorithm concurrency\n limit 5\n max_wait 1s", ""},
		{"algorithm concurrency\n limit 5\n max_wait 1s\n priority {http.request.header.X-Tier} {\n interactive\n batch share 20%\n }", ""},
		{"algorithm concurrency\n limit 5\n max_wait 1s\n priority {h} {\n a share 20\n }", `share "20" must be a percentage`},
		{"algorithm concurrency\n limit 5\n max_wait 1s\n priority {h} {\n a portion 20%\n }", "want `share <percent>%`"},
		{"algorithm concurrency\n limit 5\n max_wait 1s\n priority {h} {\n a share 20% x\n }", "wrong argument count"},
		{"algorithm concurrency\n limit 5\n max_wait 1s\n priority {\n a\n }", "wrong argument count"},
		{"algorithm concurrency\n limit 5\n window 1m", "window belongs to algorithm sliding_window, not concurrency"},
		{"algorithm concurrency\n limit 5\n cost 2", "cost does not apply to algorithm concurrency"},
		{"algorithm concurrency\n limit 5\n max_cost 2", "max_cost does not apply to algorithm concurrency"},
		{"algorithm concurrency\n limit 5\n count_status 5xx", "count_status does not apply to algorithm concurrency"},
		{"algorithm concurrency", "limit is required for algorithm concurrency"},
		{"algorithm concurrency\n limit 100001", "out of range (1 to 100000)"},
		{"algorithm concurrency\n limit 5\n hold_max 500ms", "hold_max 500ms: a concurrency zone's slots are refreshed every third of it; at least 1s"},
	} {
		var h Handler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("rate_limit_redis {\n zone c {\n " + tc.body + "\n }\n}"))
		if (tc.want == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want %q", tc.body, err, tc.want)
		}
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, tc := range []struct {
		z    *Zone
		want string
	}{
		{&Zone{Name: "c", Algorithm: concurrencyName, Limit: NumberOf(5), HoldMax: caddy.Duration(time.Millisecond)}, "hold_max 1ms: a concurrency zone's slots are refreshed every third of it; at least 1s"},
		{&Zone{Name: "c", Algorithm: concurrencyName, Limit: NumberOf(5), Cost: "2"}, "cost does not apply to algorithm concurrency"},
		{&Zone{Name: "c", Algorithm: concurrencyName, Limit: NumberOf(5), Priority: &Priority{Class: "{h}", Classes: []PriorityClass{{Name: "a"}}}}, "priority classes need a queue"},
		{&Zone{Name: "c", Algorithm: concurrencyName, Limit: NumberOf(5), MaxWait: new(caddy.Duration(time.Second)),
			Priority: &Priority{Class: "{h}", Classes: []PriorityClass{{Name: "a", Share: 60}, {Name: "b", Share: 50}}}}, "add up to 110%"},
		{&Zone{Name: "c", Algorithm: concurrencyName, Limit: NumberOf(5), MaxWait: new(caddy.Duration(time.Second)),
			Priority: &Priority{Class: "{h}", Classes: []PriorityClass{{Name: "a"}, {Name: "a"}}}}, "a class needs a name of its own"},
		{&Zone{Name: "c", Algorithm: concurrencyName, Limit: NumberOf(5), MaxWait: new(caddy.Duration(time.Second)),
			Priority: &Priority{Class: "{h}", Classes: []PriorityClass{{Name: "a", Share: -1}}}}, "must be 0% to 100%"},
		{&Zone{Name: "c", Algorithm: concurrencyName, Limit: NumberOf(5), MaxWait: new(caddy.Duration(time.Second)),
			Priority: &Priority{Class: "{h}"}}, "at least one class"},
		{&Zone{Name: "c", Capacity: NumberOf(5), RefillRate: NumberOf(1),
			Priority: &Priority{Class: "{h}", Classes: []PriorityClass{{Name: "a"}}}}, "priority classes need a queue: a max_wait, on algorithm concurrency or token_bucket"},
		{&Zone{Name: "c", Capacity: NumberOf(5), RefillRate: NumberOf(1), MaxWait: new(caddy.Duration(time.Second)), Overrides: true,
			Priority: &Priority{Class: "{h}", Classes: []PriorityClass{{Name: "a"}}}}, "overrides do not apply to a zone with a queue"},
	} {
		h := &Handler{Redis: &RedisConfig{Addresses: []string{"127.0.0.1:1"}}, Zones: []*Zone{tc.z}}
		err := h.Provision(ctx)
		if err == nil {
			err = h.Validate()
		}
		_ = h.Cleanup()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.z, err, tc.want)
		}
	}
}

// TestConcurrencySlotsOfKilledInstance is the second check, with a separate Caddy
// process (CADDY_BINARY, which `make test` sets; skipped without it): an instance holding a
// client's 5 slots keeps them past hold_max (3 s) while it lives, as its refresher moves them
// on; killed with SIGKILL, it gives none back, and the slots are free on the other instance
// within hold_max + 2 s.
func TestConcurrencySlotsOfKilledInstance(t *testing.T) {
	caddyBin := os.Getenv("CADDY_BINARY")
	if caddyBin == "" {
		t.Skip("CADDY_BINARY is not set: run `make test`, which builds bin/caddy from this checkout and sets it")
	}
	srv := redistest.Start(t)
	const hold = 3 * time.Second
	block := make(chan struct{})
	t.Cleanup(func() { close(block) })
	arrived := make(chan struct{}, 10)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		select {
		case <-block:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(upstream.Close)
	port := freeport.Must(t)
	dir := t.TempDir()
	caddyfile := fmt.Sprintf(`{
	admin off
	auto_https off
	persist_config off
}
:%d {
	bind 127.0.0.1
	rate_limit_redis {
		redis {
			address %s
		}
		zone completions {
			key {http.request.header.Authorization}
			algorithm concurrency
			limit 5
			hold_max %s
		}
	}
	reverse_proxy %s
}
`, port, srv.Addr, hold, strings.TrimPrefix(upstream.URL, "http://"))
	if err := os.WriteFile(filepath.Join(dir, "Caddyfile"), []byte(caddyfile), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(caddyBin, "run", "--config", filepath.Join(dir, "Caddyfile"), "--adapter", "caddyfile")
	cmd.Env = append(os.Environ(), "XDG_CONFIG_HOME="+dir, "XDG_DATA_HOME="+dir)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &lockedWriter{w: &out}, &lockedWriter{w: &out}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	redistest.WaitFor(t, 30*time.Second, "the Caddy process to serve", func() bool {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	client := &http.Client{Transport: &http.Transport{}}
	for range 5 {
		go func() {
			req, _ := http.NewRequest(http.MethodGet, base+"/v1/chat/completions", nil)
			req.Header.Set("Authorization", "Bearer k")
			if resp, err := client.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
	for range 5 {
		select {
		case <-arrived:
		case <-time.After(10 * time.Second):
			t.Fatalf("the 5 requests did not reach the upstream; Caddy's output:\n%s", out.String())
		}
	}
	key := slotKey("completions")
	_, b := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}},
		Zones: []*Zone{slotZone("completions", 5, hold)}}, func(w http.ResponseWriter, r *http.Request) error { return nil })
	// Alive, the instance keeps its slots past hold_max.
	time.Sleep(hold + time.Second)
	if n := liveSlots(t, srv, key); n != 5 {
		t.Fatalf("slots %v after hold_max with the instance alive: %d, want 5 (refreshed)", hold+time.Second, n)
	}
	if resp, err := getAuth(t, b.URL); err != nil || resp.StatusCode != 429 {
		t.Fatalf("the other instance while 5 are in flight: %v %v, want 429", resp, err)
	} else {
		resp.Body.Close()
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	<-exited
	redistest.WaitFor(t, hold+2*time.Second, "the killed instance's slots free on the other instance", func() bool {
		resp, err := getAuth(t, b.URL)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode == 200 && liveSlots(t, srv, key) == 0
	})
	t.Logf("slots free %v after SIGKILL (hold_max %v)", time.Since(killed), hold)
}

// lockedWriter serialises writes to w (a process's stdout and stderr).
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// TestConcurrencyAdminStateAndReset: the admin API's state of a concurrency zone lists the
// client's slots in flight with their deadlines (hold_max ahead), and a reset frees them: the
// client's next request is admitted while the others still run.
func TestConcurrencyAdminStateAndReset(t *testing.T) {
	srv := redistest.Start(t)
	release := make(chan struct{})
	arrived := make(chan struct{}, 4)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			arrived <- struct{}{}
			<-release
		}
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(upstream.Close)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone completions {
			key {http.request.header.Authorization}
			algorithm concurrency
			limit 2
		}
	}
	reverse_proxy %s`, srv.Addr, strings.TrimPrefix(upstream.URL, "http://")))
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	for range 2 {
		wg.Go(func() { ac.Get("/slow", "Authorization", "Bearer k") })
	}
	<-arrived
	<-arrived
	ac.Get("/fast", "Authorization", "Bearer k").Expect(t, "a third request", 429, "")
	st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=completions&key=Bearer%20k", 200)
	if len(st) != 1 || st[0].Algorithm != "concurrency" || st[0].Count == nil || *st[0].Count != 2 || len(st[0].Slots) != 2 ||
		st[0].Remaining != 0 || st[0].RetryAfterMs != 1000 || st[0].Limit != 2 {
		t.Fatalf("state with 2 in flight: %+v", st)
	}
	for _, s := range st[0].Slots {
		d, err := time.Parse(time.RFC3339Nano, s.Deadline)
		if left := time.Until(d); err != nil || left < 9*time.Minute || left > 10*time.Minute || s.ID == "" {
			t.Fatalf("slot %+v: deadline %v ahead (%v), want hold_max's 10m", s, left, err)
		}
	}
	reset := adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=completions&key=Bearer%20k", 200)
	if len(reset) != 1 || !reset[0].Deleted {
		t.Fatalf("reset: %+v", reset)
	}
	ac.Get("/fast", "Authorization", "Bearer k").Expect(t, "after the reset", 200, "ok", "X-RateLimit-Remaining", "1")
	close(release)
	wg.Wait()
	st = adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=completions&key=Bearer%20k", 200)
	if len(st) != 1 || *st[0].Count != 0 || len(st[0].Slots) != 0 || st[0].Remaining != 2 {
		t.Fatalf("state once every request ended: %+v", st)
	}
}

// TestConcurrencySlotOfHeldRequest: a request held for its turn by another zone's max_wait holds
// its slot while it waits, and gives it back when its client leaves meanwhile.
func TestConcurrencySlotOfHeldRequest(t *testing.T) {
	srv := redistest.Start(t)
	h, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Zones: []*Zone{
		slotZone("conc", 2, time.Minute),
		{Name: "shaped", Key: []string{"{http.request.header.Authorization}"}, Capacity: NumberOf(1), RefillRate: NumberOf(0.2), MaxWait: new(caddy.Duration(10 * time.Second))},
	}}, func(w http.ResponseWriter, r *http.Request) error { return nil })
	resp, err := getAuth(t, s.URL) // takes the bucket's token
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("first: %v %v", resp, err)
	}
	resp.Body.Close()
	cancel, done := getAuthLeaving(s.URL)
	gauge := h.Zones[0].after.inFlight
	redistest.WaitFor(t, 2*time.Second, "the held request's slot", func() bool {
		return liveSlots(t, srv, slotKey("conc")) == 1 && testutil.ToFloat64(gauge) == 1
	})
	cancel()
	<-done
	redistest.WaitFor(t, time.Second, "the slot given back", func() bool {
		return liveSlots(t, srv, slotKey("conc")) == 0 && testutil.ToFloat64(gauge) == 0
	})
}

// TestConcurrencyStallGivesSlotsBack: Redis stalls (SIGSTOP) for 0.5 s. A decision that was on
// the wire then (the request got 503, fail_mode closed) is run by Redis when it resumes, and
// takes a slot no request holds; a settlement that times out then (the response has ended)
// leaves its slot. Each instance gives such slots back once Redis answers again, by their
// nonces: the client is admitted again within seconds of the resume, not after hold_max (30 s),
// and its slot set is empty once nothing of it is in flight. With 1 and 3 instances, each with
// a client of its own, and limit 1 slot per instance, so that one slot stranded per instance
// denies the client.
func TestConcurrencyStallGivesSlotsBack(t *testing.T) {
	for _, n := range []int{1, 3} {
		t.Run(fmt.Sprintf("decisions, %d instances", n), func(t *testing.T) {
			srv := redistest.Start(t)
			ins := stallInstances(t, srv, n, int64(n), func(http.ResponseWriter, *http.Request) error { return nil })
			var mu sync.Mutex
			codes := map[int]int{}
			stall(t, srv, 500*time.Millisecond, func() {
				var wg sync.WaitGroup
				for _, s := range ins {
					for range 2 {
						wg.Go(func() {
							c := statusOf(t, s.URL+"/x", "Bearer k")
							mu.Lock()
							codes[c]++
							mu.Unlock()
						})
					}
				}
				wg.Wait()
			})
			resumed := time.Now()
			if codes[503] != 2*n {
				t.Fatalf("requests during the stall: %v, want %d × 503 (fail_mode closed)", codes, 2*n)
			}
			readmitted(t, srv, ins[0].URL, resumed)
		})
		t.Run(fmt.Sprintf("settlements, %d instances", n), func(t *testing.T) {
			srv := redistest.Start(t)
			g := newSlowGate()
			ins := stallInstances(t, srv, n, int64(2*n), g.next)
			var done []chan struct{}
			for _, s := range ins {
				done = append(done, g.holdOne(t, s.URL), g.holdOne(t, s.URL))
			}
			if got := srv.Do("ZCARD", slotKey("stall")).(int64); got != int64(2*n) {
				t.Fatalf("slots with 2 requests in flight per instance: %d, want %d", got, 2*n)
			}
			stall(t, srv, 500*time.Millisecond, func() {
				close(g.release) // the responses end while Redis is stopped: their settlements time out
				for _, d := range done {
					<-d
				}
			})
			readmitted(t, srv, ins[0].URL, time.Now())
		})
	}
}

// stallInstances starts n instances of a concurrency zone "stall" (limit, hold_max 30s, timeout
// 100ms, fail_mode closed) on srv, each with a Redis client of its own, as separate Caddy
// processes have (handlers of one process with one Redis config share one client and its round
// trip: a pool_size of its own makes another). Each has decided one request, so that it holds a
// connection to Redis, as under traffic.
func stallInstances(t *testing.T, srv *redistest.Server, n int, limit int64, next func(http.ResponseWriter, *http.Request) error) []*httptest.Server {
	t.Helper()
	var out []*httptest.Server
	for i := range n {
		_, s := slotInstance(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}, PoolSize: 10 + i},
			Timeout: caddy.Duration(100 * time.Millisecond), FailMode: FailClosed,
			Zones: []*Zone{slotZone("stall", limit, 30*time.Second)}}, next)
		out = append(out, s)
		if code := statusOf(t, s.URL+"/warm", "Bearer warm"); code != 200 {
			t.Fatalf("instance %d's first request: %d, want 200", i, code)
		}
	}
	return out
}

// statusOf sends a GET of client key (its Authorization) to url on a connection of its own, and
// returns the status.
func statusOf(t *testing.T, url, key string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", key)
	req.Close = true
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Error(err)
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// stall stops srv (SIGSTOP) for d, running during while it is stopped.
func stall(t *testing.T, srv *redistest.Server, d time.Duration, during func()) {
	t.Helper()
	srv.Pause()
	t.Cleanup(srv.Resume) // a paused server is resumed before it is stopped
	start := time.Now()
	during()
	time.Sleep(d - time.Since(start)) // the stall's length: what the test is about, not a wait for an outcome
	srv.Resume()
}

// readmitted waits until the client "Bearer k" of the stall zone is admitted by base again after
// Redis resumed at resumed, and then until its slot set in Redis is empty (nothing of it is in
// flight): each within 5 s, far less than its hold_max of 30 s.
func readmitted(t *testing.T, srv *redistest.Server, base string, resumed time.Time) {
	t.Helper()
	redistest.WaitFor(t, 5*time.Second, "the client admitted again after the stall (hold_max is 30s)", func() bool {
		return statusOf(t, base+"/again", "Bearer k") == 200
	})
	admitted := time.Since(resumed)
	key := slotKey("stall")
	redistest.WaitFor(t, 5*time.Second, "the client's slot set empty with nothing in flight", func() bool {
		return srv.Do("ZCARD", key).(int64) == 0
	})
	t.Logf("after Redis resumed: admitted again at %v, no slot left at %v",
		admitted.Round(time.Millisecond), time.Since(resumed).Round(time.Millisecond))
}
