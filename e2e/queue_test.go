package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// queueZone is a site-wide queue in front of an upstream that serves 4 requests at a time:
// interactive first, batch guaranteed 20% of the slots.
const queueZone = `zone upstream {
				key site
				algorithm concurrency
				limit 4
				max_wait 30s
				priority {http.request.header.X-Tier} {
					interactive
					batch share 20%
				}
			}`

// upstreamLog is an upstream that records the order in which requests start (their X-Seq) and
// the most it ever serves at once, and serves each for 200 ms once open is closed.
type upstreamLog struct {
	mu       sync.Mutex
	started  []string
	now, max int
	open     chan struct{}
}

func (u *upstreamLog) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.started = append(u.started, r.Header.Get("X-Seq"))
	u.now++
	u.max = max(u.max, u.now)
	u.mu.Unlock()
	<-u.open
	time.Sleep(200 * time.Millisecond) // the upstream's work
	u.mu.Lock()
	u.now--
	u.mu.Unlock()
	_, _ = w.Write([]byte("ok"))
}

// TestQueuePriorityAcrossInstances: three instances, one site-wide concurrency zone of limit 4
// with a queue. 40 batch requests come first (4 are served, 36 wait), then 10 interactive
// ones, each entering the queue in turn, spread over the instances. The upstream never serves
// more than 4 at once; every request is answered 200 within max_wait, those that waited with
// X-RateLimit-Waited; the 10 interactive requests start before all but 2 of the 36 batch
// requests waiting ahead of them (batch's 20% of the first 12 grants, interleaved), and the batch
// requests start in the order they arrived, whichever instance each came through.
func TestQueuePriorityAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	up := &upstreamLog{open: make(chan struct{})}
	upstream := httptest.NewServer(up)
	t.Cleanup(upstream.Close)
	cs := caddytest.Start(t, caddytest.Instances(srv.Addr, queueZone, upstream.URL))
	waiters := limiter.StateKey("rl:", &limiter.Zone{Name: "upstream", Algorithm: limiter.Concurrency}, "site") + ":ql"
	lc := caddytest.NewLoadClient(cs)
	type answer struct {
		seq string
		r   caddytest.Response
		err error
	}
	answers := make(chan answer, 50)
	var wg sync.WaitGroup
	send := func(seq, tier string, i int) {
		wg.Go(func() {
			r, err := lc.Get(fmt.Sprintf("/i%d/", 1+i%3), "X-Seq", seq, "X-Tier", tier)
			answers <- answer{seq, r, err}
		})
	}
	for i := range 50 {
		seq, tier := "b"+strconv.Itoa(i), "batch"
		if i >= 40 {
			seq, tier = "i"+strconv.Itoa(i-40), "interactive"
		}
		send(seq, tier, i)
		if i < 4 { // served at once: waits for the upstream to see it
			redistest.WaitFor(t, 5*time.Second, seq+" at the upstream", func() bool {
				up.mu.Lock()
				defer up.mu.Unlock()
				return len(up.started) == i+1
			})
			continue
		}
		redistest.WaitFor(t, 5*time.Second, seq+" in the queue", func() bool {
			n, _ := srv.Do("ZCARD", waiters).(int64)
			return n == int64(i-3)
		})
	}
	close(up.open)
	wg.Wait()
	close(answers)
	for a := range answers {
		if a.err != nil || a.r.Status != 200 {
			t.Fatalf("%s: %v %+v, want 200", a.seq, a.err, a.r)
		}
		waited, err := strconv.Atoi(a.r.Header.Get("X-RateLimit-Waited"))
		if a.seq >= "b4" && a.seq[0] == 'b' || a.seq[0] == 'i' {
			if err != nil || waited <= 0 || waited > 30000 {
				t.Errorf("%s: X-RateLimit-Waited %q, want the wait (ms): %v", a.seq, a.r.Header.Get("X-RateLimit-Waited"), a.r.Header)
			}
		}
	}
	if up.max != 4 {
		t.Fatalf("the upstream served up to %d at once, want 4", up.max)
	}
	t.Logf("start order: %v", up.started)
	checkQueueOrder(t, up.started)
}

