package ratelimitredis

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/adminapi"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// topTestZone is a token bucket zone of 1 request an hour per X-Client (a request without one
// skips it) with a top of 10 clients. Its handlers turn the deny cache off, so that every
// denial is decided, and counted, in Redis.
func topTestZone(name string) *Zone {
	return &Zone{
		Name: name, Key: []string{"{http.request.header.X-Client}"}, Capacity: NumberOf(1), RefillRate: NumberOf(1.0 / 3600),
		EmptyKey: EmptyKeySkip, Top: 10,
	}
}

// sendAs sends n requests to h as client c.
func sendAs(t *testing.T, h *Handler, c string, n int) {
	t.Helper()
	for range n {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Client", c)
		serve(h, r)
	}
}

// topOf calls GET path on a and decodes its reply, which must have no field adminapi.TopReply lacks.
func topOf(t *testing.T, a *adminapi.AdminAPI, path string) adminapi.TopReply {
	t.Helper()
	code, body := adminCall(t, a, http.MethodGet, path)
	if code != http.StatusOK {
		t.Fatalf("GET %s: %d %s", path, code, body)
	}
	var r adminapi.TopReply
	dec := json.NewDecoder(strings.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		t.Fatalf("GET %s: decoding %s: %v", path, body, err)
	}
	return r
}

// topCounts returns the key and count of each entry of r, in order.
func topCounts(r adminapi.TopReply) []string {
	out := []string{}
	for _, e := range r.Entries {
		out = append(out, fmt.Sprintf("%s=%d", e.Key, e.Count))
	}
	return out
}

// TestTopEndpoint: GET /rate_limit_redis/top lists the clients by denials (the default) or by
// units used, highest first, n of them, a hashed key as its digest, exact counts (error 0) while
// the top has room; and sends Redis only TIME, ZRANGE and HGETALL, writing nothing.
func TestTopEndpoint(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{DenyCache: new(false), Redis: listRedis(srv.Addr), Timeout: caddy.Duration(5 * time.Second), Zones: []*Zone{topTestZone("api")}})
	a := adminapi.New(h.live)
	long := "tok en{x}" + strings.Repeat("x", 80)
	sendAs(t, h, "alice", 4)
	sendAs(t, h, long, 3)
	sendAs(t, h, "bob", 2)
	sendAs(t, h, "carol", 1)

	srv.Do("CONFIG", "RESETSTAT")
	keysBefore := srv.Keys(t)
	denied := topOf(t, a, "/rate_limit_redis/top?zone=api")
	used := topOf(t, a, "/rate_limit_redis/top?zone=api&by=used&n=2")
	if sent := sentCommands(t, srv); !slices.Equal(sent, []string{"hgetall", "time", "zrange"}) {
		t.Errorf("the top replies sent %v, want only TIME, ZRANGE and HGETALL", sent)
	}
	if keys := srv.Keys(t); !sameSet(keys, keysBefore) {
		t.Errorf("keys after the top replies: %v, before: %v", keys, keysBefore)
	}

	digest := limiter.ClientKey(long)
	if got, want := topCounts(denied), []string{"alice=3", digest + "=2", "bob=1"}; !slices.Equal(got, want) {
		t.Errorf("denied: %v, want %v", got, want)
	}
	if denied.By != "denied" || denied.Zone != "api" || denied.WindowMs != 60_000 || denied.SinceMs%60_000 != 0 ||
		!denied.Entries[1].Hashed || denied.Entries[0].Hashed || denied.Entries[0].Candidate != 1 ||
		!slices.Equal(denied.Entries[0].Redis, []string{srv.Addr}) {
		t.Errorf("denied: %+v", denied)
	}
	for _, e := range denied.Entries {
		if e.Error != 0 || e.Guaranteed != e.Count {
			t.Errorf("entry %+v of a top that never filled: want error 0, guaranteed = count", e)
		}
	}
	if now := srv.Time().UnixMilli(); denied.SinceMs <= now-120_000 || denied.SinceMs > now-60_000 {
		t.Errorf("since_ms %d, want the previous minute's start before %d", denied.SinceMs, now)
	}
	if got := topCounts(used); used.By != "used" || len(got) != 2 || !strings.HasSuffix(got[0], "=1") || !strings.HasSuffix(got[1], "=1") {
		t.Errorf("used, n 2: %v (%+v), want 2 clients of 1 unit each", got, used)
	}
}

// TestTopFloodEndpoint: a heavy client denied 99 times while 200 invented keys are denied twice
// each, in a top of 10: the reply ranks by count, in which invented keys show far more than
// their 2, and gives each entry's error and guaranteed count (count less error): every invented
// key's guaranteed count is at most 2, below the heavy client's, which is at most its 99.
func TestTopFloodEndpoint(t *testing.T) {
	srv := redistest.Start(t)
	h := provisioned(t, &Handler{DenyCache: new(false), Redis: listRedis(srv.Addr), Timeout: caddy.Duration(5 * time.Second), Zones: []*Zone{topTestZone("api")}})
	a := adminapi.New(h.live)
	for i := range 200 {
		sendAs(t, h, fmt.Sprintf("flood-%d", i), 3)
		if i%2 == 0 {
			sendAs(t, h, "heavy", 1)
		}
	}
	top := topOf(t, a, "/rate_limit_redis/top?zone=api")
	var heavy *adminapi.TopEntry
	inflated := false
	for i, e := range top.Entries {
		if e.Guaranteed != e.Count-e.Error || e.Error < 0 {
			t.Errorf("entry %+v: want guaranteed = count - error, error >= 0", e)
		}
		if e.Key == "heavy" {
			heavy = &top.Entries[i]
		} else if e.Guaranteed > 2 {
			t.Errorf("invented %+v: guaranteed above its 2 denials", e)
		} else if e.Count > 2 {
			inflated = true
		}
	}
	if heavy == nil || heavy.Guaranteed > 99 || heavy.Count < 99 {
		t.Fatalf("top %+v: want the heavy client, guaranteed <= 99 <= count", top)
	}
	for _, e := range top.Entries {
		if e.Key != "heavy" && e.Guaranteed >= heavy.Guaranteed {
			t.Errorf("invented %+v: guaranteed not below the heavy client's %d", e, heavy.Guaranteed)
		}
	}
	if !inflated {
		t.Errorf("top %+v: no invented key above its 2: the flood did not fill the top", top)
	}
}

