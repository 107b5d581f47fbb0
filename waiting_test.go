package ratelimitredis

// Shaping with max_wait (waiting.go, and the holds of admit.go): a zone's max_wait admits a
// request it would serve within max_wait by reserving its tokens in Redis, and the handler holds
// the request on a timer until its turn. The tests measure the holds (when each request is
// released against the turn Redis gave it, how soon a client that leaves frees its goroutine,
// what a held request costs) and the waiting room's fair share.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// shapedGet is one GET /shaped through cs from the client address ip (X-Forwarded-For, the
// server trusting loopback), with X-API-Key key when not empty: the status and the milliseconds
// the body says it waited; status 0 when the request failed (its context ended).
func shapedGet(ctx context.Context, cs *caddytest.Site, ip, key string) (status, waited int) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, cs.Base+"/shaped", nil)
	if err != nil {
		return 0, 0
	}
	req.Header.Set("X-Forwarded-For", ip)
	if key != "" {
		req.Header.Set("X-API-Key", key)
	}
	resp, err := caddytest.Client(30 * time.Second).Do(req)
	if err != nil {
		return 0, 0
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	waited, _ = strconv.Atoi(strings.TrimPrefix(string(b), "ok waited="))
	return resp.StatusCode, waited
}

// TestShapingFairShare (shaping_flood.py against the reproduction's S9):
// max_waiting 20, capacity 2, refill 1/s, max_wait 10s, keyed on the API key or the address.
// One address sends 24 requests at once under two invented API keys: each key holds at most
// its share, 2 places (a tenth), the rest of its burst is decided without waiting. Another
// client's burst of 4 then still waits: 200 200 at once, then 200 after about 1s and 2s, no 429.
func TestShapingFairShare(t *testing.T) {
	srv := redistest.Start(t)
	cs := caddytest.StartSites(t, "\t\ttrusted_proxies static 127.0.0.1/32", fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		max_waiting 20
		zone shapedfair {
			match path /shaped
			key {http.request.header.X-API-Key} {client_ip}
			capacity 2
			refill_rate 1
			max_wait 10s
		}
	}
	respond "ok waited={http.rate_limit_redis.waited}"`, srv.Addr))[0]

	flood, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var mu sync.Mutex
	answered := map[int]int{} // status: count, of the flood's requests answered
	for i := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			status, _ := shapedGet(flood, cs, "198.51.100.77", "inv-"+strconv.Itoa(i%2))
			mu.Lock()
			answered[status]++
			mu.Unlock()
		}()
	}
	t.Cleanup(func() { stop(); wg.Wait() })
	done := func() int {
		mu.Lock()
		defer mu.Unlock()
		n := 0
		for _, c := range answered {
			n += c
		}
		return n
	}
	// Every request of the flood answered or held: its places are taken.
	redistest.WaitFor(t, 10*time.Second, "the flood's requests to be answered or held", func() bool { return done()+int(waitingNow(t)) == 24 })
	floodHeld := waitingNow(t)
	mu.Lock()
	floodAnswered := maps.Clone(answered)
	mu.Unlock()

	type result struct{ status, waited int }
	victim := make([]result, 4)
	var vwg sync.WaitGroup
	for i := range victim {
		vwg.Add(1)
		go func() {
			defer vwg.Done()
			s, w := shapedGet(context.Background(), cs, "203.0.113.50", "")
			victim[i] = result{s, w}
		}()
	}
	vwg.Wait()
	slices.SortFunc(victim, func(a, b result) int { return a.waited - b.waited })
	t.Logf("the flood holds %v places (answered: %v); the other client's burst: %v", floodHeld, floodAnswered, victim)
	for i, r := range victim {
		if r.status != 200 {
			t.Fatalf("the other client's burst of 4 while the flood waits: %v; want 200 x4, two of them held", victim)
		}
		lo, hi := (i-1)*1000-300, (i-1)*1000 // the 3rd waits up to 1s, the 4th up to 2s
		if i < 2 {
			lo, hi = 0, 0
		}
		if r.waited < lo || r.waited > hi {
			t.Fatalf("the other client's burst: %v; want waits of 0, 0, about 1000 and about 2000 ms", victim)
		}
	}
	if floodHeld != 4 {
		t.Fatalf("the flood held %v places, want 4: 2 per API key, a tenth of max_waiting 20", floodHeld)
	}
	if floodAnswered[200] != 4 || floodAnswered[429] != 16 {
		t.Fatalf("the flood's answers while 4 were held: %v, want 4 x 200 (the capacity of each key) and 16 x 429", floodAnswered)
	}
}

// TestShapingFairShareLiteralKey: a zone keyed on a literal (one bucket for the whole site)
// tells no clients apart, so places are counted per client address instead: with max_waiting
// 20 (a share of 2), 5 requests from one address hold 2 places and the other 3 get 429, and 5
// requests from 5 addresses are all held.
func TestShapingFairShareLiteralKey(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, MaxWaiting: new(20), Zones: []*Zone{{
		Name: "shapesite", Key: []string{"site"}, Capacity: NumberOf(1), RefillRate: NumberOf(1), MaxWait: new(caddy.Duration(10 * time.Second)),
	}}})
	serveTimed(h, clientRequest("a")) // the token
	for _, tc := range []struct {
		addrs      int // the 5 requests come from this many addresses
		held, r429 int
	}{{1, 2, 3}, {5, 5, 0}} {
		ctx, cancel := context.WithCancel(context.Background())
		results := make(chan timed, 5)
		for i := range 5 {
			r := clientRequest(strconv.Itoa(i)).WithContext(ctx)
			r.RemoteAddr = "192.0.2." + strconv.Itoa(1+i%tc.addrs) + ":1234"
			go func() { results <- serveTimed(h, r) }()
		}
		got := map[int]int{}
		redistest.WaitFor(t, 5*time.Second, "the refused answered and the others held", func() bool {
			for len(results) > 0 {
				got[(<-results).status]++
			}
			return got[429] == tc.r429 && h.waiting.held() == tc.held
		})
		cancel()
		for range tc.held {
			if r := <-results; r.status != 499 {
				t.Fatalf("%d addresses: a held request: %d, want 499 when its client left", tc.addrs, r.status)
			}
		}
		if n := h.waiting.held(); n != 0 {
			t.Fatalf("%d places taken after the clients left, want 0", n)
		}
	}
}

// TestWaitingRoomShare: a room of 20 gives each key a share of 2. A key's third request waits
// while its share is being decided; a decision that holds keeps the place, one that does not
// gives it to the waiting request; with the share held, the next is refused at once, and a
// waiting request whose context ends is refused. The room's own bound still applies.
func TestWaitingRoomShare(t *testing.T) {
	w := newWaitingRoom(20)
	k := []waitingKey{{"z", "alice"}}
	a, b := placeDeciding, placeDeciding
	for i := range 2 {
		if !w.enter(context.Background(), k, true) {
			t.Fatalf("alice's request %d gets no place", i+1)
		}
	}
	third := make(chan bool, 1)
	go func() { third <- w.enter(context.Background(), k, true) }()
	w.hold(k, &a) // held: the place stays alice's
	select {
	case ok := <-third:
		t.Fatalf("the third request got an answer (%t) while alice's share was taken", ok)
	case <-time.After(50 * time.Millisecond): // checking that nothing happens
	}
	w.leave(k, &b, nil) // decided not to be held: its place goes to the third
	if !<-third {
		t.Fatal("the third request got no place after a request of alice's share left")
	}
	c := placeDeciding
	w.hold(k, &c)
	if w.enter(context.Background(), k, true) {
		t.Fatal("a fourth request got a place while alice's share is held")
	}
	if !w.enter(context.Background(), []waitingKey{{"z", "bob"}}, true) {
		t.Fatal("bob gets no place while alice holds her share")
	}
	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan bool, 1)
	go func() { left <- w.enter(ctx, []waitingKey{{"z", "bob"}, {"ip", "b"}}, true) }() // bob's share: 1 deciding, 1 more
	if !<-left {
		t.Fatal("bob's second request got no place")
	}
	go func() { left <- w.enter(ctx, []waitingKey{{"z", "bob"}}, true) }()
	cancel()
	if <-left {
		t.Fatal("a request waiting for bob's decisions got a place after its context ended")
	}
	for i := range 20 {
		w.enter(context.Background(), []waitingKey{{"z", "c" + strconv.Itoa(i)}}, true)
	}
	if n := w.held(); n != 20 {
		t.Fatalf("%d places taken, want the room's 20", n)
	}
}

// TestShapingNetworkShare (shaping_many.py): max_waiting 20, so a share of 2 places per client
// key; a zone keyed by address, capacity 1, refill 1/10s, max_wait 30s. Ten IPv6 /64s of one
// /56, one after the other, each spend their token, then send 11 requests at once. Keyed by
// /64 (ipv6_prefix 64, the default) they are ten clients: each holds its share, together all
// 20 places, and another client, its token spent, gets 429 where it would have waited. The
// share bounds one client key, not a network. With ipv6_prefix 48 on the zone the ten /64s are
// one client: they hold 2 places, and the other client's request is held for its turn.
func TestShapingNetworkShare(t *testing.T) {
	for _, tc := range []struct {
		prefix string
		held   float64 // places the flood holds
		other  int     // the other client's second request: 429, or 0 (held, then cancelled)
	}{
		{"64", 20, 429},
		{"48", 2, 0},
	} {
		t.Run("ipv6_prefix "+tc.prefix, func(t *testing.T) {
			srv := redistest.Start(t)
			cs := caddytest.StartSites(t, "\t\ttrusted_proxies static 127.0.0.1/32", fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		max_waiting 20
		zone shapednet {
			key {client_ip}
			ipv6_prefix %s
			capacity 1
			refill_rate 1/10s
			max_wait 30s
		}
	}
	respond "ok waited={http.rate_limit_redis.waited}"`, srv.Addr, tc.prefix))[0]
			ctx, stop := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			t.Cleanup(func() { stop(); wg.Wait() })
			var answered atomic.Int64
			send := func(ip string) {
				wg.Add(1)
				go func() {
					defer wg.Done()
					shapedGet(ctx, cs, ip, "")
					answered.Add(1)
				}()
			}
			for a := range 10 {
				ip := fmt.Sprintf("2001:db8:0:%x::1", a)
				shapedGet(ctx, cs, ip, "") // its token, or (one /48) held or refused
				for range 11 {
					send(ip)
				}
				redistest.WaitFor(t, 10*time.Second, "the requests of "+ip+" to be answered or held", func() bool {
					return answered.Load()+int64(waitingNow(t)) == int64(11*(a+1))
				})
			}
			if held := waitingNow(t); held != tc.held {
				t.Fatalf("the ten /64s hold %v places, want %v", held, tc.held)
			}
			if s, _ := shapedGet(ctx, cs, "203.0.113.50", ""); s != 200 {
				t.Fatalf("the other client's first request: %d, want 200", s)
			}
			other := make(chan int, 1)
			octx, cancel := context.WithCancel(ctx)
			go func() {
				s, _ := shapedGet(octx, cs, "203.0.113.50", "")
				other <- s
			}()
			redistest.WaitFor(t, 10*time.Second, "the other client's second request to be answered or held", func() bool {
				return len(other) > 0 || waitingNow(t) > tc.held
			})
			cancel()
			if s := <-other; s != tc.other {
				t.Fatalf("the other client's second request: %d, want %d (0: held, then cancelled)", s, tc.other)
			}
		})
	}
}

