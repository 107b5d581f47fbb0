package limiter_test

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// readTop returns the n highest counts of kind by in z's top, failing the test on an error.
func readTop(t *testing.T, l *limiter.Limiter, z *limiter.Zone, by limiter.TopBy, n int) []limiter.TopEntry {
	t.Helper()
	top, _, err := l.ReadTop(context.Background(), z, by, n)
	if err != nil {
		t.Fatal(err)
	}
	return top
}

// topZone is a token bucket zone of capacity 2 that never refills within a test, with a top of
// entries entries per set and a window of one minute.
func topZone(entries int) *limiter.Zone {
	return &limiter.Zone{Name: "api", Algorithm: limiter.TokenBucket, Capacity: 2, RefillRate: 1e-6, Top: entries, TopWindow: time.Minute}
}

// TestTopExactBelowCapacity: with fewer distinct clients than the top's entries, each client's
// denials and charged units are counted exactly, highest first, and n cuts the list.
func TestTopExactBelowCapacity(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := topZone(10)
	for client, n := range map[string]int{"alice": 6, "bob": 3, "carol": 1} {
		for range n {
			allow(t, l, limiter.Request{Zone: z, Key: client, Cost: 1})
		}
	}
	denied := readTop(t, l, z, limiter.TopDenied, 10)
	if want := []limiter.TopEntry{{Client: "alice", Count: 4}, {Client: "bob", Count: 1}}; !reflect.DeepEqual(denied, want) {
		t.Errorf("denied %v, want %v", denied, want)
	}
	used := readTop(t, l, z, limiter.TopUsed, 2)
	if want := []limiter.TopEntry{{Client: "alice", Count: 2}, {Client: "bob", Count: 2}}; !reflect.DeepEqual(used, want) {
		t.Errorf("used (n 2) %v, want %v", used, want)
	}
}

// TestTopBoundedMemory: 200 distinct clients denied in a top of 8 entries leave at most 8
// members per set, and the one heavy client is listed first with a count at least its true
// count and above it by at most the set's total divided by 8.
func TestTopBoundedMemory(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := topZone(8)
	z.Capacity = 1
	total := 0
	for i := range 200 {
		allow(t, l, limiter.Request{Zone: z, Key: fmt.Sprintf("c%d", i), Cost: 1})
		allow(t, l, limiter.Request{Zone: z, Key: fmt.Sprintf("c%d", i), Cost: 1}) // denied
		total++
		if i%4 == 0 {
			allow(t, l, limiter.Request{Zone: z, Key: "heavy", Cost: 1})
			total++
		}
	}
	heavy := 50 - 1 // its first request was admitted
	total--
	for _, key := range srv.Keys(t) {
		if srv.Do("TYPE", key) != "zset" {
			continue
		}
		if n := srv.Do("ZCARD", key).(int64); n > 8 {
			t.Errorf("%s holds %d members, want at most 8", key, n)
		}
	}
	top := readTop(t, l, z, limiter.TopDenied, 1)
	if len(top) != 1 || top[0].Client != "heavy" || top[0].Count < int64(heavy) || top[0].Count > int64(heavy+total/8) {
		t.Errorf("top %v, want heavy with %d to %d denials", top, heavy, heavy+total/8)
	}
}

// TestTopWindowRotates: counts stay listed through the next bucket and are gone from the listing
// two buckets later; each set expires within two windows of its creation.
func TestTopWindowRotates(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := topZone(10)
	for range 3 {
		allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1})
	}
	for _, key := range srv.Keys(t) {
		if srv.Do("TYPE", key) != "zset" {
			continue
		}
		if ttl := srv.Do("PTTL", key).(int64); ttl <= 0 || ttl > 2*time.Minute.Milliseconds() {
			t.Errorf("%s PTTL %dms, want (0, 120000]", key, ttl)
		}
	}
	clk.Advance(time.Minute)
	allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1})
	if got := readTop(t, l, z, limiter.TopDenied, 10); !reflect.DeepEqual(got, []limiter.TopEntry{{Client: "alice", Count: 2}}) {
		t.Errorf("a window later: %v, want alice's 2 denials of both buckets", got)
	}
	clk.Advance(time.Minute)
	if got := readTop(t, l, z, limiter.TopDenied, 10); !reflect.DeepEqual(got, []limiter.TopEntry{{Client: "alice", Count: 1}}) {
		t.Errorf("two windows later: %v, want alice's 1 denial of the previous bucket", got)
	}
	clk.Advance(time.Minute)
	if got := readTop(t, l, z, limiter.TopDenied, 10); len(got) != 0 {
		t.Errorf("three windows later: %v, want none", got)
	}
}

// TestTopShadowAndMultiZone: a zone counts every denial of its own (a shadow zone's would-be
// denials too), and units only when the decision admits; in a decision another zone denies, an
// admitting zone counts nothing.
func TestTopShadowAndMultiZone(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: newClock().Now})
	shadow, strict := topZone(10), topZone(10)
	shadow.Name, shadow.Shadow, shadow.Capacity = "shadow", true, 1
	strict.Name, strict.Capacity = "strict", 2
	for range 3 {
		allow(t, l, limiter.Request{Zone: shadow, Key: "a", Cost: 1}, limiter.Request{Zone: strict, Key: "a", Cost: 1})
	}
	for _, c := range []struct {
		z    *limiter.Zone
		by   limiter.TopBy
		want []limiter.TopEntry
	}{
		{shadow, limiter.TopDenied, []limiter.TopEntry{{Client: "a", Count: 2}}}, // the 2nd and 3rd requests
		{shadow, limiter.TopUsed, []limiter.TopEntry{{Client: "a", Count: 1}}},
		{strict, limiter.TopDenied, []limiter.TopEntry{{Client: "a", Count: 1}}},
		{strict, limiter.TopUsed, []limiter.TopEntry{{Client: "a", Count: 2}}},
	} {
		if got := readTop(t, l, c.z, c.by, 10); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s by %v: %v, want %v", c.z.Name, c.by, got, c.want)
		}
	}
}

// TestTopCluster: on a 3-primary cluster, each client's counts are written in its own slot's
// set, and a listing over every primary merges them into one ranking.
func TestTopCluster(t *testing.T) {
	t.Parallel()
	c := redistest.StartCluster(t, 3)
	clk := newClock()
	l := clusterLimiter(t, c, limiter.Options{Now: clk.Now})
	z := topZone(10)
	perNode := clientsOn(t, c, 1)
	var want []limiter.TopEntry
	for i, ks := range perNode {
		for range 2 + 3 + i { // 2 admitted, 3 + i denied
			allow(t, l, limiter.Request{Zone: z, Key: ks[0], Cost: 1})
		}
		want = append([]limiter.TopEntry{{Client: ks[0], Count: int64(3 + i)}}, want...)
	}
	for i, s := range c.Nodes {
		if n := len(s.Keys(t)); n != 3 { // the client's state key, its denied and used sets
			t.Errorf("node %d holds %d keys, want 3: %v", i, n, s.Keys(t))
		}
	}
	if got := readTop(t, l, z, limiter.TopDenied, 10); !reflect.DeepEqual(got, want) {
		t.Errorf("denied %v, want %v", got, want)
	}
}