// TestTopOnCluster: on a Redis Cluster of 3 primaries, the top merges the clients of every
// primary into one ranking.
func TestTopOnCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	h := provisioned(t, &Handler{DenyCache: new(false), Redis: listRedis(c.Addrs()...), Timeout: caddy.Duration(5 * time.Second), Zones: []*Zone{topTestZone("api")}})
	clients := clientNames("client-", 12)
	var want []string
	for i, cl := range clients {
		sendAs(t, h, cl, 2+i) // 1 admitted, 1 + i denied
		want = append([]string{fmt.Sprintf("%s=%d", cl, 1+i)}, want...)
	}
	for i, n := range c.Nodes {
		if got := len(n.Keys(t)); got < 3 {
			t.Fatalf("primary %d holds %d keys: the clients are not spread", i, got)
		}
	}
	a := adminapi.New(h.live)
	start := time.Now()
	if got := topCounts(topOf(t, a, "/rate_limit_redis/top?zone=api&n=5")); !slices.Equal(got, want[:5]) {
		t.Errorf("top 5 denied: %v, want %v", got, want[:5])
	}
	t.Logf("GET /top on 3 primaries (32,768 ZRANGEs and HGETALLs): %v", time.Since(start))
	if got := topCounts(topOf(t, a, "/rate_limit_redis/top?zone=api&by=used&n=1000")); len(got) != 12 {
		t.Errorf("used: %v, want the 12 clients", got)
	}
}

// TestTopHostileInput: the top's bad parameters are each a 400 naming the fault, with no Redis
// command sent and nothing written.
func TestTopHostileInput(t *testing.T) {
	srv := redistest.Start(t)
	plain := &Zone{Name: "plain", Key: []string{"{http.request.header.X-Client}"}, Capacity: NumberOf(1), RefillRate: NumberOf(1)}
	h := provisioned(t, &Handler{DenyCache: new(false), Redis: listRedis(srv.Addr), Zones: []*Zone{topTestZone("api"), plain}})
	sendAs(t, h, "alice", 2)
	a := adminapi.New(h.live)
	topOf(t, a, "/rate_limit_redis/top?zone=api") // connections open
	keysBefore := srv.Keys(t)
	srv.Do("CONFIG", "RESETSTAT")

	nErr := func(v string) string { return fmt.Sprintf("n: %q must be one integer from 1 to 1000", v) }
	byErr := func(v string) string { return fmt.Sprintf("by: %q must be denied or used", v) }
	base := "/rate_limit_redis/top?zone=api"
	for _, c := range []struct{ path, msg string }{
		{"/rate_limit_redis/top", "query parameter zone is required"},
		{"/rate_limit_redis/top?zone=", "query parameter zone is required"},
		{"/rate_limit_redis/top?zone=nope", `no rate_limit_redis zone named "nope" is loaded`},
		{"/rate_limit_redis/top?zone=ap%2A", `no rate_limit_redis zone named "ap*" is loaded`},
		{"/rate_limit_redis/top?zone=%7Bx%7D%3Aapi", `no rate_limit_redis zone named "{x}:api" is loaded`},
		{"/rate_limit_redis/top?zone=plain", "zone plain has no top: add `top <entries>` to its block to count its clients"},
		{base + "&n=abc", nErr("abc")},
		{base + "&n=", nErr("")},
		{base + "&n=0", nErr("0")},
		{base + "&n=-1", nErr("-1")},
		{base + "&n=1001", nErr("1001")},
		{base + "&n=99999999999999999999", nErr("99999999999999999999")},
		{base + "&n=5&n=6", nErr("5,6")},
		{base + "&by=", byErr("")},
		{base + "&by=DENIED", byErr("DENIED")},
		{base + "&by=blocks", byErr("blocks")},
		{base + "&by=used&by=denied", byErr("used,denied")},
	} {
		if code, msg := adminCall(t, a, http.MethodGet, c.path); code != 400 || msg != c.msg {
			t.Errorf("GET %s: %d %q, want 400 %q", c.path, code, msg, c.msg)
		}
	}
	if code, msg := adminCall(t, a, http.MethodDelete, base); code != 405 || msg != "method DELETE not allowed: use GET" {
		t.Errorf("DELETE %s: %d %q, want 405", base, code, msg)
	}
	if sent := sentCommands(t, srv); len(sent) > 0 {
		t.Errorf("bad requests sent %v to Redis", sent)
	}
	if keys := srv.Keys(t); !sameSet(keys, keysBefore) {
		t.Errorf("keys after the bad requests: %v, before: %v", keys, keysBefore)
	}
}
