package ratelimitredis

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// llmQueueSite is docs/queues.md's first example (one queue for the upstream, key
// llm-upstream, a literal) with zone (a concurrency zone of limit 1, or a token bucket), behind
// max_waiting 20: a share of 2 places per client.
func llmQueueSite(redisAddr, zone, upstream string) string {
	return fmt.Sprintf(`
	map {http.request.header.Authorization} {tier} {
		"Bearer sk-interactive-1" interactive
		"Bearer sk-interactive-2" interactive
		default batch
	}
	rate_limit_redis {
		redis {
			address %s
		}
		max_waiting 20
		zone llm {
			key llm-upstream
			%s
			max_wait 30s
			priority {tier} {
				interactive
				batch share 20%%
			}
		}
	}
	reverse_proxy %s`, redisAddr, zone, upstream)
}

// arrivals is an upstream that records the Authorization of each request in arrival order,
// and answers once gate is closed.
type arrivals struct {
	gate chan struct{}
	mu   sync.Mutex
	seen []string
}

func (a *arrivals) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	a.seen = append(a.seen, r.Header.Get("Authorization"))
	a.mu.Unlock()
	<-a.gate
}

// gatedArrivals starts an arrivals upstream, and returns it, its server, and open, which opens
// its gate (once; also at the test's end).
func gatedArrivals(t *testing.T) (*arrivals, *httptest.Server, func()) {
	up := &arrivals{gate: make(chan struct{})}
	hs := httptest.NewServer(up)
	t.Cleanup(hs.Close)
	var once sync.Once
	open := func() { once.Do(func() { close(up.gate) }) }
	t.Cleanup(open)
	return up, hs, open
}

// order returns the Authorizations seen so far.
func (a *arrivals) order() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.seen...)
}

// answer is one response a client got.
type answer struct {
	status     int
	retryAfter string
}

// from returns a function that sends GET / to base as client address 127.0.0.<host>, with
// Authorization "Bearer <key>", and sends its answer on the returned channel.
func from(t *testing.T, base string, host int, key string) func() <-chan answer {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(host))}}
	c := &http.Client{Transport: &http.Transport{DialContext: d.DialContext}}
	t.Cleanup(c.CloseIdleConnections)
	return func() <-chan answer {
		out := make(chan answer, 1)
		go func() {
			req, _ := http.NewRequest(http.MethodGet, base+"/", nil)
			req.Header.Set("Authorization", "Bearer "+key)
			resp, err := c.Do(req)
			if err != nil {
				out <- answer{status: -1}
				return
			}
			_ = resp.Body.Close()
			out <- answer{resp.StatusCode, resp.Header.Get("Retry-After")}
		}()
		return out
	}
}

// collectAnswers reads n answers from chans, counting them by status.
func collectAnswers(t *testing.T, chans []<-chan answer) map[int]int {
	t.Helper()
	got := map[int]int{}
	for _, c := range chans {
		select {
		case a := <-c:
			got[a.status]++
		case <-time.After(30 * time.Second):
			t.Fatalf("no answer within 30s; so far %v", got)
		}
	}
	return got
}

// TestQueuePlacesLiteralKey: in docs/queues.md's example (a literal key, limit 1, max_waiting
// 20), one batch client holds the slot and sends 25 more: it holds its share of 2 places and
// the other 23 get 429 at once, so an interactive client and another batch client arriving
// then wait and are served (200), the interactive one first.
func TestQueuePlacesLiteralKey(t *testing.T) {
	srv := redistest.Start(t)
	up, hs, open := gatedArrivals(t)
	s := caddytest.Start(t, llmQueueSite(srv.Addr, "algorithm concurrency\n\t\t\tlimit 1", hs.URL))
	batch := from(t, s.Base, 2, "sk-batch-a")
	holder := batch()
	redistest.WaitFor(t, 5*time.Second, "the slot taken", func() bool { return len(up.order()) == 1 })
	var flood []<-chan answer
	for range 25 {
		flood = append(flood, batch())
	}
	waiters := "rl:{llm-upstream}:llm:cc:ql"
	got := map[int]int{}
	redistest.WaitFor(t, 10*time.Second, "23 of the flood refused and 2 waiting", func() bool {
		for i := 0; i < len(flood); {
			select {
			case a := <-flood[i]:
				got[a.status]++
				flood = append(flood[:i], flood[i+1:]...)
			default:
				i++
			}
		}
		n, _ := srv.Do("ZCARD", waiters).(int64)
		return got[429] == 23 && n == 2
	})
	if len(got) != 1 {
		t.Fatalf("the flood's answers while 2 wait: %v, want 23 x 429 only", got)
	}
	interactive := from(t, s.Base, 3, "sk-interactive-1")()
	other := from(t, s.Base, 4, "sk-batch-b")()
	redistest.WaitFor(t, 5*time.Second, "4 waiting", func() bool { n, _ := srv.Do("ZCARD", waiters).(int64); return n == 4 })
	open()
	if got := collectAnswers(t, append(flood, holder, interactive, other)); got[200] != 5 {
		t.Fatalf("the holder, the flood's 2 waiters, the interactive and the other batch client: %v, want 5 x 200", got)
	}
	if o := up.order(); len(o) != 5 || o[1] != "Bearer sk-interactive-1" {
		t.Fatalf("upstream order %q, want the interactive client first after the holder", o)
	}
}

