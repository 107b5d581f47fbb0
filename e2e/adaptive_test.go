package e2e_test

import (
	"bufio"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// capacityUpstream is an upstream of known capacity: it serves c requests at once, each for
// service, first come first served, and queues the rest inside itself; c changes at run time.
// It records, per request, when it arrived and how long it spent inside (queued and served).
type capacityUpstream struct {
	service time.Duration
	mu      sync.Mutex
	c, busy int
	queue   []chan struct{}
	inside  int // requests inside now: served and queued
	most    int // the most inside at once
	visits  []visit
}

// visit is one request's time inside the upstream.
type visit struct {
	arrived, left time.Time
}

func (u *capacityUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
	u.mu.Lock()
	u.inside++
	u.most = max(u.most, u.inside)
	if u.busy < u.c {
		u.busy++
		u.mu.Unlock()
	} else {
		ch := make(chan struct{})
		u.queue = append(u.queue, ch)
		u.mu.Unlock()
		<-ch // its place, handed over by a request that ended
	}
	time.Sleep(u.service)
	u.mu.Lock()
	if len(u.queue) > 0 && u.busy <= u.c {
		close(u.queue[0]) // the place goes to the first in line
		u.queue = u.queue[1:]
	} else {
		u.busy--
	}
	u.inside--
	u.visits = append(u.visits, visit{arrived, time.Now()})
	u.mu.Unlock()
	_, _ = w.Write([]byte("ok"))
}

// startCapacityUpstream serves a capacityUpstream of c places (100 ms a request) until the test
// ends, and returns it and its URL.
func startCapacityUpstream(tb testing.TB, c int) (*capacityUpstream, string) {
	up := &capacityUpstream{service: 100 * time.Millisecond, c: c}
	us := httptest.NewServer(up)
	tb.Cleanup(us.Close)
	return up, us.URL
}

// setCapacity changes c; the requests queued that now fit start at once.
func (u *capacityUpstream) setCapacity(c int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.c = c
	for u.busy < u.c && len(u.queue) > 0 {
		close(u.queue[0])
		u.queue, u.busy = u.queue[1:], u.busy+1
	}
}

// window returns the requests that left the upstream in [from, to), and the time the requests
// that arrived then spent inside it, sorted.
func (u *capacityUpstream) window(from, to time.Time) (served int, inside []time.Duration) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, v := range u.visits {
		if !v.left.Before(from) && v.left.Before(to) {
			served++
		}
		if !v.arrived.Before(from) && v.arrived.Before(to) {
			inside = append(inside, v.left.Sub(v.arrived))
		}
	}
	slices.Sort(inside)
	return served, inside
}

// percentile is the p-th percentile (0 to 1) of sorted d, nearest rank.
func percentile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	return d[min(len(d)-1, int(p*float64(len(d))))]
}

// adaptiveSite is one Caddy instance's Caddyfile: admin on admin, a site on port whose zone
// `upstream` (adaptive_concurrency, one key for every client, a ceiling of ceiling, max_wait
// 10s, hold_max 3s) guards upstream; failMode is the handler's fail_mode.
func adaptiveSite(admin, port int, redisAddr, upstream string, ceiling int, failMode string) string {
	return slotSite(admin, port, redisAddr, upstream, "adaptive_concurrency", ceiling, failMode)
}