// TestShapingThreeInstances is the "done when": 3 instances (handlers, each with its
// own Redis client, deny cache and waiting room), one client, capacity 10, refill_rate 10,
// max_wait 2s, 60 requests sent at once. The first 10 pass at once; the next 20 are held and
// each is released after its turn, never before it: the turn its decision's delay gave it, read
// back from the bucket in Redis, 100ms apart over 2s, each turn taken once whichever instance
// held it; the last 30 get 429 with Retry-After. 30 admitted in all.
//
// A request's turn is its decision's time plus its delay, so it lies between the request's
// start plus its delay and its release: a release after its turn, each turn taken once, is a
// matching of every held request to a distinct turn inside that interval. How late after its
// turn a request is released is logged, not bounded tightly: a loaded machine decides requests
// and wakes timers late (a release 62ms after its turn failed a fixed 50ms bound, medians of 18ms
// came near the 20ms one, a timer woke 109ms late), and a bound it cannot keep is a speed claim,
// not this property; only a hold a second beyond its delay (a hold twice too long) fails it. For the same reason a request that passed at once is known by its delay, 0
// (waited), not by being released before the first turn.
func TestShapingThreeInstances(t *testing.T) {
	srv := redistest.Start(t)
	reg := prometheus.NewRegistry()
	if err := registerMetrics(reg); err != nil {
		t.Fatal(err)
	}
	const zone = "shape3"
	var hs []*Handler
	for i := range 3 {
		// A loaded machine must not make a decision fail open (100ms by default): each request's
		// outcome is counted.
		hs = append(hs, provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}, PoolSize: 10 + i},
			Timeout: caddy.Duration(10 * time.Second), Zones: []*Zone{shapingZone(zone)}}))
	}
	if hs[0].client == hs[1].client || hs[1].client == hs[2].client || hs[0].client == hs[2].client {
		t.Fatal("the handlers share a Redis client; want one each, as instances have")
	}
	for i, h := range hs { // each instance connected to Redis before the burst
		if r := serveTimed(h, clientRequest("warm-up-"+strconv.Itoa(i))); r.status != 200 {
			t.Fatalf("warm-up: %+v", r)
		}
	}
	value := func(name string, labels ...string) float64 { return metricValue(t, reg, name, labels...) }
	allowedBefore, delayedBefore, deniedBefore := value(metricDecisions, "zone", zone, "result", "allowed"),
		value(metricDecisions, "zone", zone, "result", "delayed"), value(metricDecisions, "zone", zone, "result", "denied")
	observedBefore := value(metricDelay, "zone", zone)

	results := make([]timed, 60)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() {
			<-start
			results[i] = serveTimed(hs[i%3], clientRequest("alice"))
		})
	}
	burst := time.Now()
	close(start)
	wg.Wait()

	var now, held []timed
	denied, perInstance := 0, [3]int{}
	for i, r := range results {
		switch {
		case r.status == 429:
			denied++
			if got := r.header.Get("Retry-After"); got != "1" {
				t.Errorf("429: Retry-After %q, want 1 (the 100ms until a request would be held 2s)", got)
			}
			continue
		case r.status != 200:
			t.Fatalf("request %d: %+v", i, r)
		case r.waited == "0":
			now = append(now, r)
		default:
			held = append(held, r)
		}
		perInstance[i%3]++
		if got := r.header.Get("X-RateLimit-Remaining"); r.waited != "0" && got != "0" {
			t.Errorf("a held request: X-RateLimit-Remaining %q, want 0", got)
		}
	}
	if len(now) != 10 || len(held) != 20 || denied != 30 {
		t.Fatalf("%d passed at once, %d held, %d got 429; want 10, 20, 30", len(now), len(held), denied)
	}
	ts := turns(t, srv, &hs[0].Zones[0].lz, "alice", 20)
	if span := ts[19].Sub(ts[0]); span < 1900*time.Millisecond-10*time.Microsecond || span > 1900*time.Millisecond+10*time.Microsecond {
		t.Fatalf("the turns span %v, want 1.9s (20 turns 100ms apart)", span)
	}
	// Each held request is matched to a distinct turn in [start + delay, release] (the delay is
	// `waited` rounded up to the ms; 1ms of slack between this process's clock and Redis's):
	// intervals by their end, each taking the earliest free turn in it, finds a matching when
	// there is one.
	const slack = time.Millisecond
	slices.SortFunc(held, func(a, b timed) int { return a.released.Compare(b.released) })
	taken := make([]bool, len(ts))
	var lates []time.Duration
	for _, r := range held {
		w, err := strconv.Atoi(r.waited)
		if err != nil || w < 1 || w > 2000 {
			t.Fatalf("waited %q, want 1 to 2000 ms", r.waited)
		}
		from := r.start.Add(time.Duration(w)*time.Millisecond - time.Millisecond - slack)
		k := slices.IndexFunc(ts, func(turn time.Time) bool { return !turn.Before(from) })
		for k >= 0 && k < len(ts) && taken[k] {
			k++
		}
		if k < 0 || k == len(ts) || r.released.Before(ts[k].Add(-slack)) {
			t.Fatalf("a request started %s, held %sms, released %s: no free turn between its start plus its delay and its release, of %v",
				r.start.Format("15:04:05.000000"), r.waited, r.released.Format("15:04:05.000000"), ts)
		}
		// Not a speed claim: a guard against a hold far longer than its delay (twice a delay of
		// up to 2s), with a second of room for a loaded machine's late decisions and timers.
		if held := r.released.Sub(r.start); held > time.Duration(w)*time.Millisecond+time.Second {
			t.Fatalf("a request started %s with a delay of %sms was released %v after its start: held far beyond its delay",
				r.start.Format("15:04:05.000000"), r.waited, held)
		}
		taken[k] = true
		lates = append(lates, r.released.Sub(ts[k]))
	}
	slices.Sort(lates)
	t.Logf("burst at %s; turns %s to %s; admitted per instance %v; released after their turn by %v (median) to %v (max)",
		burst.Format("15:04:05.000000"), ts[0].Format("15:04:05.000000"), ts[19].Format("15:04:05.000000"), perInstance, lates[10], lates[19])
	if got := value(metricDecisions, "zone", zone, "result", "allowed") - allowedBefore; got != 10 {
		t.Errorf("allowed +%v, want +10", got)
	}
	if got := value(metricDecisions, "zone", zone, "result", "delayed") - delayedBefore; got != 20 {
		t.Errorf("delayed +%v, want +20", got)
	}
	if got := value(metricDecisions, "zone", zone, "result", "denied") - deniedBefore; got != 30 {
		t.Errorf("denied +%v, want +30", got)
	}
	if got := value(metricDelay, "zone", zone) - observedBefore; got != 20 {
		t.Errorf("delay_seconds observed %v delays, want 20", got)
	}
	for _, h := range hs {
		if n := h.waiting.held(); n != 0 {
			t.Errorf("a handler counts %d requests waiting after the burst", n)
		}
	}
	if n := waitingNow(t); n != 0 {
		t.Errorf("waiting gauge %v after the burst, want 0", n)
	}
}

