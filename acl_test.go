package ratelimitredis

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// The Redis ACL that docs/security.md ("Redis access") tells operators to give the module's
// user is derived from redisUses, the one list of the Redis commands the module sends: each
// script's (TestRedisACLListsEveryScriptCommand greps lua/*.lua and fails on a command missing
// from the list or listed but never called) and the Go code's. TestRedisACL runs every algorithm,
// charge mode, the reset broadcast and every admin endpoint under exactly that ACL, and checks
// that each command granted was called and none refused; TestDocumentedACL checks that the
// docs give redisACL's lines as they are.

// redisGrant is one `ACL SETUSER` line of the ACL: the commands every instance needs, or those
// one feature or topology adds.
type redisGrant int

const (
	// grantLimiter is every instance's: the decisions, the settlements, the reset broadcast.
	grantLimiter redisGrant = iota
	// grantAdmin is what an instance serving the admin API (admin.go) adds.
	grantAdmin
	// grantCluster is what a Redis Cluster client adds.
	grantCluster
	// grantDB is what `db` other than 0 adds.
	grantDB
)

// redisUse is a part of the module and the Redis commands it sends.
type redisUse struct {
	// by is the part: a script by its path (lua/decide.lua), else the Go code that sends.
	by    string
	grant redisGrant
	// commands are named as ACL rules name them: lower case, a subcommand as container|sub.
	commands []string
}

// redisUses lists every Redis command the module sends. go-redis opens each connection with
// HELLO (carrying AUTH), which needs no grant: Redis lets any user run a no-auth command. It
// sends nothing else there: CLIENT SETINFO and maintenance notifications are turned off
// (redis_client.go), and no connection is READONLY.
var redisUses = []redisUse{
	// limiter.runScript, limiter.evalBatch: EVALSHA, then EVAL after NOSCRIPT (a Redis that
	// has not seen the script yet, or flushed it). Never SCRIPT LOAD.
	{"limiter: running the scripts", grantLimiter, []string{"evalsha", "eval"}},
	{"lua/decide.lua", grantLimiter, []string{"time", "hmget", "hgetall", "zcount", "zrangebyscore", "zrange", "get",
		"pexpire", "hdel", "hset", "set", "zremrangebyscore", "zadd", "zscore", "zrem", "zcard", "zincrby"}},
	{"lua/settle.lua", grantLimiter, []string{"time", "get", "del", "set", "hmget", "hgetall", "hset", "hdel", "pexpire", "zrem", "zcount"}},
	{"lua/refresh.lua", grantLimiter, []string{"time", "zremrangebyscore", "zadd", "zrange", "pexpire"}},
	// A queue (max_wait on a concurrency zone, or on a token bucket with priority): its waiters
	// enter, leave, are renewed and granted slots or tokens, each grant published on the
	// waiter's instance's channel.
	{"lua/queue.lua", grantLimiter, []string{"time", "zadd", "pexpire", "zrangebyscore", "zrem", "zremrangebyscore",
		"zcard", "del", "hgetall", "hmget", "publish", "hdel", "hset", "zrange", "zscore", "zcount"}},
	// limiter.ResetListener: SUBSCRIBE to <prefix>reset, and go-redis's health check of the
	// subscription, a PING after 3s without a message.
	{"limiter.ResetListener: the reset broadcast", grantLimiter, []string{"subscribe", "ping"}},
	// limiter.State (GET /rate_limit_redis/state): TIME, then one MULTI/EXEC reading the key
	// (a token bucket and a sliding window counter: HGETALL; a sliding window: ZCOUNT and
	// ZREVRANGEBYSCORE; a fixed window: GET; an adaptive concurrency zone's controller: HMGET) and
	// its PTTL.
	{"limiter.State: the admin API's state", grantAdmin, []string{"multi", "exec", "time", "hgetall", "zcount",
		"zrevrangebyscore", "get", "pttl", "hmget"}},
	// limiter.Queue (GET /rate_limit_redis/state of a queue zone): one MULTI/EXEC reading each
	// class's ZCARD and its earliest waiter.
	{"limiter.Queue: the admin API's state of a queue", grantAdmin, []string{"multi", "exec", "zcard", "zrange"}},
	// limiter.Reset (DELETE /rate_limit_redis/state): DEL of the key, PUBLISH of it on the
	// reset channel.
	{"limiter.Reset: the admin API's reset", grantAdmin, []string{"del", "publish"}},
	// limiter.Block (PUT /rate_limit_redis/block): TIME, one MULTI/EXEC with SET of the block
	// key, PUBLISH of it on the reset channel. limiter.State reads a block key with GET.
	{"limiter.Block: the admin API's block", grantAdmin, []string{"time", "multi", "exec", "set", "publish"}},
	// The admin API's listings (GET /rate_limit_redis/blocks and /overrides): SCAN on each
	// server, then limiter.ReadBlocks (TIME, GET of each key found) or limiter.ReadOverrides
	// (HGETALL and PTTL of each), in plain pipelines.
	{"limiter.ScanZone: the admin API's listings", grantAdmin, []string{"scan", "time", "get", "hgetall", "pttl"}},
	// limiter.ReadTop (GET /rate_limit_redis/top): TIME, then ZRANGE of each of the zone's top
	// sets and HGETALL of its errors, in one plain pipeline.
	{"limiter.ReadTop: the admin API's top", grantAdmin, []string{"time", "zrange", "hgetall"}},
	// go-redis's ClusterClient: the slot map (CLUSTER SLOTS) and the commands' key positions
	// (COMMAND), from any node.
	{"go-redis: Redis Cluster", grantCluster, []string{"cluster|slots", "command"}},
	// go-redis: SELECT <db> on each new connection when db is not 0.
	{"go-redis: db", grantDB, []string{"select"}},
}

