package ratelimitredis

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// fairUpstream is an upstream that takes 0.3 s a request, and records the X-Tenant of each
// request in the order they start and the most it serves at once.
type fairUpstream struct {
	mu        sync.Mutex
	started   []string
	now, most int
}

func (u *fairUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.started = append(u.started, r.Header.Get("X-Tenant"))
	u.now++
	u.most = max(u.most, u.now)
	u.mu.Unlock()
	time.Sleep(300 * time.Millisecond) // the upstream's work
	u.mu.Lock()
	u.now--
	u.mu.Unlock()
}

// order returns the tenants in the order their requests started, and the most served at once.
func (u *fairUpstream) order() ([]string, int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return slices.Clone(u.started), u.most
}

// fairInstances starts three instances (caddytest.Instances) of one queue, `key upstream`,
// limit 2, max_wait 10s, fair by X-Tenant, with classes interactive and batch (share 20%) by
// X-Tier when classes is set, before a fairUpstream; it returns the upstream, a function
// that sends n requests of tenant (and tier) spread over the instances, and the key of the
// queue's waiters.
func fairInstances(t *testing.T, classes bool) (*fairUpstream, func(n int, tenant, tier string) []<-chan int, *redistest.Server) {
	srv := redistest.Start(t)
	up := &fairUpstream{}
	hs := httptest.NewServer(up)
	t.Cleanup(hs.Close)
	priority := ""
	if classes {
		priority = "priority {http.request.header.X-Tier} {\n\t\t\t\tinteractive\n\t\t\t\tbatch share 20%\n\t\t\t}"
	}
	s := caddytest.Start(t, caddytest.Instances(srv.Addr, fmt.Sprintf(`zone upstream {
				key upstream
				algorithm concurrency
				limit 2
				max_wait 10s
				fair_by {http.request.header.X-Tenant}
				%s
			}`, priority), hs.URL))
	client := caddytest.Client(30 * time.Second)
	t.Cleanup(client.CloseIdleConnections)
	var sent int
	send := func(n int, tenant, tier string) []<-chan int {
		var out []<-chan int
		for range n {
			c := make(chan int, 1)
			req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("%s/i%d/", s.Base, 1+sent%3), nil)
			req.Header.Set("X-Tenant", tenant)
			req.Header.Set("X-Tier", tier)
			sent++
			go func() {
				resp, err := client.Do(req)
				if err != nil {
					c <- -1
					return
				}
				_ = resp.Body.Close()
				c <- resp.StatusCode
			}()
			out = append(out, c)
		}
		return out
	}
	return up, send, srv
}

// fairWaiters is the key of the waiters of fairInstances's queue.
const fairWaiters = "rl:{upstream}:upstream:cc:ql"

// fairWaiting polls until n requests wait in fairInstances's queue.
func fairWaiting(t *testing.T, srv *redistest.Server, n int64) {
	t.Helper()
	redistest.WaitFor(t, 10*time.Second, fmt.Sprintf("%d waiting", n), func() bool {
		got, _ := srv.Do("ZCARD", fairWaiters).(int64)
		return got == n
	})
}

// allOK fails t unless every answer of chans is 200.
func allOK(t *testing.T, chans []<-chan int) {
	t.Helper()
	got := map[int]int{}
	for _, c := range chans {
		select {
		case s := <-c:
			got[s]++
		case <-time.After(30 * time.Second):
			t.Fatalf("no answer within 30s; so far %v", got)
		}
	}
	if got[200] != len(chans) {
		t.Fatalf("answers %v, want %d x 200", got, len(chans))
	}
}

// TestFairQueueThreeInstances: three instances share one queue (limit 2, max_wait 10s, fair by
// tenant) before an upstream that takes 0.3 s a request; tenant A sends 20 requests at once,
// and tenant B 3 once A's 18 wait: every request is answered 200, the upstream never serves
// more than 2 at once, and B's 3 are among the first 12 to start (in arrival order they would
// start 21st to 23rd).
func TestFairQueueThreeInstances(t *testing.T) {
	up, send, srv := fairInstances(t, false)
	a := send(20, "A", "")
	fairWaiting(t, srv, 18)
	b := send(3, "B", "")
	allOK(t, append(a, b...))
	order, most := up.order()
	if most > 2 {
		t.Fatalf("the upstream served %d at once, want at most 2", most)
	}
	if n := strings.Count(strings.Join(order[:12], " "), "B"); n != 3 {
		t.Fatalf("start order %v: %d of B's requests among the first 12, want 3", order, n)
	}
}

// TestFairQueueThreeInstancesClasses: the same with classes interactive and batch (share
// 20%): batch tenants A (20) and B (3) take turns inside batch, B's 3 among the first 12 batch
// requests to start, while 2 interactive requests sent once those wait start before any batch
// waiter but those already granted then (at most 2: the slots).
func TestFairQueueThreeInstancesClasses(t *testing.T) {
	up, send, srv := fairInstances(t, true)
	a := send(20, "A", "batch")
	fairWaiting(t, srv, 18)
	b := send(3, "B", "batch")
	fairWaiting(t, srv, 21)
	before, _ := up.order()
	i := send(2, "I", "interactive")
	allOK(t, append(append(a, b...), i...))
	order, most := up.order()
	if most > 2 {
		t.Fatalf("the upstream served %d at once, want at most 2", most)
	}
	after := order[len(before):]
	if n := strings.Count(strings.Join(after[:min(4, len(after))], " "), "I"); n != 2 {
		t.Fatalf("start order %v: the interactive requests, sent after %d started, not both within the next 4", order, len(before))
	}
	batch := slices.DeleteFunc(slices.Clone(order), func(s string) bool { return s == "I" })
	if n := strings.Count(strings.Join(batch[:12], " "), "B"); n != 3 {
		t.Fatalf("batch start order %v: %d of B's requests among the first 12, want 3", batch, n)
	}
}

// TestFairQueueAdminTenants: with the one slot of a fair queue held, tenant A's 3 waiters and
// B's 1, the admin API's state lists the tenants waiting, the most first, and their count. Its
// zone has a name of its own: its waiters end after the test does, and counted under another
// test's zone they would be that test's.
func TestFairQueueAdminTenants(t *testing.T) {
	srv := redistest.Start(t)
	up := heldUpstream(t)
	ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
		}
		zone tenants {
			key site
			algorithm concurrency
			limit 1
			max_wait 10s
			fair_by {http.request.header.X-Tenant}
		}
	}
	reverse_proxy %s`, srv.Addr, up.URL))
	lc := caddytest.NewLoadClient(ac.Site)
	for i, tenant := range []string{"A", "A", "A", "A", "B"} { // the first A holds the slot
		go func() { _, _ = lc.Get("/", "X-Tenant", tenant) }()
		redistest.WaitFor(t, 5*time.Second, "the request in", func() bool {
			n, _ := srv.Do("ZCARD", "rl:{site}:tenants:cc:ql").(int64)
			c, _ := srv.Do("ZCARD", "rl:{site}:tenants:cc").(int64)
			return n+c == int64(i+1)
		})
	}
	st := adminJSON[[]adminapi.ClientState](t, ac, http.MethodGet, "/rate_limit_redis/state?zone=tenants&key=site", 200)
	want := []adminapi.QueueTenant{{Tenant: "A", Waiting: 3}, {Tenant: "B", Waiting: 1}}
	if len(st) != 1 || st[0].Queue == nil || !slices.Equal(st[0].Queue.Tenants, want) || st[0].Queue.TenantsWaiting != 2 {
		t.Fatalf("state: %+v, want tenants %+v of 2", st, want)
	}
}