// TestShapingClientLeaves: a held request whose client goes away (its context cancelled, as
// net/http does when the connection closes) ends at once, within 10ms, with 499, the next
// handler never run; its tokens stay spent. Then the same over a real connection closed by the
// client: the held request's goroutine is gone within 10ms.
func TestShapingClientLeaves(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Zones: []*Zone{{
		Name: "shapegone", Key: []string{"{http.request.header.X-Client}"}, Capacity: NumberOf(1), RefillRate: NumberOf(1), MaxWait: new(caddy.Duration(30 * time.Second)),
	}}})
	serveTimed(h, clientRequest("alice")) // the token
	var worst time.Duration
	for i := range 10 {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan timed, 1)
		go func() { done <- serveTimed(h, clientRequest("alice").WithContext(ctx)) }()
		redistest.WaitFor(t, 5*time.Second, "the request to be held", func() bool { return waitingNow(t) == 1 })
		left := time.Now()
		cancel()
		r := <-done
		took := r.returned.Sub(left)
		worst = max(worst, took)
		if took > 10*time.Millisecond || r.status != 499 || !r.released.IsZero() {
			t.Fatalf("client %d left: ended %v later with %d (next handler ran: %t); want within 10ms, 499, not run", i, took, r.status, !r.released.IsZero())
		}
		// Held from its decision until the client left: less than the request's whole time.
		if w, err := strconv.Atoi(r.waited); err != nil || w < 1 || time.Duration(w-1)*time.Millisecond > r.returned.Sub(r.start) {
			t.Fatalf("waited %q, want the time it was held: 1ms to the %v it took in all", r.waited, r.returned.Sub(r.start))
		}
	}
	if n := h.waiting.held(); n != 0 || waitingNow(t) != 0 {
		t.Fatalf("%d places taken, gauge %v, after the clients left; want 0", n, waitingNow(t))
	}
	st, err := h.limiter.State(context.Background(), &h.Zones[0].lz, "alice")
	if err != nil {
		t.Fatal(err)
	}
	if st.Tokens > -9 { // 10 reservations of 1s each, made within the last second
		t.Fatalf("after 10 clients left: %.2f tokens, want below -9: their reservations stay spent", st.Tokens)
	}

	// Through Caddy, over a connection the client closes.
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone shapegone2 {
			key {http.request.header.X-Client}
			capacity 1
			refill_rate 1
			max_wait 5s
		}
	}
	respond "ok"`, srv.Addr))
	cs.Get("/", "X-Client", "bob").Expect(t, "the token", 200, "ok")
	conn, err := net.Dial("tcp", strings.TrimPrefix(cs.Base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\nX-Client: bob\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	redistest.WaitFor(t, 5*time.Second, "the request to be held", func() bool { return waitingNow(t) == 1 })
	left := time.Now()
	_ = conn.Close()
	for waitingNow(t) != 0 { // a tight poll: the point is how soon
		if time.Since(left) > 2*time.Second {
			t.Fatal("the held request outlived its closed connection by 2s")
		}
		time.Sleep(100 * time.Microsecond)
	}
	gone := time.Since(left)
	if gone > 10*time.Millisecond {
		t.Fatalf("the held request ended %v after its client closed the connection, want within 10ms", gone)
	}
	t.Logf("a held request ends %v (worst of 10, context cancelled) and %v (connection closed) after its client leaves", worst, gone)
}

// TestShapingThroughCaddy: a held request's response, through Caddy: 200 after the wait, with
// {http.rate_limit_redis.waited}, X-RateLimit-Remaining 0, the reset counted from the release
// and no Retry-After; counted as delayed, its delay observed. max_waiting: a request that would
// wait while the handler holds as many as it may is a 429 and charges nothing. dry_run: decided,
// charged, reported and counted as held, never held.
func TestShapingThroughCaddy(t *testing.T) {
	srv := redistest.Start(t)
	handler := func(path, zone, rate, maxWait, extra string) string {
		return fmt.Sprintf(`
	handle %s {
		rate_limit_redis {
			redis {
				address %s
			}
			headers both%s
			zone %s {
				key {http.request.header.X-Client}
				capacity 2
				refill_rate %s
				max_wait %s
			}
		}
		respond "allowed={http.rate_limit_redis.allowed} waited={http.rate_limit_redis.waited} remaining={http.rate_limit_redis.remaining} retry={http.rate_limit_redis.retry_after}"
	}`, path, srv.Addr, extra, zone, rate, maxWait)
	}
	cs := caddytest.Start(t, handler("/real", "shapec", "10", "1s", "")+handler("/slow", "shapes", "1", "5s", "\n\t\t\tmax_waiting 1")+
		handler("/dry", "shaped", "10", "1s", "\n\t\t\tdry_run")+`
	handle_errors {
		respond "{err.status_code} waited={http.rate_limit_redis.waited}"
	}`)
	reg := activeRegistry(t)
	before := takeSnapshot(t, reg, "shapec", "shapes", "shaped")
	delays := func() [3]float64 {
		return [3]float64{metricValue(t, reg, metricDelay, "zone", "shapec"), metricValue(t, reg, metricDelay, "zone", "shapes"),
			metricValue(t, reg, metricDelay, "zone", "shaped")}
	}
	delaysBefore := delays()

	cs.Get("/real", "X-Client", "a").Expect(t, "1st", 200, "allowed=true waited=0 remaining=1 retry=0")
	cs.Get("/real", "X-Client", "a").Expect(t, "2nd", 200, "allowed=true waited=0 remaining=0 retry=0")
	sent := time.Now()
	r := cs.Get("/real", "X-Client", "a")
	took := time.Since(sent)
	var waited int
	if _, err := fmt.Sscanf(r.Body, "allowed=true waited=%d remaining=0 retry=0", &waited); err != nil || r.Status != 200 || waited < 1 || waited > 100 {
		t.Fatalf("3rd: %d %q, want 200 and held up to 100ms", r.Status, r.Body)
	}
	if took < time.Duration(waited-1)*time.Millisecond {
		t.Fatalf("3rd: answered %v after it was sent, but says it waited %dms", took, waited)
	}
	// Released with no token left, the bucket is full again 2 tokens later: 200ms, 1s.
	r.Expect(t, "3rd", 200, r.Body, "X-RateLimit-Remaining", "0", "X-RateLimit-Reset", "1", "RateLimit", `"shapec";r=0;t=1`, "Retry-After", "")

	// max_waiting 1: while one request is held, another that would wait is a 429 at once, and
	// charges nothing.
	cs.Get("/slow", "X-Client", "b").Expect(t, "b 1st", 200, "allowed=true waited=0 remaining=1 retry=0")
	cs.Get("/slow", "X-Client", "b").Expect(t, "b 2nd", 200, "allowed=true waited=0 remaining=0 retry=0")
	heldDone := make(chan caddytest.Response, 1)
	go func() { heldDone <- cs.Get("/slow", "X-Client", "b") }()
	redistest.WaitFor(t, 5*time.Second, "the request to be held", func() bool { return waitingNow(t) == 1 })
	full := cs.Get("/slow", "X-Client", "b")
	if full.Status != 429 || full.Body != "429 waited=0" || full.Header.Get("Retry-After") != "2" {
		t.Fatalf("a second request while max_waiting 1 is held: %d %q Retry-After %q; want 429, waited 0, Retry-After 2 (a wait of up to 2s)",
			full.Status, full.Body, full.Header.Get("Retry-After"))
	}
	first := <-heldDone
	if _, err := fmt.Sscanf(first.Body, "allowed=true waited=%d", &waited); err != nil || first.Status != 200 || waited < 900 || waited > 1000 {
		t.Fatalf("the held one: %d %q, want 200 after about 1s", first.Status, first.Body)
	}
	st, err := limiter.New(srv.Client(), limiter.Options{KeyPrefix: DefaultKeyPrefix}).State(context.Background(),
		&limiter.Zone{Name: "shapes", Algorithm: limiter.TokenBucket, Capacity: 2, RefillRate: 1}, "b")
	if err != nil || st.Tokens < -0.1 || st.Tokens > 0.1 {
		t.Fatalf("bucket b after the held request's release: %+v, %v; want about 0 tokens (the 429 charged nothing)", st, err)
	}

	// dry_run: never held; reported and counted as if it were.
	cs.Get("/dry", "X-Client", "c").Expect(t, "dry 1st", 200, "allowed=true waited=0 remaining=1 retry=0")
	cs.Get("/dry", "X-Client", "c").Expect(t, "dry 2nd", 200, "allowed=true waited=0 remaining=0 retry=0")
	sent = time.Now()
	r = cs.Get("/dry", "X-Client", "c")
	took = time.Since(sent)
	if _, err := fmt.Sscanf(r.Body, "allowed=true waited=%d remaining=0 retry=0", &waited); err != nil || r.Status != 200 || waited < 50 || waited > 100 {
		t.Fatalf("dry 3rd: %d %q, want 200, reporting a wait of up to 100ms", r.Status, r.Body)
	}
	if took >= time.Duration(waited)*time.Millisecond {
		t.Fatalf("dry 3rd: answered %v after it was sent: held, in dry_run", took)
	}

	expectDeltas(t, "shaping through Caddy", before, takeSnapshot(t, reg, "shapec", "shapes", "shaped"), map[string]float64{
		"calls":                10,
		"shapec/allowed":       2,
		"shapec/delayed":       1,
		"shapes/allowed":       2,
		"shapes/delayed":       1,
		"shapes/denied":        1,
		"shaped/allowed":       2,
		"shaped/delayed":       1,
		"failure/called":       0,
		"failure/circuit_open": 0,
	})
	if got := delays(); got != [3]float64{delaysBefore[0] + 1, delaysBefore[1] + 1, delaysBefore[2] + 1} {
		t.Fatalf("delays observed %v, before %v: want one more per zone", got, delaysBefore)
	}
}

// TestShapingFailLocal: with Redis unreachable and fail_mode local, the in-process limiter
// shapes as Redis would: capacity 2, refill 10/s, max_wait 300ms, 6 requests at one instant
// (a stopped clock): 2 at once, 3 held exactly 100, 200 and 300ms (each released no earlier
// than its delay), 1 denied; all with X-RateLimit-Degraded.
func TestShapingFailLocal(t *testing.T) {
	at := time.Now()
	h := provisioned(t, &Handler{
		now:      func() time.Time { return at },
		Redis:    &RedisConfig{Addresses: []string{"127.0.0.1:" + strconv.Itoa(freeport.Must(t))}},
		FailMode: FailLocal,
		Zones: []*Zone{{Name: "shapelocal", Key: []string{"{http.request.header.X-Client}"}, Capacity: NumberOf(2), RefillRate: NumberOf(10),
			MaxWait: new(caddy.Duration(300 * time.Millisecond))}},
	})
	results := make([]timed, 6)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() {
			<-start
			results[i] = serveTimed(h, clientRequest("alice"))
		})
	}
	close(start)
	wg.Wait()
	var waits []int
	denied := 0
	for _, r := range results {
		if r.header.Get("X-RateLimit-Degraded") != "true" {
			t.Errorf("no X-RateLimit-Degraded: %v", r.header)
		}
		if r.status == 429 {
			denied++
			continue
		}
		w, err := strconv.Atoi(r.waited)
		if err != nil || r.status != 200 {
			t.Fatalf("%+v", r)
		}
		waits = append(waits, w)
		// Released no earlier than its wait; the upper bound only catches a hold that is not
		// a timer (a request held twice over), with room for a loaded machine's scheduling.
		if held := r.released.Sub(r.start); held < time.Duration(w)*time.Millisecond || held > time.Duration(w)*time.Millisecond+time.Second {
			t.Errorf("waited %dms but released %v after it came", w, held)
		}
	}
	slices.Sort(waits)
	if denied != 1 || !slices.Equal(waits, []int{0, 0, 100, 200, 300}) {
		t.Fatalf("waits %v (ms) and %d denied; want 0 0 100 200 300 and 1", waits, denied)
	}
}

// TestShapingAdminShowsDebt: the admin API shows a bucket in debt: negative tokens, the wait a
// request of cost 1 would be held, and no retry after while that wait is within max_wait. The
// debt is made by dry_run, which charges as enforcement does but never holds.
func TestShapingAdminShowsDebt(t *testing.T) {
	srv := redistest.Start(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		dry_run
		zone debt {
			key {http.request.header.X-Client}
			capacity 10
			refill_rate 1
			max_wait 20s
		}
	}
	respond "ok"`, srv.Addr))
	start := time.Now()
	for range 15 { // 10 tokens, then 5 reservations
		ac.Get("/", "X-Client", "d").Expect(t, "dry run", 200, "ok")
	}
	zones := adminJSON[[]adminapi.ZoneInfo](t, ac, http.MethodGet, "/rate_limit_redis/zones", 200)
	if len(zones) != 1 || zones[0].MaxWaitMs != 20000 {
		t.Fatalf("zones: %+v, want max_wait_ms 20000", zones)
	}
	st := adminJSON[[]adminapi.ClientState](t, ac, http.MethodGet, "/rate_limit_redis/state?zone=debt&key=d", 200)
	if len(st) != 1 || st[0].Tokens == nil || st[0].WaitMs == nil {
		t.Fatalf("state: %+v", st)
	}
	s := st[0]
	// 5 tokens owed, less what refilled since the first request (1 a second), and the wait for
	// one token (6 s) less that.
	refilled := time.Since(start).Seconds()
	if *s.Tokens > -5+refilled || *s.Tokens < -5 || s.Remaining != 0 || s.RetryAfterMs != 0 ||
		float64(*s.WaitMs) < 6000-1000*refilled-1 || *s.WaitMs > 6000 {
		t.Fatalf("state in debt: tokens %v, remaining %d, retry_after_ms %d, wait_ms %d; want -5 to %.3f, 0, 0, %.0f to 6000",
			*s.Tokens, s.Remaining, s.RetryAfterMs, *s.WaitMs, -5+refilled, 6000-1000*refilled)
	}
}