// rules returns the ACL rules of line g: the commands of its uses that grantLimiter's line does
// not grant already, each once, in the order listed. grantLimiter's own line starts with the
// key and channel patterns of prefix and -@all.
func (g redisGrant) rules(prefix string) []string {
	var rules []string
	if g == grantLimiter {
		rules = []string{"~" + prefix + "*", "&" + prefix + "*", "-@all"}
	}
	for _, u := range redisUses {
		if u.grant != g {
			continue
		}
		for _, c := range u.commands {
			if (g == grantLimiter || !slices.Contains(grantLimiter.rules(prefix), "+"+c)) && !slices.Contains(rules, "+"+c) {
				rules = append(rules, "+"+c)
			}
		}
	}
	return rules
}

// redisACL returns the ACL of docs/security.md for user with password and key prefix prefix:
// one `ACL SETUSER` line per grant, in order. The first creates the user; each other adds to it.
func redisACL(user, password, prefix string) []string {
	var lines []string
	for g := grantLimiter; g <= grantDB; g++ {
		head := "ACL SETUSER " + user
		if g == grantLimiter {
			head += " on >" + password
		}
		lines = append(lines, head+" "+strings.Join(g.rules(prefix), " "))
	}
	return lines
}

// aclRules is the first line of the documented ACL, for key prefix "rl:", as redis-server
// arguments.
func aclRules() []string { return grantLimiter.rules("rl:") }

// setUsers gives srv each of the documented ACL's lines for user (password s3cret) that grants
// lists, as an operator would type them: the first creates the user.
func setUsers(t *testing.T, srv *redistest.Server, user string, grants ...redisGrant) {
	t.Helper()
	lines := redisACL(user, "s3cret", "rl:")
	for _, g := range grants {
		args := []any{}
		for _, f := range strings.Fields(lines[g]) {
			args = append(args, f)
		}
		srv.Do(args...)
	}
}

// redisCall matches a command a Lua script sends, its name a literal (group 2); redisCallAny
// matches any call, whatever its first argument.
var (
	redisCall    = regexp.MustCompile(`redis\.p?call\(\s*(['"])([^'"]*)['"]`)
	redisCallAny = regexp.MustCompile(`redis\.p?call\(`)
)

// TestRedisACLListsEveryScriptCommand: every command a script of lua/ sends (redis.call and
// redis.pcall, comments aside) is listed for that script in redisUses, and the list names no
// command the script does not send: a script that starts using a command the ACL lacks fails
// here, not in an operator's Redis.
func TestRedisACLListsEveryScriptCommand(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("lua/*.lua")
	if err != nil || len(files) == 0 {
		t.Fatalf("no scripts in lua/: %v", err)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		sent := map[string]bool{}
		for i, line := range strings.Split(string(b), "\n") {
			code, _, _ := strings.Cut(line, "--") // Lua comments
			calls := redisCall.FindAllStringSubmatch(code, -1)
			if n := len(redisCallAny.FindAllString(code, -1)); n != len(calls) {
				t.Errorf("%s:%d: a command whose name is not a literal: the ACL cannot be checked\n%s", f, i+1, line)
			}
			for _, c := range calls {
				sent[strings.ToLower(c[2])] = true
			}
		}
		if len(sent) == 0 {
			t.Errorf("%s: found no redis.call", f)
		}
		var listed []string
		n := 0
		for _, u := range redisUses {
			if u.by == f {
				listed, n = u.commands, n+1
			}
		}
		if n != 1 {
			t.Errorf("%s has %d entries in redisUses, want 1", f, n)
			continue
		}
		for _, c := range slices.Sorted(maps.Keys(sent)) {
			if !slices.Contains(listed, c) {
				t.Errorf("%s sends %s, which redisUses does not list for it (nor so the ACL of docs/security.md)", f, strings.ToUpper(c))
			}
		}
		for _, c := range listed {
			if !sent[c] {
				t.Errorf("redisUses lists %s for %s, which does not send it", strings.ToUpper(c), f)
			}
		}
	}
}

// commandStats is INFO commandstats: the calls and rejected calls of each command (named as
// ACL rules name them: container|sub).
func commandStats(t *testing.T, srv *redistest.Server) map[string][2]int {
	t.Helper()
	stats := map[string][2]int{}
	for _, line := range strings.Split(srv.Do("INFO", "commandstats").(string), "\r\n") {
		name, fields, ok := strings.Cut(strings.TrimPrefix(line, "cmdstat_"), ":")
		if !ok || !strings.HasPrefix(line, "cmdstat_") {
			continue
		}
		var s [2]int
		for _, f := range strings.Split(fields, ",") {
			k, v, _ := strings.Cut(f, "=")
			n, _ := strconv.Atoi(v)
			switch k {
			case "calls":
				s[0] = n
			case "rejected_calls":
				s[1] = n
			}
		}
		stats[name] = s
	}
	return stats
}

// testCommands are the commands the tests send themselves (as the default user), or which need
// no grant (HELLO): left out when the commands the module sent are compared with the ACL.
var testCommands = []string{"hello", "client|setinfo", "config|resetstat", "info", "acl|log", "pubsub|numsub"}