// checkQueueOrder checks the upstream's start order: b0..b3 first; then the 46 waiters, 4 at
// a time (a group ends together, 200 ms later), so that the order within a group is the
// instances' race. The first 12 grants (3 groups) are the 10 interactive requests and 2 batch
// ones (interactive first, batch owed floor(20% × n) of n grants: the 5th and the 10th); the
// batch requests start in their arrival order, but for the race within a group of 4.
func checkQueueOrder(t *testing.T, started []string) {
	t.Helper()
	if len(started) != 50 {
		t.Fatalf("%d requests started, want 50: %v", len(started), started)
	}
	interactive := 0
	for _, seq := range started[4:16] {
		if seq[0] == 'i' {
			interactive++
		}
	}
	if interactive != 10 {
		t.Fatalf("%d interactive requests among the first 12 grants, want 10 (and 2 batch): %v", interactive, started)
	}
	k := 0
	for _, seq := range started {
		if seq[0] != 'b' {
			continue
		}
		if n, _ := strconv.Atoi(seq[1:]); n < k-3 || n > k+3 {
			t.Fatalf("batch %s started as the %dth batch request: not in arrival order (%v)", seq, k+1, started)
		}
		k++
	}
}

// queueSite is a site-wide queue of limit 1 (max_wait wait) in front of upstream.
func queueSite(redisAddr, wait, upstream string) string {
	return fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone one {
			key site
			algorithm concurrency
			limit 1
			max_wait %s
		}
	}
	reverse_proxy %s`, redisAddr, wait, upstream)
}

// queueKeysOf returns the slots' key and the waiters' key of queueSite's zone.
func queueKeysOf() (slots, waiters string) {
	slots = limiter.StateKey("rl:", &limiter.Zone{Name: "one", Algorithm: limiter.Concurrency}, "site")
	return slots, slots + ":ql"
}

// gatedUpstream serves each request once a value is sent on release (or release is closed).
func gatedUpstream(t *testing.T) (url string, release chan struct{}) {
	release = make(chan struct{})
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(s.Close)
	return s.URL, release
}

// zcard is the number of members of the sorted set key.
func zcard(srv *redistest.Server, key string) int64 {
	n, _ := srv.Do("ZCARD", key).(int64)
	return n
}

// TestQueueWaitTimeoutAndHangUp: with the one slot held, a request waits max_wait (1s) and is
// refused 429 with Retry-After and X-RateLimit-Waited (at least 1000 ms), leaving the queue; a
// waiter whose client hangs up leaves the queue at once and takes no slot: the next request
// after the holder is admitted.
func TestQueueWaitTimeoutAndHangUp(t *testing.T) {
	srv := redistest.Start(t)
	up, release := gatedUpstream(t)
	cs := caddytest.Start(t, queueSite(srv.Addr, "1s", up))
	slots, waiters := queueKeysOf()
	holder := make(chan caddytest.Response, 1)
	go func() { r, _ := caddytest.NewLoadClient(cs).Get("/"); holder <- r }()
	redistest.WaitFor(t, 5*time.Second, "the holder's slot", func() bool { return zcard(srv, slots) == 1 })

	r := cs.Get("/")
	waited, _ := strconv.Atoi(r.Header.Get("X-RateLimit-Waited"))
	if r.Status != 429 || r.Header.Get("Retry-After") == "" || waited < 1000 {
		t.Fatalf("after max_wait: %d, Retry-After %q, X-RateLimit-Waited %q; want 429 with both, at least 1000",
			r.Status, r.Header.Get("Retry-After"), r.Header.Get("X-RateLimit-Waited"))
	}
	redistest.WaitFor(t, 5*time.Second, "the timed-out waiter gone from the queue", func() bool { return zcard(srv, waiters) == 0 })

	req, _ := http.NewRequest(http.MethodGet, cs.Base+"/", nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, err := caddytest.Client(5 * time.Second).Do(req.WithContext(ctx)); done <- err }()
	redistest.WaitFor(t, 5*time.Second, "a waiter", func() bool { return zcard(srv, waiters) == 1 })
	cancel()
	<-done
	redistest.WaitFor(t, 5*time.Second, "the departed waiter gone from the queue", func() bool { return zcard(srv, waiters) == 0 })
	release <- struct{}{}
	if r := <-holder; r.Status != 200 {
		t.Fatalf("holder: %d", r.Status)
	}
	redistest.WaitFor(t, 5*time.Second, "the holder's slot given back, to no one", func() bool { return zcard(srv, slots) == 0 })
	close(release)
	cs.Get("/").Expect(t, "a request after the holder", 200, "ok")
}

// TestQueueRedisPausedAndReload: waiters survive a Redis pause (SIGSTOP) of 1s and a config
// reload: each is answered once the slot comes back, no waiter is stranded past max_wait, and
// no slot is left taken.
func TestQueueRedisPausedAndReload(t *testing.T) {
	srv := redistest.Start(t)
	up, release := gatedUpstream(t)
	site := queueSite(srv.Addr, "20s", up)
	cs := caddytest.Start(t, site)
	slots, waiters := queueKeysOf()
	lc := caddytest.NewLoadClient(cs)
	answers := make(chan caddytest.Response, 4)
	for i := range 4 {
		go func() { r, _ := lc.Get("/"); answers <- r }()
		redistest.WaitFor(t, 5*time.Second, "request in", func() bool { return zcard(srv, slots)+zcard(srv, waiters) == int64(i+1) })
	}
	srv.Pause()
	time.Sleep(time.Second) // the pause under test
	srv.Resume()
	cs.Reload(site + "\n# reloaded")
	start := time.Now()
	close(release)
	for range 4 {
		r := <-answers
		if r.Status != 200 {
			t.Fatalf("a request: %d %q, want 200", r.Status, r.Body)
		}
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("the waiters were answered %v after the slot came back", took)
	}
	redistest.WaitFor(t, 5*time.Second, "no slot left taken and no waiter", func() bool {
		return zcard(srv, slots) == 0 && zcard(srv, waiters) == 0
	})
}

// killedQueueSite is a site on port whose queue zone of limit 2 (hold_max 3s, max_wait 20s,
// and the zone lines more) is shared by every instance on redisAddr, in front of upstream.
func killedQueueSite(port int, redisAddr, upstream, more string) string {
	return fmt.Sprintf(`{
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
		zone one {
			key site
			algorithm concurrency
			limit 2
			hold_max 3s
			max_wait 20s
			%s
		}
	}
	reverse_proxy %s
}
`, port, redisAddr, more, strings.TrimPrefix(upstream, "http://"))
}

// holdingUpstream holds a request to /hold until its client goes away, and serves any other
// after 300 ms; it records the X-Seq of each request as it starts and the most it serves at once.
type holdingUpstream struct {
	upstreamLog
}

func (u *holdingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.started = append(u.started, r.Header.Get("X-Seq"))
	u.now++
	u.max = max(u.max, u.now)
	u.mu.Unlock()
	if r.URL.Path == "/hold" {
		<-r.Context().Done()
	} else {
		time.Sleep(300 * time.Millisecond) // the upstream's work
	}
	u.mu.Lock()
	u.now--
	u.mu.Unlock()
	_, _ = w.Write([]byte("ok"))
}

// caddyProcess is bin/caddy running a Caddyfile in a process of its own.
type caddyProcess struct {
	cmd    *exec.Cmd
	exited chan struct{}
	out    *lockedBuffer
}

// startCaddyProcess runs caddyBin with caddyfile, which serves on port, until the test ends, and
// returns once the port accepts connections; it fails t when the process exits before that, or
// does not serve within 30 s.
func startCaddyProcess(t testing.TB, caddyBin, caddyfile string, port int) *caddyProcess {
	t.Helper()
	p, err := launchCaddyProcess(t, caddyBin, caddyfile, port)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// errExitedEarly is launchCaddyProcess's error for a process that exited before it served (its
// port taken by another process meanwhile, say).
var errExitedEarly = errors.New("the Caddy process exited before it served")

// launchCaddyProcess is startCaddyProcess returning its error (wrapping errExitedEarly when the
// process exited) instead of failing t.
func launchCaddyProcess(t testing.TB, caddyBin, caddyfile string, port int) (*caddyProcess, error) {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "Caddyfile"), []byte(caddyfile), 0o600); err != nil {
		t.Fatal(err)
	}
	p := &caddyProcess{exited: make(chan struct{}), out: &lockedBuffer{}}
	p.cmd = exec.Command(caddyBin, "run", "--config", filepath.Join(dir, "Caddyfile"), "--adapter", "caddyfile")
	p.cmd.Env = append(os.Environ(), "XDG_CONFIG_HOME="+dir, "XDG_DATA_HOME="+dir)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() { _ = p.cmd.Process.Kill(); <-p.exited })
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			c.Close()
			return p, nil
		}
		select {
		case <-p.exited:
			return nil, fmt.Errorf("%w on port %d: %s", errExitedEarly, port, p.out)
		default:
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("the Caddy process did not serve on port %d within 30s: %s", port, p.out)
		}
	}
}

// lockedBuffer is a process's output, written by its stdout and stderr.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestQueueKilledInstance: two Caddy processes (CADDY_BINARY, which `make test` sets; skipped
// without it) share a queue zone of limit 2 (hold_max 3s, max_wait 20s). Instance A holds both
// slots and has 2 waiters; instance B has 3 waiters behind them. A is killed with SIGKILL: its
// slots' deadlines were at most hold_max ahead, and they are free within hold_max; its waiters
// leave the queue within QueueLease and a renewal period (QueueRefreshEvery); B's waiters are
// granted in arrival order (the two granted at once may start in either order) and answered 200
// within max_wait; the upstream never serves more than 2 at once; and no slot or queue key is
// left once they are answered.
func TestQueueKilledInstance(t *testing.T) {
	killedInstance(t, "", nil, "b2")
}

// TestFairQueueKilledInstance: the same with fair_by X-Tenant: A's 2 waiters and B's first 2
// are tenant t1's, B's third t3's. Once A's waiters are gone, B's are granted by their tags:
// t3's (the least) and t1's first at once, t1's second last, and no fair queuing key is left.
func TestFairQueueKilledInstance(t *testing.T) {
	killedInstance(t, "fair_by {http.request.header.X-Tenant}",
		map[string]string{"a0": "t1", "a1": "t1", "b0": "t1", "b1": "t1", "b2": "t3"}, "b1")
}

// killedInstance is TestQueueKilledInstance with the zone lines more, the X-Tenant of each
// request (by X-Seq), and the waiter of B that starts last.
func killedInstance(t *testing.T, more string, tenants map[string]string, last string) {
	caddyBin := os.Getenv("CADDY_BINARY")
	if caddyBin == "" {
		t.Skip("CADDY_BINARY is not set: run `make test`, which builds bin/caddy from this checkout and sets it")
	}
	const hold, maxWait = 3 * time.Second, 20 * time.Second
	srv := redistest.Start(t)
	up := &holdingUpstream{}
	upstream := httptest.NewServer(up)
	t.Cleanup(upstream.Close)
	portA, portB := freeport.Must(t), freeport.Must(t)
	a := startCaddyProcess(t, caddyBin, killedQueueSite(portA, srv.Addr, upstream.URL, more), portA)
	startCaddyProcess(t, caddyBin, killedQueueSite(portB, srv.Addr, upstream.URL, more), portB)
	slots, waiters := queueKeysOf()
	client := &http.Client{Timeout: maxWait + 10*time.Second}
	answers := make(chan answerOf, 3)
	send := func(port int, path, seq string, answers chan<- answerOf) {
		go func() {
			req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d%s", port, path), nil)
			req.Header.Set("X-Seq", seq)
			req.Header.Set("X-Tenant", tenants[seq])
			resp, err := client.Do(req)
			if err != nil {
				answers <- answerOf{seq: seq, err: err}
				return
			}
			resp.Body.Close()
			answers <- answerOf{seq, resp.StatusCode, resp.Header.Get("X-RateLimit-Waited"), nil}
		}()
	}
	lost := make(chan answerOf, 4) // A's requests: cut off by the kill
	for i, seq := range []string{"h0", "h1", "a0", "a1", "b0", "b1", "b2"} {
		port, path, to := portA, "/", lost
		switch {
		case seq[0] == 'h':
			path = "/hold"
		case seq[0] == 'b':
			port, to = portB, answers
		}
		send(port, path, seq, to)
		redistest.WaitFor(t, 5*time.Second, seq+" in", func() bool { return zcard(srv, slots)+zcard(srv, waiters) == int64(i+1) })
	}
	aSlots, _ := srv.Client().ZRange(t.Context(), slots, 0, -1).Result()
	aWaiters, _ := srv.Client().ZRange(t.Context(), slots+":q1", 0, 1).Result() // the 2 earliest: A's
	if err := a.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := srv.Time()
	<-a.exited
	checkKilledSlots(t, srv, slots, aSlots, killed, hold)
	redistest.WaitFor(t, limiter.QueueLease+limiter.QueueRefreshEvery+time.Second, "A's waiters out of the queue", func() bool {
		for _, id := range aWaiters {
			if srv.Do("ZSCORE", waiters, id) != nil || srv.Do("ZSCORE", slots+":q1", id) != nil {
				return false
			}
		}
		return true
	})
	t.Logf("A's waiters out of the queue %v after SIGKILL", srv.Time().Sub(killed))
	for range 3 {
		select {
		case an := <-answers:
			waited, err := strconv.Atoi(an.waited)
			if an.err != nil || an.status != 200 || err != nil || waited > int(maxWait.Milliseconds()) {
				t.Fatalf("%s: %+v, want 200 having waited at most max_wait", an.seq, an)
			}
		case <-time.After(maxWait + 5*time.Second):
			t.Fatalf("B's waiters not all answered within max_wait; A's output:\n%s", a.out)
		}
	}
	t.Logf("B's waiters answered %v after SIGKILL; upstream start order %v", srv.Time().Sub(killed), up.started)
	checkKilledOrder(t, &up.upstreamLog, last)
	redistest.WaitFor(t, 5*time.Second, "no slot or queue key left", func() bool {
		for _, k := range srv.Keys(t) {
			if strings.HasPrefix(k, slots) {
				return false
			}
		}
		return true
	})
}

// answerOf is a request's answer: its status and X-RateLimit-Waited, or its error.
type answerOf struct {
	seq    string
	status int
	waited string
	err    error
}

// checkKilledSlots checks the slots aSlots of the instance killed at killed (the Redis clock):
// their deadlines were at most hold ahead of the kill, so they are free within hold of it.
func checkKilledSlots(t *testing.T, srv *redistest.Server, slots string, aSlots []string, killed time.Time, hold time.Duration) {
	t.Helper()
	if len(aSlots) != 2 {
		t.Fatalf("the killed instance's slots: %v, want 2", aSlots)
	}
	for _, m := range aSlots {
		if s, ok := srv.Do("ZSCORE", slots, m).(float64); !ok || time.UnixMicro(int64(s)).After(killed.Add(hold)) {
			t.Fatalf("slot %s: deadline %v, want at most hold_max (%v) after the kill", m, s, hold)
		}
	}
}

// checkKilledOrder checks that the upstream served at most 2 at once and started B's waiters
// last after the other two (granted at once).
func checkKilledOrder(t *testing.T, up *upstreamLog, last string) {
	t.Helper()
	up.mu.Lock()
	defer up.mu.Unlock()
	if up.max > 2 {
		t.Fatalf("the upstream served up to %d at once, want at most 2", up.max)
	}
	var bs []string
	for _, seq := range up.started {
		if seq[0] == 'b' {
			bs = append(bs, seq)
		}
	}
	if len(bs) != 3 || bs[2] != last {
		t.Fatalf("B's waiters started in the order %v, want the other two, then %s", bs, last)
	}
}