// TestShapingConfig: max_waiting defaults to 1000 where a zone has a max_wait; the JSON config
// is checked as the Caddyfile is.
func TestShapingConfig(t *testing.T) {
	srv := redistest.Start(t)
	redisCfg := &RedisConfig{Addresses: []string{srv.Addr}}
	if h := provisioned(t, &Handler{Redis: redisCfg, Zones: []*Zone{shapingZone("z")}}); h.MaxWaiting == nil || *h.MaxWaiting != DefaultMaxWaiting {
		t.Fatalf("max_waiting %v, want the default %d", h.MaxWaiting, DefaultMaxWaiting)
	}
	if h := provisioned(t, &Handler{Redis: redisCfg, Zones: []*Zone{{Name: "z", Capacity: NumberOf(1), RefillRate: NumberOf(1)}}}); h.MaxWaiting != nil {
		t.Fatalf("max_waiting %d without max_wait, want none (nothing in the JSON)", *h.MaxWaiting)
	}
	for _, tc := range []struct {
		h    *Handler
		want string
	}{
		{&Handler{Zones: []*Zone{{Name: "w", Algorithm: "sliding_window", Limit: NumberOf(5), Window: NumberOf(caddy.Duration(time.Minute)), MaxWait: new(caddy.Duration(time.Second))}}},
			"zone w: max_wait applies to algorithm token_bucket only, not sliding_window: a window gives its quota back in steps, so a held request would have no exact turn; shape with a token_bucket zone"},
		{&Handler{Zones: []*Zone{{Name: "a", Capacity: NumberOf(1), RefillRate: NumberOf(1), MaxWait: new(caddy.Duration(2 * time.Minute))}}},
			"zone a: max_wait 2m0s is longer than 1m0s: a request held that long outlasts most clients' timeouts; let it come back instead (429 and Retry-After)"},
		{&Handler{MaxWaiting: new(-1), Zones: []*Zone{{Name: "a", Capacity: NumberOf(1), RefillRate: NumberOf(1)}}}, "max_waiting -1 must be >= 1"},
	} {
		tc.h.Redis = redisCfg
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		err := tc.h.Provision(ctx)
		if err == nil {
			err = tc.h.Validate()
		}
		_ = tc.h.Cleanup()
		cancel()
		if err == nil || err.Error() != tc.want {
			t.Errorf("got %v, want %s", err, tc.want)
		}
	}
}