// TestRedisACL: a Redis user with exactly the documented ACL (its first line; the admin API's
// line added for the admin API) serves every algorithm, plain, with count_status, with charge
// and with max_wait where each applies, the reset broadcast, and every admin endpoint, each
// exactly as an unrestricted user: N admitted then denied, no X-RateLimit-Degraded, never a
// NOPERM. Every command the ACL grants was sent, and Redis refused none.
//
// The documented line before it (lacking +get +set +del) failed here: fixed_window admitted 12 of
// 12, degraded (decide.lua's GET); a window counter with count_status wrote the count, then
// failed on its record's SET, so that every 200 was counted and the fourth good request denied;
// the failures opened the circuit breaker, so the token bucket zones degraded too; the admin
// API's state of a fixed window failed with EXECABORT.
func TestRedisACL(t *testing.T) {
	srv := redistest.Start(t)
	setUsers(t, srv, "limiter", grantLimiter)
	setUsers(t, srv, "admin", grantLimiter, grantAdmin)
	srv.Do("CONFIG", "RESETSTAT")
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("ACL LOG: %v", srv.Do("ACL", "LOG"))
		}
	})

	// An upstream that holds /tb_hold/slow until released, so that another request decides
	// while that one's hold is pending.
	arrived, release := make(chan struct{}, 1), make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-release
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(up.Close)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})

	// An upstream that holds /cc_queue/slow until released: a queue's slot is taken meanwhile.
	queueArrived, queueRelease := make(chan struct{}, 1), make(chan struct{})
	queueUp := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		queueArrived <- struct{}{}
		<-queueRelease
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(queueUp.Close)

	t.Run("decisions and the reset broadcast", func(t *testing.T) {
		redisBlock := fmt.Sprintf("redis {\n\t\t\taddress %s\n\t\t\tusername limiter\n\t\t\tpassword s3cret\n\t\t}", srv.Addr)
		zones := []string{
			"tb capacity 3\n\t\t\trefill_rate 1/1h",
			"sw algorithm sliding_window\n\t\t\tlimit 3\n\t\t\twindow 1h",
			"fw algorithm fixed_window\n\t\t\tlimit 3\n\t\t\tperiod month",
			"sc algorithm sliding_window_counter\n\t\t\tlimit 3\n\t\t\twindow 366d",
			"tb_count capacity 3\n\t\t\trefill_rate 1/1h\n\t\t\tcount_status 401",
			"sw_count algorithm sliding_window\n\t\t\tlimit 3\n\t\t\twindow 1h\n\t\t\tcount_status 401",
			"fw_count algorithm fixed_window\n\t\t\tlimit 3\n\t\t\tperiod month\n\t\t\tcount_status 401",
			"sc_count algorithm sliding_window_counter\n\t\t\tlimit 3\n\t\t\twindow 366d\n\t\t\tcount_status 401",
			"tb_charge capacity 4\n\t\t\trefill_rate 1/1h\n\t\t\tcharge header X-Cost",
			"fw_charge algorithm fixed_window\n\t\t\tlimit 4\n\t\t\tperiod month\n\t\t\tcharge header X-Cost",
			"sc_charge algorithm sliding_window_counter\n\t\t\tlimit 4\n\t\t\twindow 366d\n\t\t\tcharge header X-Cost",
			"tb_wait capacity 1\n\t\t\trefill_rate 1\n\t\t\tmax_wait 1s",
			"tb_hold capacity 2\n\t\t\trefill_rate 1/1h\n\t\t\tcount_status 401",
			"tb_last capacity 3\n\t\t\trefill_rate 1/1h",
			"sw_block algorithm sliding_window\n\t\t\tlimit 1\n\t\t\twindow 1h\n\t\t\tblock 1h\n\t\t\tblock_max 2h",
			"cc_queue algorithm concurrency\n\t\t\tlimit 1\n\t\t\tmax_wait 10s",
		}
		var b strings.Builder
		for _, z := range zones {
			name, rest, _ := strings.Cut(z, " ")
			fmt.Fprintf(&b, "\n\t\tzone %s {\n\t\t\tmatch path /%s/*\n\t\t\t%s\n\t\t}", name, name, rest)
		}
		cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		%s%s
	}
	route /bc/* {
		rate_limit_redis {
			%s
			deny_cache {
				max_age 1h
			}
			zone bc {
				algorithm sliding_window
				limit 1
				window 1h
			}
		}
		respond "ok"
	}
	@charge path */charge
	header @charge X-Cost 2
	@e401 path */401
	route {
		reverse_proxy /tb_hold/slow %s
		reverse_proxy /cc_queue/slow %s
		respond @e401 401
		respond "ok"
	}`, redisBlock, b.String(), redisBlock, up.URL, queueUp.URL))

		// check sends one request and checks its status (and body: "ok" for a 200, else none),
		// that it is not degraded, and X-RateLimit-Remaining unless remaining is "-". It does not
		// end the test, so that a zone that fails goes on failing as security-3 saw it (the
		// count kept, the circuit breaker opened).
		check := func(t *testing.T, step, path string, status int, remaining string) {
			t.Helper()
			r := cs.Get(path)
			body := ""
			if status == 200 {
				body = "ok"
			}
			if r.Status != status || r.Body != body || r.Header.Get("X-RateLimit-Degraded") != "" ||
				(remaining != "-" && r.Header.Get("X-RateLimit-Remaining") != remaining) {
				t.Errorf("%s: %d %q, X-RateLimit-Degraded %q, X-RateLimit-Remaining %q; want %d %q, not degraded, remaining %q",
					step, r.Status, r.Body, r.Header.Get("X-RateLimit-Degraded"), r.Header.Get("X-RateLimit-Remaining"), status, body, remaining)
			}
		}
		ok := func(t *testing.T, step, path, remaining string) { t.Helper(); check(t, step, path, 200, remaining) }
		denied := func(t *testing.T, step, path string) { t.Helper(); check(t, step, path, 429, "-") }

		// Plain: 3 admitted, then denied (12 requests, as security-3 sent). In security-3's
		// order: the fixed window (newcomer-3's `period` quota, of which all 12 were admitted)
		// after the count_status zones.
		plain := func(z string) {
			t.Run(z, func(t *testing.T) {
				for i, rem := range []string{"2", "1", "0"} {
					ok(t, fmt.Sprintf("request %d", i+1), "/"+z+"/", rem)
				}
				for i := 4; i <= 12; i++ {
					denied(t, fmt.Sprintf("request %d", i), "/"+z+"/")
				}
			})
		}
		for _, z := range []string{"tb", "sw", "sc"} {
			plain(z)
		}

		// count_status 401: five 200s are given back (each holds one slot while it runs), then
		// three 401s are counted and the next request is denied. security-3's case: the
		// sliding window counter's count was kept, and its fourth 200 denied.
		for _, z := range []string{"sc_count", "tb_count", "sw_count", "fw_count"} {
			t.Run(z, func(t *testing.T) {
				for i := 1; i <= 5; i++ {
					ok(t, fmt.Sprintf("200 number %d", i), "/"+z+"/", "2")
				}
				for i, rem := range []string{"2", "1", "0"} {
					check(t, fmt.Sprintf("401 number %d", i+1), "/"+z+"/401", 401, rem)
				}
				denied(t, "after three 401s", "/"+z+"/")
			})
		}
		plain("fw")

		// charge header: a quota of 4 and responses reporting 2 (cost 1 reserved): two
		// admitted, then denied.
		for _, z := range []string{"tb_charge", "fw_charge", "sc_charge"} {
			t.Run(z, func(t *testing.T) {
				ok(t, "first", "/"+z+"/charge", "3")
				ok(t, "second", "/"+z+"/charge", "1")
				denied(t, "third", "/"+z+"/charge")
			})
		}

		// max_wait: capacity 1, a token a second, max_wait 1s; three requests at once: one
		// admitted now, one held about a second, one denied (it would wait 2s).
		t.Run("tb_wait", func(t *testing.T) {
			type result struct {
				status   int
				degraded string
				took     time.Duration
			}
			results := make([]result, 3)
			var wg sync.WaitGroup
			for i := range results {
				wg.Go(func() {
					start := time.Now()
					resp, err := caddytest.Client(0).Get(cs.Base + "/tb_wait/")
					if err != nil {
						results[i].status = -1
						return
					}
					resp.Body.Close()
					results[i] = result{resp.StatusCode, resp.Header.Get("X-RateLimit-Degraded"), time.Since(start)}
				})
			}
			wg.Wait()
			statuses := map[int]int{}
			var held time.Duration
			for _, r := range results {
				statuses[r.status]++
				if r.degraded != "" {
					t.Fatalf("degraded: %+v", results)
				}
				if r.status == 200 {
					held = max(held, r.took)
				}
			}
			if statuses[200] != 2 || statuses[429] != 1 || held < 500*time.Millisecond {
				t.Fatalf("%+v, want two admitted (one held about 1s) and one denied", results)
			}
		})

		// A decision while another request's hold is pending (decide.lua reads the holds with
		// HGETALL): capacity 2, one request held upstream.
		t.Run("tb_hold", func(t *testing.T) {
			slow := make(chan int, 1)
			go func() {
				resp, err := caddytest.Client(0).Get(cs.Base + "/tb_hold/slow")
				if err != nil {
					slow <- -1
					return
				}
				resp.Body.Close()
				slow <- resp.StatusCode
			}()
			select {
			case <-arrived:
			case status := <-slow:
				t.Fatalf("the request to hold: %d before it reached the upstream", status)
			}
			check(t, "a 401 beside the pending hold", "/tb_hold/401", 401, "0")
			denied(t, "one counted, one held", "/tb_hold/")
			close(release)
			if status := <-slow; status != 200 {
				t.Fatalf("the held request: %d, want 200", status)
			}
			redistest.WaitFor(t, 5*time.Second, "the held request given back", func() bool {
				r := cs.Get("/tb_hold/401")
				if r.Status == 401 && r.Header.Get("X-RateLimit-Degraded") == "" {
					return true
				}
				if r.Status != 429 || r.Header.Get("X-RateLimit-Degraded") != "" {
					t.Fatalf("after the release: %d %v", r.Status, r.Header)
				}
				return false
			})
			denied(t, "two counted", "/tb_hold/")
		})

		// A queue: a request waits for the slot a slow one holds (it enters the queue, is
		// renewed), and is granted it (its grant published, its claim decided) when the slow one
		// ends.
		t.Run("cc_queue", func(t *testing.T) {
			slow := make(chan int, 1)
			go func() {
				resp, err := caddytest.Client(0).Get(cs.Base + "/cc_queue/slow")
				if err != nil {
					slow <- -1
					return
				}
				resp.Body.Close()
				slow <- resp.StatusCode
			}()
			<-queueArrived
			waiter := make(chan caddytest.Response, 1)
			go func() { r, _ := caddytest.NewLoadClient(cs).Get("/cc_queue/"); waiter <- r }()
			redistest.WaitFor(t, 5*time.Second, "a waiter", func() bool {
				n, _ := srv.Do("ZCARD", "rl:{127.0.0.1}:cc_queue:cc:ql").(int64)
				return n == 1
			})
			time.Sleep(limiter.QueueRefreshEvery + 100*time.Millisecond) // a renewal of its lease
			close(queueRelease)
			if status := <-slow; status != 200 {
				t.Fatalf("the slow request: %d", status)
			}
			if r := <-waiter; r.Status != 200 || r.Header.Get("X-RateLimit-Degraded") != "" || r.Header.Get("X-RateLimit-Waited") == "" {
				t.Fatalf("the waiter: %d %v, want 200 after a wait, not degraded", r.Status, r.Header)
			}
		})

		// A token bucket zone after all that: security-3 and newcomer-3 saw those degrade, the
		// failures of the other zones having opened the circuit breaker.
		t.Run("tb_last", func(t *testing.T) { ok(t, "first", "/tb_last/", "2") })

		// The penalty box: the denial writes the block key (SET), the next decision reads it
		// (GET) before the zone's algorithm.
		t.Run("sw_block", func(t *testing.T) {
			ok(t, "first", "/sw_block/", "0")
			denied(t, "the block starts", "/sw_block/")
			for i := range 3 {
				denied(t, fmt.Sprintf("blocked %d", i+1), "/sw_block/")
			}
		})

		// The reset broadcast: the client is denied from this instance's deny cache (trusted
		// 1h), another instance resets it (DEL and PUBLISH, with the admin API's ACL), and the
		// message, received on this instance's subscription, clears the cache.
		t.Run("reset broadcast", func(t *testing.T) {
			ok(t, "first", "/bc/", "0")
			denied(t, "second", "/bc/")
			denied(t, "third", "/bc/")
			redistest.WaitFor(t, 5*time.Second, "the instance subscribed to rl:reset", func() bool {
				return fmt.Sprint(srv.Do("PUBSUB", "NUMSUB", "rl:reset")) == "[rl:reset 1]"
			})
			rdb, err := resolvedRedis{Addresses: []string{srv.Addr}, Username: "admin", Password: "s3cret", DialTimeout: time.Second}.newClient()
			if err != nil {
				t.Fatal(err)
			}
			defer rdb.Close()
			other := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:"})
			if existed, err := other.Reset(context.Background(), &limiter.Zone{Name: "bc", Algorithm: limiter.SlidingWindow}, "127.0.0.1"); err != nil || !existed {
				t.Fatalf("reset by another instance: %v, %v", existed, err)
			}
			redistest.WaitFor(t, 5*time.Second, "the reset reaches this instance's deny cache", func() bool {
				return cs.Get("/bc/").Status == 200
			})
			// go-redis checks the subscription with a PING after 3s without a message.
			redistest.WaitFor(t, 10*time.Second, "the subscription's health check PING", func() bool {
				return commandStats(t, srv)["ping"][0] > 0
			})
		})
	})

	t.Run("admin API", func(t *testing.T) {
		ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
			username admin
			password s3cret
		}
		zone tb {
			match path /tb
			key {http.request.header.X-Client}
			capacity 3
			refill_rate 1/1h
		}
		zone sw {
			match path /sw
			key {http.request.header.X-Client}
			algorithm sliding_window
			limit 3
			window 1h
		}
		zone fw {
			match path /fw
			key {http.request.header.X-Client}
			algorithm fixed_window
			limit 3
			period month
		}
		zone sc {
			match path /sc
			key {http.request.header.X-Client}
			algorithm sliding_window_counter
			limit 3
			window 366d
		}
		zone blk {
			match path /blk
			key {http.request.header.X-Client}
			capacity 3
			refill_rate 1/1h
			block 1h
			block_max 2h
			overrides
			top 10
		}
	}
	respond "ok"`, srv.Addr))
		zones := adminJSON[[]adminapi.ZoneInfo](t, ac, "GET", "/rate_limit_redis/zones", 200)
		var names []string
		for _, z := range zones {
			names = append(names, z.Name+" "+z.Algorithm)
		}
		if got := strings.Join(names, ", "); got != "blk token_bucket, fw fixed_window, sc sliding_window_counter, sw sliding_window, tb token_bucket" {
			t.Fatalf("zones: %s", got)
		}
		for _, z := range []string{"tb", "sw", "fw", "sc"} {
			t.Run(z, func(t *testing.T) {
				// security-3's t_acl_admin.sh: the state of a fixed window failed with EXECABORT.
				if st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone="+z+"&key=bob", 200); len(st) != 1 || st[0].Exists || st[0].Remaining != 3 {
					t.Fatalf("state of a client never seen: %+v", st)
				}
				for i := 1; i <= 3; i++ {
					ac.Get("/"+z, "X-Client", "alice").Expect(t, fmt.Sprintf("request %d", i), 200, "ok", "X-RateLimit-Degraded", "")
				}
				st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone="+z+"&key=alice", 200)
				if len(st) != 1 || !st[0].Exists || st[0].Remaining != 0 || st[0].RetryAfterMs <= 0 || st[0].TTLMs <= 0 ||
					(z == "tb") != (st[0].Tokens != nil) || (z != "tb" && (st[0].Count == nil || *st[0].Count != 3)) {
					t.Fatalf("state of alice after 3 requests: %+v", st)
				}
				reset := adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone="+z+"&key=alice", 200)
				if len(reset) != 1 || !reset[0].Deleted {
					t.Fatalf("reset: %+v", reset)
				}
				ac.Get("/"+z, "X-Client", "alice").Expect(t, "after the reset", 200, "ok", "X-RateLimit-Degraded", "", "X-RateLimit-Remaining", "2")
			})
		}
		t.Run("block", func(t *testing.T) {
			if b := adminJSON[[]adminapi.BlockResult](t, ac, "PUT", "/rate_limit_redis/block?zone=blk&key=eve&for=10m", 200); len(b) != 1 || !b[0].Broadcast {
				t.Fatalf("block: %+v", b)
			}
			ac.Get("/blk", "X-Client", "eve").Expect(t, "blocked", 429, "", "X-RateLimit-Degraded", "")
			if top := adminJSON[adminapi.TopReply](t, ac, "GET", "/rate_limit_redis/top?zone=blk", 200); len(top.Entries) != 1 || top.Entries[0].Key != "eve" || top.Entries[0].Count != 1 {
				t.Fatalf("top: %+v", top)
			}
			if st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone=blk&key=eve", 200); len(st) != 1 || st[0].BlockedUntilMs == nil ||
				st[0].Strikes == nil || *st[0].Strikes != 1 {
				t.Fatalf("state of a blocked client: %+v", st)
			}
			if l := adminJSON[adminapi.ListPage[adminapi.BlockEntry]](t, ac, "GET", "/rate_limit_redis/blocks?zone=blk", 200); len(l.Entries) != 1 || l.Entries[0].Key != "eve" ||
				!l.Entries[0].Blocked || l.Cursor != "" {
				t.Fatalf("blocks: %+v", l)
			}
			if l := adminJSON[adminapi.ListPage[adminapi.OverrideEntry]](t, ac, "GET", "/rate_limit_redis/overrides?zone=blk", 200); len(l.Entries) != 0 || l.Cursor != "" {
				t.Fatalf("overrides: %+v", l)
			}
			adminJSON[[]adminapi.ResetResult](t, ac, "DELETE", "/rate_limit_redis/state?zone=blk&key=eve", 200)
			ac.Get("/blk", "X-Client", "eve").Expect(t, "unblocked", 200, "ok", "X-RateLimit-Degraded", "")
		})
	})
	if t.Failed() {
		return
	}

	// Nothing refused, and every command granted was sent: the ACL is complete and has nothing
	// the module does not use.
	if log := srv.Do("ACL", "LOG"); fmt.Sprint(log) != "[]" {
		t.Fatalf("ACL LOG: %v", log)
	}
	var sent []string
	for name, s := range commandStats(t, srv) {
		if s[1] > 0 {
			t.Errorf("Redis refused %s %d times", name, s[1])
		}
		if s[0] > 0 && !slices.Contains(testCommands, name) {
			sent = append(sent, "+"+name)
		}
	}
	granted := append(grantLimiter.rules("rl:")[3:], grantAdmin.rules("rl:")...)
	slices.Sort(sent)
	slices.Sort(granted)
	if !slices.Equal(sent, granted) {
		t.Errorf("commands sent:\n%v\ngranted by the ACL's first two lines:\n%v", sent, granted)
	}
}