// TestQueuePlacesLiteralKeyTokenBucket: the same with docs/queues.md's token bucket queue
// (capacity 1, refilled 1 a second): the batch client spends the token and sends 25 more; it
// holds 2 places and 23 get 429, and an interactive client and another batch client arriving
// then wait and are served, the interactive one first.
func TestQueuePlacesLiteralKeyTokenBucket(t *testing.T) {
	srv := redistest.Start(t)
	up := &arrivals{gate: make(chan struct{})}
	close(up.gate)
	hs := httptest.NewServer(up)
	t.Cleanup(hs.Close)
	s := caddytest.Start(t, llmQueueSite(srv.Addr, "capacity 1\n\t\t\trefill_rate 1", hs.URL))
	batch := from(t, s.Base, 2, "sk-batch-a")
	if a := <-batch(); a.status != 200 {
		t.Fatalf("the token: %d", a.status)
	}
	var flood []<-chan answer
	for range 25 {
		flood = append(flood, batch())
	}
	var rest []<-chan answer
	got := map[int]int{}
	redistest.WaitFor(t, 10*time.Second, "23 of the flood refused", func() bool {
		rest = rest[:0]
		for _, c := range flood {
			select {
			case a := <-c:
				got[a.status]++
			default:
				rest = append(rest, c)
			}
		}
		flood = append(flood[:0], rest...)
		return got[429] >= 23
	})
	if got[429] != 23 || len(flood)+got[200] != 2 {
		t.Fatalf("the flood: %v and %d unanswered, want 23 x 429 and 2 waiting (or served)", got, len(flood))
	}
	interactive := from(t, s.Base, 3, "sk-interactive-1")()
	other := from(t, s.Base, 4, "sk-batch-b")()
	if got := collectAnswers(t, append(flood, interactive, other)); got[200] != len(flood)+2 {
		t.Fatalf("the flood's waiters, the interactive and the other batch client: %v, want all 200", got)
	}
	o := up.order()
	for i, a := range o[1:] {
		if a == "Bearer sk-interactive-1" {
			break
		}
		if a == "Bearer sk-batch-b" {
			t.Fatalf("upstream order %q: the other batch client (%d) before the interactive one", o, i+1)
		}
	}
}

// TestQueueEvictsNewestLowest: the room of max_waiting 20 is full of batch waiters (10
// clients, 2 each) behind the one slot. Another batch client is refused at once (429); an
// interactive client takes the place of the newest batch waiter, which is answered 429 with
// Retry-After, counted as evicted, and leaves the queue in Redis; the interactive client is
// served first, then the 19 batch waiters.
func TestQueueEvictsNewestLowest(t *testing.T) {
	srv := redistest.Start(t)
	up, hs, open := gatedArrivals(t)
	ac := startCaddyAdmin(t, llmQueueSite(srv.Addr, "algorithm concurrency\n\t\t\tlimit 1", hs.URL))
	base := ac.Site.Base
	holder := from(t, base, 2, "sk-holder")()
	redistest.WaitFor(t, 5*time.Second, "the slot taken", func() bool { return len(up.order()) == 1 })
	waiters := "rl:{llm-upstream}:llm:cc:ql"
	var batch []<-chan answer
	for i := range 20 {
		batch = append(batch, from(t, base, 10+i/2, "sk-batch-"+fmt.Sprint(i/2))())
		redistest.WaitFor(t, 5*time.Second, "the batch waiter in the queue", func() bool {
			n, _ := srv.Do("ZCARD", waiters).(int64)
			return n == int64(i+1)
		})
	}
	if a := <-from(t, base, 40, "sk-batch-late")(); a.status != 429 {
		t.Fatalf("a batch client finding the room full: %d, want 429", a.status)
	}
	reg := activeRegistry(t)
	before := metricValue(t, reg, metricDecisions, "zone", "llm", "result", "evicted")
	interactive := from(t, base, 41, "sk-interactive-1")()
	select {
	case a := <-batch[19]:
		if a.status != 429 || a.retryAfter == "" {
			t.Fatalf("the newest batch waiter: %+v, want 429 with Retry-After", a)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the newest batch waiter was not evicted")
	}
	if got := metricValue(t, reg, metricDecisions, "zone", "llm", "result", "evicted"); got != before+1 {
		t.Fatalf("evicted: %v, want %v", got, before+1)
	}
	redistest.WaitFor(t, 5*time.Second, "19 batch waiters and the interactive one in the queue", func() bool {
		n, _ := srv.Do("ZCARD", waiters).(int64)
		return n == 20
	})
	open()
	if got := collectAnswers(t, append(batch[:19], holder, interactive)); got[200] != 21 {
		t.Fatalf("the holder, 19 batch waiters and the interactive client: %v, want 21 x 200", got)
	}
	o := up.order()
	if len(o) != 21 || o[1] != "Bearer sk-interactive-1" {
		t.Fatalf("upstream order %q: want 21 requests, the interactive client first after the holder", o)
	}
	if n := slices.Index(o, "Bearer sk-batch-9"); n < 0 || slices.Index(o[n+1:], "Bearer sk-batch-9") >= 0 {
		t.Fatalf("upstream order %q: want sk-batch-9 once (its first waiter), its evicted one never granted", o)
	}
	redistest.WaitFor(t, 5*time.Second, "the queue empty", func() bool {
		n, _ := srv.Do("ZCARD", waiters).(int64)
		c, _ := srv.Do("ZCARD", "rl:{llm-upstream}:llm:cc").(int64)
		return n == 0 && c == 0
	})
}
