package ratelimitredis

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// shapedGet is one GET /shaped through cs from the client address ip (X-Forwarded-For, the
// server trusting loopback), with X-API-Key key when not empty: the status and the milliseconds
// the body says it waited; status 0 when the request failed (its context ended).
func shapedGet(ctx context.Context, cs *caddyServer, ip, key string) (status, waited int) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, cs.base+"/shaped", nil)
	if err != nil {
		return 0, 0
	}
	req.Header.Set("X-Forwarded-For", ip)
	if key != "" {
		req.Header.Set("X-API-Key", key)
	}
	resp, err := servingClient(30 * time.Second).Do(req)
	if err != nil {
		return 0, 0
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	waited, _ = strconv.Atoi(strings.TrimPrefix(string(b), "ok waited="))
	return resp.StatusCode, waited
}

// TestShapingFairShare (issue 29, finding 5; shaping_flood.py against the reproduction's S9):
// max_waiting 20, capacity 2, refill 1/s, max_wait 10s, keyed on the API key or the address.
// One address sends 24 requests at once under two invented API keys: each key holds at most
// its share, 2 places (a tenth), the rest of its burst is decided without waiting. Another
// client's burst of 4 then still waits: 200 200 at once, then 200 after about 1s and 2s, no 429.
func TestShapingFairShare(t *testing.T) {
	srv := redistest.Start(t)
	cs := startSites(t, "\t\ttrusted_proxies static 127.0.0.1/32", fmt.Sprintf(`
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
	waitFor(t, 10*time.Second, "the flood's requests to be answered or held", func() bool { return done()+int(waitingNow(t)) == 24 })
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
// tells no clients apart, so its one key is not limited to a share: with max_waiting 20, 5
// requests are held at once, not 2.
func TestShapingFairShareLiteralKey(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, MaxWaiting: 20, Zones: []*Zone{{
		Name: "shapesite", Key: []string{"site"}, Capacity: NumberOf(1), RefillRate: NumberOf(1), MaxWait: caddy.Duration(10 * time.Second),
	}}})
	serveTimed(h, clientRequest("a")) // the token
	ctx, cancel := context.WithCancel(context.Background())
	results := make(chan timed, 5)
	for i := range 5 {
		go func() { results <- serveTimed(h, clientRequest(strconv.Itoa(i)).WithContext(ctx)) }()
	}
	waitFor(t, 5*time.Second, "5 requests held", func() bool { return h.waiting.held() == 5 || len(results) > 0 })
	cancel()
	for range 5 {
		if r := <-results; r.status != 499 {
			t.Fatalf("a request of the site-wide zone: %d, want held (then 499 when its client left)", r.status)
		}
	}
	if n := h.waiting.held(); n != 0 {
		t.Fatalf("%d places taken after the clients left, want 0", n)
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
		if !w.enter(context.Background(), k) {
			t.Fatalf("alice's request %d gets no place", i+1)
		}
	}
	third := make(chan bool, 1)
	go func() { third <- w.enter(context.Background(), k) }()
	w.hold(k, &a) // held: the place stays alice's
	select {
	case ok := <-third:
		t.Fatalf("the third request got an answer (%t) while alice's share was taken", ok)
	case <-time.After(50 * time.Millisecond): // checking that nothing happens
	}
	w.leave(k, &b) // decided not to be held: its place goes to the third
	if !<-third {
		t.Fatal("the third request got no place after a request of alice's share left")
	}
	c := placeDeciding
	w.hold(k, &c)
	if w.enter(context.Background(), k) {
		t.Fatal("a fourth request got a place while alice's share is held")
	}
	if !w.enter(context.Background(), []waitingKey{{"z", "bob"}}) {
		t.Fatal("bob gets no place while alice holds her share")
	}
	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan bool, 1)
	go func() { left <- w.enter(ctx, []waitingKey{{"z", "bob"}, {"ip", "b"}}) }() // bob's share: 1 deciding, 1 more
	if !<-left {
		t.Fatal("bob's second request got no place")
	}
	go func() { left <- w.enter(ctx, []waitingKey{{"z", "bob"}}) }()
	cancel()
	if <-left {
		t.Fatal("a request waiting for bob's decisions got a place after its context ended")
	}
	for i := range 20 {
		w.enter(context.Background(), []waitingKey{{"z", "c" + strconv.Itoa(i)}})
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
			cs := startSites(t, "\t\ttrusted_proxies static 127.0.0.1/32", fmt.Sprintf(`
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
				waitFor(t, 10*time.Second, "the requests of "+ip+" to be answered or held", func() bool {
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
			waitFor(t, 10*time.Second, "the other client's second request to be answered or held", func() bool {
				return len(other) > 0 || waitingNow(t) > tc.held
			})
			cancel()
			if s := <-other; s != tc.other {
				t.Fatalf("the other client's second request: %d, want %d (0: held, then cancelled)", s, tc.other)
			}
		})
	}
}