// TestRedisACLMissingGrant: a user without one of the commands, or with another key prefix, or
// (with db 1) without the db line, fails every decision of the zone, and fail_mode applies;
// with the db line, db 1 works.
func TestRedisACLMissingGrant(t *testing.T) {
	base := aclRules()
	for _, tc := range []struct {
		name     string
		rules    []string
		db       string
		degraded string
	}{
		{"without ZADD", slices.DeleteFunc(slices.Clone(base), func(r string) bool { return r == "+zadd" }), "", "true"},
		{"another key prefix", append([]string{"~other:*"}, base[1:]...), "", "true"},
		{"db 1 without +select", base, "db 1", "true"},
		{"db 1 with the db line", append(slices.Clone(base), grantDB.rules("rl:")...), "db 1", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redistest.Start(t)
			args := []any{"ACL", "SETUSER", "limiter", "on", ">s3cret"}
			for _, r := range tc.rules {
				args = append(args, r)
			}
			srv.Do(args...)
			cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
			username limiter
			password s3cret
			%s
		}
		zone sw {
			algorithm sliding_window
			limit 10
			window 1h
		}
	}
	respond "ok"`, srv.Addr, tc.db))
			remaining := "9"
			if tc.degraded != "" {
				remaining = ""
			}
			cs.Get("/").Expect(t, "first", 200, "ok", "X-RateLimit-Degraded", tc.degraded, "X-RateLimit-Remaining", remaining)
		})
	}
}

// TestRedisACLCluster: on Redis Cluster, the user of the documented ACL with the Cluster line
// (and the admin API's) serves a request whose zones, of all four algorithms, are in different
// hash slots (holds, then commit or release in each): two admitted, the third denied by the zone
// of limit 2 and charged nowhere; the Cluster line's commands are sent and nothing is refused.
// Without the Cluster line, no decision is made at all (NOPERM on CLUSTER SLOTS).
func TestRedisACLCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	for _, n := range c.Nodes {
		setUsers(t, n, "limiter", grantLimiter, grantAdmin, grantCluster)
		setUsers(t, n, "nocluster", grantLimiter, grantAdmin)
		n.Do("CONFIG", "RESETSTAT")
	}
	for _, user := range []string{"limiter", "nocluster"} {
		t.Run(user, func(t *testing.T) {
			ac := startCaddyAdmin(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
			username %s
			password s3cret
		}
		zone tb {
			key {http.request.header.X-A}
			capacity 3
			refill_rate 1/1h
		}
		zone sw {
			key {http.request.header.X-B}
			algorithm sliding_window
			limit 3
			window 1h
		}
		zone fw {
			key {http.request.header.X-C}
			algorithm fixed_window
			limit 3
			period month
		}
		zone sc {
			key {http.request.header.X-D}
			algorithm sliding_window_counter
			limit 2
			window 366d
		}
	}
	respond "ok"`, strings.Join(c.Addrs(), " "), user))
			keys := []string{"X-A", "a-" + user, "X-B", "b-" + user, "X-C", "c-" + user, "X-D", "d-" + user}
			slots := map[any]bool{}
			for i := 1; i < len(keys); i += 2 {
				slots[c.Nodes[0].Do("CLUSTER", "KEYSLOT", keys[i])] = true
			}
			if len(slots) != 4 {
				t.Fatalf("the keys share slots: %v", slots)
			}
			if user == "nocluster" {
				ac.Get("/", keys...).Expect(t, "without the Cluster line", 200, "ok", "X-RateLimit-Degraded", "true")
				return
			}
			ac.Get("/", keys...).Expect(t, "first", 200, "ok", "X-RateLimit-Degraded", "", "X-RateLimit-Remaining", "1")
			ac.Get("/", keys...).Expect(t, "second", 200, "ok", "X-RateLimit-Degraded", "", "X-RateLimit-Remaining", "0")
			ac.Get("/", keys...).Expect(t, "third", 429, "", "X-RateLimit-Degraded", "")
			for i, z := range []string{"tb", "sw", "fw", "sc"} {
				st := adminJSON[[]adminapi.ClientState](t, ac, "GET", "/rate_limit_redis/state?zone="+z+"&key="+keys[2*i+1], 200)
				if len(st) != 1 || !st[0].Exists || (z == "tb" && (st[0].Tokens == nil || *st[0].Tokens < 0.99 || *st[0].Tokens > 1.01)) ||
					(z != "tb" && (st[0].Count == nil || *st[0].Count != 2)) {
					t.Fatalf("%s: state after two admitted and one denied: %+v", z, st)
				}
			}
			// The Cluster line's commands are sent (to some node), and nothing is refused.
			calls := map[string]int{}
			for _, n := range c.Nodes {
				if log := n.Do("ACL", "LOG"); fmt.Sprint(log) != "[]" {
					t.Fatalf("%s: ACL LOG: %v", n.Addr, log)
				}
				for name, s := range commandStats(t, n) {
					calls[name] += s[0]
				}
			}
			for _, r := range grantCluster.rules("rl:") {
				if calls[strings.TrimPrefix(r, "+")] == 0 {
					t.Errorf("the Cluster line grants %s, which no node was sent", r)
				}
			}
		})
	}
}