// slotSite is adaptiveSite with algorithm (concurrency or adaptive_concurrency) and its limit.
func slotSite(admin, port int, redisAddr, upstream, algorithm string, limit int, failMode string) string {
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
}
:%d {
	rate_limit_redis {
		redis {
			address %s
		}
		fail_mode %s
		zone upstream {
			algorithm %s
			key upstream
			limit %d
			max_wait 10s
			hold_max 3s
		}
	}
	reverse_proxy %s
}
`, admin, port, redisAddr, failMode, algorithm, limit, upstream)
}

// adaptiveInstance is one bin/caddy process of the test.
type adaptiveInstance struct {
	proc        *caddyProcess
	base, admin string
	port, aport int
}

// startAdaptiveInstances runs n bin/caddy processes of adaptiveSite.
func startAdaptiveInstances(t testing.TB, n int, redisAddr, upstream string, ceiling int, failMode string) []*adaptiveInstance {
	return startSlotInstances(t, n, redisAddr, upstream, "adaptive_concurrency", ceiling, failMode)
}

// startSlotInstances runs n bin/caddy processes of slotSite.
func startSlotInstances(t testing.TB, n int, redisAddr, upstream, algorithm string, limit int, failMode string) []*adaptiveInstance {
	t.Helper()
	caddyBin := os.Getenv("CADDY_BINARY")
	if caddyBin == "" {
		t.Skip("CADDY_BINARY is not set: run `make test`, which builds bin/caddy from this checkout and sets it")
	}
	out := make([]*adaptiveInstance, n)
	for i := range out {
		// A port picked free may be taken by another process before Caddy binds it: Caddy
		// then exits, and the instance starts again on other ports.
		for attempt := 1; ; attempt++ {
			port, aport := freeport.Must(t), freeport.Must(t)
			out[i] = &adaptiveInstance{port: port, aport: aport,
				base: "http://127.0.0.1:" + strconv.Itoa(port), admin: "http://127.0.0.1:" + strconv.Itoa(aport)}
			var err error
			out[i].proc, err = launchCaddyProcess(t, caddyBin, slotSite(aport, port, redisAddr, upstream, algorithm, limit, failMode), port)
			if err == nil {
				break
			}
			if !errors.Is(err, errExitedEarly) || attempt == 3 {
				t.Fatal(err)
			}
			t.Logf("instance %d, attempt %d: %v", i, attempt, err)
		}
	}
	return out
}

// limitGauge reads the instance's caddy_rate_limit_redis_concurrency_limit{zone="upstream"}; -1
// when it has none.
func (a *adaptiveInstance) limitGauge(t *testing.T) float64 {
	t.Helper()
	resp, err := http.Get(a.admin + "/metrics")
	if err != nil {
		t.Fatalf("metrics of %s: %v", a.admin, err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), `caddy_rate_limit_redis_concurrency_limit{zone="upstream"} `); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return -1
}

// closedLoop runs clients that each send a request to the instances in turn as soon as the last
// was answered (waiting 20 ms after a refusal), until stop is closed; it returns their refusals.
func closedLoop(clients int, insts []*adaptiveInstance, stop chan struct{}) (wait func() int64) {
	var wg sync.WaitGroup
	var refused atomic.Int64
	hc := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	for c := range clients {
		wg.Go(func() {
			for i := c; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := hc.Get(insts[i%len(insts)].base + "/")
				if err == nil {
					resp.Body.Close()
				}
				if err != nil || resp.StatusCode != http.StatusOK {
					refused.Add(1)
					time.Sleep(20 * time.Millisecond)
				}
			}
		})
	}
	return func() int64 { wg.Wait(); return refused.Load() }
}

// TestAdaptiveConcurrencyFindsCapacity: three Caddy processes (CADDY_BINARY) share an
// adaptive_concurrency zone (one key, a ceiling of 32, max_wait 10s) before an upstream that
// serves C requests at once for 100 ms each and queues the rest inside itself; 24 closed-loop
// clients. With C = 8, then 4, then 8 again, 20 s each, in the last 10 s of each phase the
// upstream serves at least 75% of its capacity (C per 100 ms), the time a request spends inside
// it is at most 160 ms at p50 and 250 ms at p99, and never more than 32 are inside at once (by
// Little's law, no limit would keep all 24 inside: 300 ms). Once the clients stop, one request
// through each instance, held inside the upstream so that nothing settles, makes the three
// gauges of the limit in force read the same value, Redis's.
func TestAdaptiveConcurrencyFindsCapacity(t *testing.T) {
	srv := redistest.Start(t)
	up, url := startCapacityUpstream(t, 8)
	insts := startAdaptiveInstances(t, 3, srv.Addr, url, 32, "open")

	stop := make(chan struct{})
	wait := closedLoop(24, insts, stop)
	const phase = 20 * time.Second
	for _, c := range []int{8, 4, 8} {
		up.setCapacity(c)
		start := time.Now()
		time.Sleep(phase / 2)
		var gauges []string
		for range 10 {
			time.Sleep(time.Second)
			var g []string
			for _, in := range insts {
				g = append(g, strconv.FormatFloat(in.limitGauge(t), 'f', -1, 64))
			}
			gauges = append(gauges, strings.Join(g, "/"))
		}
		served, inside := up.window(start.Add(phase/2), start.Add(phase))
		want := int(0.75 * float64(c) * (phase / 2).Seconds() / up.service.Seconds())
		p50, p99 := percentile(inside, 0.5), percentile(inside, 0.99)
		t.Logf("C=%d: served %d in the last 10s (capacity %d), inside p50 %v p99 %v; limit gauges each second: %s",
			c, served, want*4/3, p50.Round(time.Millisecond), p99.Round(time.Millisecond), strings.Join(gauges, " "))
		if served < want || p50 > 160*time.Millisecond || p99 > 250*time.Millisecond {
			t.Errorf("C=%d: served %d (want at least %d), inside p50 %v (want at most 160ms), p99 %v (want at most 250ms)",
				c, served, want, p50, p99)
		}
	}
	close(stop)
	refused := wait()
	if up.most > 32 {
		t.Errorf("%d requests inside the upstream at once, above the ceiling of 32", up.most)
	}
	t.Logf("refused (429 after max_wait, or errors): %d", refused)

	// Three requests held inside the upstream (capacity 0): no settlement can change the limit
	// while each instance decides one, so every gauge reads what Redis holds.
	up.setCapacity(0)
	var held sync.WaitGroup
	for _, in := range insts {
		held.Go(func() {
			if resp, err := http.Get(in.base + "/"); err == nil {
				resp.Body.Close()
			}
		})
	}
	redistest.WaitFor(t, 10*time.Second, "a request of each instance inside the upstream", func() bool {
		up.mu.Lock()
		defer up.mu.Unlock()
		return up.inside == 3
	})
	key := limiter.StateKey("rl:", &limiter.Zone{Name: "upstream", Algorithm: limiter.AdaptiveConcurrency}, "upstream") + ":ctl"
	inForce, _ := strconv.ParseFloat(fmt.Sprint(srv.Do("HGET", key, "e")), 64)
	for i, in := range insts {
		if g := in.limitGauge(t); g != inForce {
			t.Errorf("instance %d's limit gauge reads %v, Redis's limit in force is %v", i, g, inForce)
		}
	}
	up.setCapacity(8)
	held.Wait()
}

// reload loads the instance's adaptiveSite with ceiling through its admin endpoint, as `caddy
// reload` does.
func (a *adaptiveInstance) reload(t *testing.T, redisAddr, upstream string, ceiling int, failMode string) {
	t.Helper()
	body := adaptiveSite(a.aport, a.port, redisAddr, upstream, ceiling, failMode)
	resp, err := http.Post(a.admin+"/load", "text/caddyfile", strings.NewReader(body))
	if err != nil {
		t.Fatalf("reload: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("reload: %s", resp.Status)
	}
}

// mostInside returns the most requests inside the upstream at once since the last call.
func (u *capacityUpstream) mostInside() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	m := u.most
	u.most = u.inside
	return m
}