// TestShapingCostPerHeldRequest measures what holding requests costs Caddy: N requests held at
// once over N connections, against the same N connections idle, in goroutines and memory (heap
// and stacks in use). A held request has no goroutine of its own beyond its connection's (net/http
// runs a request on its connection's goroutine and, while a handler runs, a second one reads
// ahead to notice the client leaving; the hold itself is a timer). The figures go in
// docs/shaping.md; run with -v, without -race for the figures of a production build.
//
// All n must be held at the same time. So no decision may fail open, since such a request is not
// held: the timeout is 10s, not the default 100ms, which a loaded machine can exceed. And no
// hold may end before the last request is held: a debt of 20s is taken first, which the test's
// own steps (300 dials, polls that collect garbage, 300 requests) do not outlast. The clients
// then leave, which ends the holds.
func TestShapingCostPerHeldRequest(t *testing.T) {
	const n = 300
	srv := redistest.Start(t)
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		timeout 10s # a loaded machine must not make a decision fail open: every request is to be held
		max_waiting %d
		zone shapecost {
			key all # one bucket for every request: places are counted per client address (waiting.go)
			capacity 1000
			refill_rate 50
			max_wait 1m
			cost {http.request.header.X-Cost}
		}
	}
	respond "ok"`, srv.Addr, n))
	// 20s of debt first (1000 tokens at 50/s), so that all n requests are held at once, for 20
	// to 26s: dry_run charges a request it would hold without holding it.
	dry := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Timeout: caddy.Duration(10 * time.Second), DryRun: true, Zones: []*Zone{{
		Name: "shapecost", Key: []string{"all"}, Capacity: NumberOf(1000), RefillRate: NumberOf(50),
		MaxWait: new(caddy.Duration(time.Minute)), Cost: "{http.request.header.X-Cost}",
	}}})
	for range 2 {
		r := clientRequest("k")
		r.Header.Set("X-Cost", "1000")
		if res := serveTimed(dry, r); res.status != 200 {
			t.Fatalf("dry run: %+v", res)
		}
	}
	measure := func() (goroutines int, bytes uint64) {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return runtime.NumGoroutine(), m.HeapInuse + m.StackInuse
	}
	g0, b0 := measure()
	conns := make([]net.Conn, n)
	for i := range conns {
		// From 10 loopback addresses: places are counted per client address (a share of 30
		// each of max_waiting 300), so that all n are held.
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(2+i%10))}}
		c, err := d.Dial("tcp", strings.TrimPrefix(cs.Base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		conns[i] = c
	}
	redistest.WaitFor(t, 10*time.Second, "the connections to be accepted", func() bool { g, _ := measure(); return g >= g0+n })
	g1, b1 := measure()
	for _, c := range conns {
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nX-Client: k\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
	}
	redistest.WaitFor(t, 10*time.Second, "every request to be held", func() bool { return waitingNow(t) == n })
	g2, b2 := measure()
	for _, c := range conns {
		_ = c.Close()
	}
	redistest.WaitFor(t, 10*time.Second, "the held requests to end with their clients", func() bool { return waitingNow(t) == 0 })
	perConn, perHeld := float64(g1-g0)/n, float64(g2-g1)/n
	t.Logf("%d connections: %.2f goroutines and %.1f KB each idle; held, %.2f goroutines and %.1f KB more each",
		n, perConn, float64(int64(b1)-int64(b0))/n/1024, perHeld, float64(int64(b2)-int64(b1))/n/1024)
	if perHeld > 1.05 {
		t.Fatalf("%.2f goroutines per held request beyond its connection's, want at most 1 (net/http's read-ahead)", perHeld)
	}
}

const metricDelay = "caddy_rate_limit_redis_delay_seconds"

// shapingZone is the zone: capacity 10, refill 10/s, max_wait 2s, one client per
// X-Client header.
func shapingZone(name string) *Zone {
	return &Zone{Name: name, Key: []string{"{http.request.header.X-Client}"}, Capacity: NumberOf(10), RefillRate: NumberOf(10), MaxWait: new(caddy.Duration(2 * time.Second))}
}

// clientRequest is a GET / of the client named in X-Client.
func clientRequest(client string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-Client", client)
	return r
}

// timed is what serveTimed saw of one request.
type timed struct {
	status   int       // 200 when the next handler ran, else the handler error's status
	start    time.Time // ServeHTTP called
	released time.Time // the next handler ran; zero when it did not
	returned time.Time // ServeHTTP returned
	waited   string    // {http.rate_limit_redis.waited}
	header   http.Header
	err      error
}

// serveTimed runs h on r with the request's placeholders, noting when the next handler runs.
func serveTimed(h *Handler, r *http.Request) timed {
	repl := caddyhttp.NewTestReplacer(r) // puts itself in r's context
	w := httptest.NewRecorder()
	res := timed{start: time.Now()}
	res.err = h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		res.released = time.Now()
		return nil
	}))
	res.returned = time.Now()
	res.header = w.Header()
	res.waited, _ = repl.GetString(placeholderPrefix + "waited")
	var he caddyhttp.HandlerError
	switch {
	case !res.released.IsZero():
		res.status = http.StatusOK
	case errors.As(res.err, &he):
		res.status = he.StatusCode
	default:
		res.status = w.Code
	}
	return res
}

// waitingNow is the waiting gauge: the requests held now in this process.
func waitingNow(t *testing.T) float64 {
	t.Helper()
	var m dto.Metric
	if err := metrics.waiting.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

// turns reads the token bucket of zone z (key prefix rl:) for the client key and returns the
// times at which its last n debts come due, the earliest first: the turns of the n requests it
// holds. A bucket that used u tokens at ts can serve a request when u has drained to capacity
// - 1: the last request reserved was given the time at which u drains to the capacity, the one
// before it the time at which u drains to capacity + 1, and so on.
func turns(t *testing.T, srv *redistest.Server, z *limiter.Zone, client string, n int) []time.Time {
	t.Helper()
	v, ok := srv.Do("HMGET", limiter.StateKey("rl:", z, client), "u", "ts").([]any)
	if !ok || len(v) != 2 {
		t.Fatalf("bucket of %s: %v", client, v)
	}
	used, err1 := strconv.ParseFloat(fmt.Sprint(v[0]), 64)
	ts, err2 := strconv.ParseInt(fmt.Sprint(v[1]), 10, 64)
	if err1 != nil || err2 != nil {
		t.Fatalf("bucket of %s: %v (%v, %v)", client, v, err1, err2)
	}
	out := make([]time.Time, n)
	for k := range out {
		drain := used - float64(z.Capacity) - float64(n-1-k)
		out[k] = time.UnixMicro(ts).Add(time.Duration(drain / z.RefillRate * float64(time.Second)))
	}
	return out
}

// TestWaitingRoomEvicts: a full room of 3, two of its places lowest-class queue waiters (seats)
// and one not: a lowest-class request is refused; a higher one evicts the newest lowest seat
// (its channel closes), not one claiming its grant, and the evicted one's leave does not give
// its place back twice: the room counts 3 until the others leave, then 0.
func TestWaitingRoomEvicts(t *testing.T) {
	w := newWaitingRoom(3)
	places := make([]waitingPlace, 4)
	keys := func(i int) []waitingKey { return []waitingKey{{"", strconv.Itoa(i)}} }
	seats := make([]*seat, 4)
	for i := range 3 {
		if !w.enter(context.Background(), keys(i), true) {
			t.Fatalf("request %d gets no place", i)
		}
		places[i] = placeDeciding
		w.hold(keys(i), &places[i])
		seats[i] = w.sit(i < 2) // 0 and 1 lowest, 2 not
	}
	w.claiming(seats[1], true)
	if w.enter(context.Background(), keys(3), true) {
		t.Fatal("a lowest-class request got a place in a full room")
	}
	if !w.enter(context.Background(), keys(3), false) {
		t.Fatal("a higher-class request got no place in a room with a lowest-class waiter")
	}
	places[3] = placeDeciding
	select {
	case <-seats[0].evict:
	default:
		t.Fatal("the newest lowest waiter not claiming (0) was not evicted")
	}
	if w.claiming(seats[1], false) != true || seats[2].evicted || w.held() != 3 {
		t.Fatalf("after the eviction: seat 1 evicted %t, seat 2 evicted %t, %d places taken, want false, false, 3", seats[1].evicted, seats[2].evicted, w.held())
	}
	if w.enter(context.Background(), keys(4), false) != true {
		t.Fatal("a second higher-class request did not evict the other lowest waiter (1)")
	}
	if w.enter(context.Background(), keys(5), false) {
		t.Fatal("a higher-class request got a place with no lowest-class waiter left")
	}
	places = append(places, placeDeciding)
	for i, s := range []*seat{seats[0], seats[1], seats[2], nil, nil} {
		if s != nil {
			w.stand(s)
		}
		w.leave(keys(i), &places[i], s)
	}
	if n := w.held(); n != 0 {
		t.Fatalf("%d places taken after everyone left, want 0", n)
	}
}