// TestRedisACLSentinel: with Sentinel, the data nodes given the documented ACL's first line
// serve every algorithm: the failover client asks the Sentinels (which have no user) for the
// primary, and sends the primary what a standalone client sends.
func TestRedisACLSentinel(t *testing.T) {
	ss := redistest.StartSentinels(t, 5*time.Second)
	for _, n := range []*redistest.Server{ss.Primary, ss.Replica} {
		setUsers(t, n, "limiter", grantLimiter)
	}
	var zones strings.Builder
	for _, z := range []string{"tb capacity 2\n\t\t\trefill_rate 1/1h", "sw algorithm sliding_window\n\t\t\tlimit 2\n\t\t\twindow 1h",
		"fw algorithm fixed_window\n\t\t\tlimit 2\n\t\t\tperiod month", "sc algorithm sliding_window_counter\n\t\t\tlimit 2\n\t\t\twindow 366d"} {
		name, rest, _ := strings.Cut(z, " ")
		fmt.Fprintf(&zones, "\n\t\tzone %s {\n\t\t\tmatch path /%s\n\t\t\t%s\n\t\t}", name, name, rest)
	}
	cs := caddytest.Start(t, fmt.Sprintf(`
	rate_limit_redis {
		redis {
			address %s
			sentinel %s
			username limiter
			password s3cret
		}%s
	}
	respond "ok"`, strings.Join(ss.Addrs(), " "), ss.Master, zones.String()))
	for _, z := range []string{"tb", "sw", "fw", "sc"} {
		cs.Get("/"+z).Expect(t, z+" first", 200, "ok", "X-RateLimit-Degraded", "", "X-RateLimit-Remaining", "1")
		cs.Get("/"+z).Expect(t, z+" second", 200, "ok", "X-RateLimit-Degraded", "", "X-RateLimit-Remaining", "0")
		cs.Get("/"+z).Expect(t, z+" third", 429, "", "X-RateLimit-Degraded", "")
	}
	if log := ss.Primary.Do("ACL", "LOG"); fmt.Sprint(log) != "[]" {
		t.Fatalf("ACL LOG: %v", log)
	}
}