// TestAdaptiveConcurrencyFaults: three Caddy processes (CADDY_BINARY) with fail_mode closed share
// an adaptive_concurrency zone (a ceiling of 32, hold_max 3s) before an upstream of 8 places, with
// 40 closed-loop clients. Redis paused for 1 s: the upstream serves at least 75% of its capacity
// again within 5 s; an instance killed with SIGKILL, within 9 s (its slots free after hold_max,
// its waiters' grants after the queue's lease and claim, 3 s each). A reload of the two
// instances left to a ceiling of 6 applies at once (never more than 6 inside the upstream once
// the slots taken under the old ceiling are down to 6). Never more than the ceiling inside the upstream; once the clients stop, every
// slot is free within hold_max (the killed instance's and those whose settlement Redis missed
// while paused: none leaks).
func TestAdaptiveConcurrencyFaults(t *testing.T) {
	srv := redistest.Start(t)
	up, url := startCapacityUpstream(t, 8)
	insts := startAdaptiveInstances(t, 3, srv.Addr, url, 32, "closed")
	stop := make(chan struct{})
	wait := closedLoop(40, insts, stop)
	recovered := func(what string, within time.Duration) {
		t.Helper()
		start := time.Now()
		time.Sleep(within)
		served, _ := up.window(start.Add(within-3*time.Second), start.Add(within))
		if want := int(0.75 * 8 * 3 / 0.1); served < want {
			t.Errorf("after %s: the upstream served %d in the last 3 s of %v, want at least %d (75%% of 8 per 100ms)", what, served, within, want)
		}
		t.Logf("after %s: served %d in 3 s (capacity 240), limit gauge %v", what, served, insts[0].limitGauge(t))
	}
	recovered("the start", 5*time.Second)
	srv.Pause()
	time.Sleep(time.Second)
	srv.Resume()
	recovered("Redis paused 1 s", 5*time.Second)
	if err := insts[2].proc.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	// Its slots free after hold_max (3s); its waiters stay in the queue up to QueueLease (3s)
	// after their last renewal, and a slot granted to one waits QueueClaim (3s) for its claim.
	recovered("an instance killed", 9*time.Second)
	if most := up.mostInside(); most > 32 {
		t.Errorf("%d requests inside the upstream at once, above the ceiling of 32", most)
	}

	for _, in := range insts[:2] {
		in.reload(t, srv.Addr, url, 6, "closed")
	}
	slots := limiter.StateKey("rl:", &limiter.Zone{Name: "upstream", Algorithm: limiter.AdaptiveConcurrency}, "upstream")
	live := func() any { return srv.Do("ZCOUNT", slots, fmt.Sprintf("(%d", srv.Time().UnixMicro()), "+inf") }
	// Once the slots admitted under the old ceiling are down to 6, no admission takes them
	// above it again, nor the requests inside the upstream (each holds a slot).
	redistest.WaitFor(t, 5*time.Second, "the slots of the old ceiling given back", func() bool { return live().(int64) <= 6 })
	up.mostInside()
	time.Sleep(3 * time.Second) // the window watched
	if most := up.mostInside(); most > 6 {
		t.Errorf("after the reload to a ceiling of 6: %d requests inside the upstream at once", most)
	}
	close(stop)
	wait()
	redistest.WaitFor(t, 4*time.Second, "every slot free within hold_max", func() bool { return live() == int64(0) })
}