// TestDocumentedACL: the ACL docs/security.md tells operators to give the limiter is redisACL's,
// line for line (each on a line of its own), and no other: the one derived from redisUses, which
// TestRedisACL, TestRedisACLCluster and TestTLSAndACL prove sufficient.
func TestDocumentedACL(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("docs/security.md")
	if err != nil {
		t.Fatal(err)
	}
	var documented []string
	for _, line := range strings.Split(string(b), "\n") {
		if line = strings.TrimSpace(line); strings.HasPrefix(line, "ACL SETUSER") {
			documented = append(documented, line)
		}
	}
	if want := redisACL("limiter", "password", "rl:"); !slices.Equal(documented, want) {
		t.Errorf("docs/security.md gives the ACL\n%s\nwant, derived from redisUses (acl_test.go):\n%s",
			strings.Join(documented, "\n"), strings.Join(want, "\n"))
	}
}

// TestRedisACLConcurrency: a user with exactly the documented ACL's first line takes a slot,
// refreshes it (refresh.lua) and gives it back, and its admin line reads the slots (State,
// InFlight) and resets them; Redis refuses nothing.
func TestRedisACLConcurrency(t *testing.T) {
	srv := redistest.Start(t)
	setUsers(t, srv, "limiter", grantLimiter)
	setUsers(t, srv, "admin", grantLimiter, grantAdmin)
	ctx := context.Background()
	now := time.Now()
	clock := func() time.Time { return now }
	for _, user := range []string{"limiter", "admin"} {
		rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: user, Password: "s3cret", DisableIdentity: true}) // as the module connects: no CLIENT SETINFO
		t.Cleanup(func() { _ = rdb.Close() })
		l := limiter.New(rdb, limiter.Options{KeyPrefix: "rl:", Now: clock})
		z := &limiter.Zone{Name: "c" + user, Algorithm: limiter.Concurrency, Limit: 1}
		d, err := l.Decide(ctx, []limiter.Request{{Zone: z, Key: "alice", Cost: 1, Hold: 3 * time.Second}})
		if err != nil || !d.Allowed {
			t.Fatalf("%s: allow: %+v %v", user, d, err)
		}
		now = now.Add(time.Second)
		if n, err := l.Refresh(ctx); err != nil || n != 1 {
			t.Fatalf("%s: refresh: %d %v", user, n, err)
		}
		if user == "admin" {
			if s, err := l.State(ctx, z, "alice"); err != nil || s.Count != 1 {
				t.Fatalf("state: %+v %v", s, err)
			}
			if slots, err := l.InFlight(ctx, z, "alice"); err != nil || len(slots) != 1 {
				t.Fatalf("in flight: %v %v", slots, err)
			}
			if existed, err := l.Reset(ctx, z, "alice"); err != nil || !existed {
				t.Fatalf("reset: %v %v", existed, err)
			}
			continue
		}
		if _, err := l.Settle(ctx, d.Held, nil); err != nil {
			t.Fatalf("settle: %v", err)
		}
	}
	if log := srv.Do("ACL", "LOG"); fmt.Sprint(log) != "[]" {
		t.Fatalf("ACL LOG: %v", log)
	}
}

// TestRedisACLOverridesAndShadow: the documented ACL serves zones with overrides and shadow
// zones: the decisions (the override's HMGET) under the limiter's grant, and PUT, GET and DELETE
// /rate_limit_redis/override under the admin's.
func TestRedisACLOverridesAndShadow(t *testing.T) {
	srv := redistest.Start(t)
	setUsers(t, srv, "admin", grantLimiter, grantAdmin)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("ACL LOG: %v", srv.Do("ACL", "LOG"))
		}
	})
	var zones []*Zone
	for _, algo := range []string{tokenBucketName, slidingWindowName, "fixed_window", "sliding_window_counter"} {
		z := &Zone{Name: "ov_" + algo, Key: []string{"{http.request.header.X-API-Key}"}, Algorithm: algo, Overrides: true}
		if algo == tokenBucketName {
			z.Capacity, z.RefillRate = NumberOf(2), NumberOf(1.0/3600)
		} else {
			z.Limit, z.Window = NumberOf(2), NumberOf(time.Hour)
		}
		zones = append(zones, z)
	}
	zones = append(zones, &Zone{Name: "shadow", Key: []string{"{http.request.header.X-API-Key}"}, Capacity: NumberOf(1), RefillRate: NumberOf(1.0 / 3600), DryRun: true})
	h := provisioned(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}, Username: "admin", Password: "s3cret"}, Zones: zones})
	admin := adminapi.New(h.live)
	for _, z := range zones[:4] {
		body := `{"limit": 3}`
		if z.Algorithm == tokenBucketName {
			body = `{"capacity": 3}`
		}
		if code, out := adminOverride(t, admin, http.MethodPut, "zone="+z.Name+"&key=erin", body); code != 200 || !strings.Contains(out, `"broadcast":true`) {
			t.Fatalf("PUT %s: %d %s", z.Name, code, out)
		}
	}
	for i, want := range []int{200, 200, 200, 429} {
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		req.Header.Set("X-API-Key", "erin")
		w, err, _ := serve(h, req)
		code := w.Code
		var he caddyhttp.HandlerError
		if errors.As(err, &he) {
			code = he.StatusCode
		} else if err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
		if code != want || w.Header().Get("X-RateLimit-Degraded") != "" {
			t.Fatalf("request %d: %d (degraded %q), want %d: every zone raised to 3, the shadow zone never refusing", i+1, code, w.Header().Get("X-RateLimit-Degraded"), want)
		}
	}
	for _, m := range []string{http.MethodGet, http.MethodDelete} {
		if code, out := adminOverride(t, admin, m, "zone=ov_token_bucket&key=erin", ""); code != 200 || !strings.Contains(out, `"exists":true`) {
			t.Fatalf("%s: %d %s", m, code, out)
		}
	}
}
