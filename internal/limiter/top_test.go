package limiter_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
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
// members per set and 8 errors beside it, and the one heavy client is listed first with a count at least its true
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
		if n := srv.Do("HLEN", key+":e").(int64); n > 8 {
			t.Errorf("%s:e holds %d errors, want at most 8 (one per member)", key, n)
		}
	}
	top := readTop(t, l, z, limiter.TopDenied, 1)
	if len(top) != 1 || top[0].Client != "heavy" || top[0].Count < int64(heavy) || top[0].Count > int64(heavy+total/8) {
		t.Errorf("top %v, want heavy with %d to %d denials", top, heavy, heavy+total/8)
	}
}

// TestTopFloodShowsWhatIsGuaranteed: one heavy client denied 249 times while 500 invented keys
// are denied twice each, in a top of 10. The invented keys that hold places show counts far
// above their 2 (each took the place of the lowest), but their guaranteed counts (count less
// error) are at most 2, below the heavy client's; and every entry's guaranteed count is at most
// its true count, which is at most its count.
func TestTopFloodShowsWhatIsGuaranteed(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := topZone(10)
	z.Capacity = 1 // each client's first request is admitted, the others denied
	truth := map[string]int64{"heavy": -1}
	for i := range 500 {
		key := fmt.Sprintf("flood-%d", i)
		truth[key] = -1
		for range 3 {
			allow(t, l, limiter.Request{Zone: z, Key: key, Cost: 1})
			truth[key]++
		}
		if i%2 == 0 {
			allow(t, l, limiter.Request{Zone: z, Key: "heavy", Cost: 1})
			truth["heavy"]++
		}
	}
	top := readTop(t, l, z, limiter.TopDenied, 10)
	if len(top) != 10 {
		t.Fatalf("top %v, want 10 entries", top)
	}
	var heavy limiter.TopEntry
	inflated := false
	for _, e := range top {
		if g, n := e.Guaranteed(), truth[e.Client]; g > n || n > e.Count || e.Error < 0 {
			t.Errorf("%+v: guaranteed %d, true count %d: want guaranteed <= true <= count", e, g, n)
		}
		if e.Client == "heavy" {
			heavy = e
		} else if e.Count > 2*truth[e.Client] {
			inflated = true
		}
	}
	if heavy.Client == "" {
		t.Fatalf("top %v: the heavy client is missing", top)
	}
	for _, e := range top {
		if e.Client != "heavy" && e.Guaranteed() >= heavy.Guaranteed() {
			t.Errorf("invented %+v guaranteed %d, want below the heavy client's %d (%+v)", e, e.Guaranteed(), heavy.Guaranteed(), heavy)
		}
	}
	if !inflated {
		t.Errorf("top %v: no invented key's count above its true count: the flood did not test the error", top)
	}
}

// TestTopErrorAcrossBuckets: a top of 2. In one bucket a is denied 3 times, b twice, then c
// once: c takes b's place from its 2 (c: 3, error 2). In the next bucket b is denied once. The
// read over both sums each client's counts and errors, and b, missing from the earlier bucket's
// full set, may have had up to its lowest count (3) there: b 4, error 3; a 3 exact; c 3, error 2.
func TestTopErrorAcrossBuckets(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clk := newClock()
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:", Now: clk.Now})
	z := topZone(2)
	z.Capacity = 1
	send := func(client string, n int) {
		for range n {
			allow(t, l, limiter.Request{Zone: z, Key: client, Cost: 1})
		}
	}
	send("a", 4)
	send("b", 3)
	send("c", 2)
	clk.Advance(time.Minute)
	send("b", 1)
	want := []limiter.TopEntry{{Client: "b", Count: 4, Error: 3}, {Client: "a", Count: 3}, {Client: "c", Count: 3, Error: 2}}
	if got := readTop(t, l, z, limiter.TopDenied, 10); !reflect.DeepEqual(got, want) {
		t.Errorf("top %+v, want %+v", got, want)
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

// commandCalls returns srv's INFO commandstats calls per command, but the tests' own commands.
func commandCalls(srv *redistest.Server) map[string]string {
	got := map[string]string{}
	for _, line := range strings.Split(fmt.Sprint(srv.Do("INFO", "commandstats")), "\n") {
		name, rest, ok := strings.Cut(strings.TrimPrefix(line, "cmdstat_"), ":calls=")
		if ok && name != "info" && name != "hello" && name != "config|resetstat" && name != "script|load" {
			got[name], _, _ = strings.Cut(rest, ",")
		}
	}
	return got
}

// TestTopZoneWithoutTopSendsNothingMore: a zone without a top runs exactly the commands it ran
// before tops existed (INFO commandstats: one EVALSHA, HMGET and PEXPIRE per decision, HSET per
// admission), where a zone with a top adds ZSCORE, ZINCRBY and PEXPIRE NX per decision, and
// ZCARD when the client is new to the set (its first admission, its first denial).
func TestTopZoneWithoutTopSendsNothingMore(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	for _, c := range []struct {
		top  int
		want string
	}{
		{0, "map[evalsha:4 hmget:4 hset:1 pexpire:4 time:4]"},
		{10, "map[evalsha:4 hmget:4 hset:1 pexpire:8 time:4 zcard:2 zincrby:4 zscore:4]"},
	} {
		z := tb("api", 1, 1e-6)
		z.Top = c.top
		if c.top > 0 {
			z.TopWindow = time.Minute
		}
		allow(t, l, limiter.Request{Zone: z, Key: "warm", Cost: 1}) // loads the script
		srv.Do("FLUSHALL")
		srv.Do("CONFIG", "RESETSTAT")
		for range 4 {
			allow(t, l, limiter.Request{Zone: z, Key: "alice", Cost: 1})
		}
		if got := fmt.Sprint(commandCalls(srv)); got != c.want {
			t.Errorf("top %d: commands %s, want %s", c.top, got, c.want)
		}
	}
}

// TestTopValidate: top and top_window out of range, top_window without top and top with a lease
// are refused, each naming the field.
func TestTopValidate(t *testing.T) {
	for _, c := range []struct {
		top    int
		window time.Duration
		lease  bool
		field  string
	}{
		{-1, time.Minute, false, "top"},
		{limiter.MaxTop + 1, time.Minute, false, "top"},
		{5, 0, false, "top_window"},
		{5, time.Millisecond * 999, false, "top_window"},
		{5, 25 * time.Hour, false, "top_window"},
		{0, time.Minute, false, "top_window"},
		{5, time.Minute, true, "top"},
	} {
		z := tb("api", 10, 1)
		z.Top, z.TopWindow = c.top, c.window
		if c.lease {
			z.Lease = &limiter.Lease{Max: 2, TTL: time.Second}
		}
		var fe *limiter.FieldError
		if err := z.Validate(); !errors.As(err, &fe) || fe.Field != c.field {
			t.Errorf("top %d, window %v, lease %v: %v, want an error about %s", c.top, c.window, c.lease, err, c.field)
		}
	}
}

// BenchmarkTopDecide decides one request at a time against a real Redis, cycling over 1,000
// clients, in a token bucket zone without a top and with a top of 100 (full: most clients
// replace the lowest entry). It reports Redis's own time per decision (INFO commandstats,
// EVALSHA's usec_per_call) as redis-µs/op.
func BenchmarkTopDecide(b *testing.B) {
	srv := redistest.Start(b)
	l := limiter.New(srv.Client(), limiter.Options{KeyPrefix: "rl:"})
	for _, top := range []int{0, 100} {
		b.Run("top="+strconv.Itoa(top), func(b *testing.B) {
			z := tb("api", 1, 1e-6)
			if top > 0 {
				z.Top, z.TopWindow = top, time.Minute
			}
			if err := z.Validate(); err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			if _, err := l.Decide(ctx, []limiter.Request{{Zone: z, Key: "warm", Cost: 1}}); err != nil {
				b.Fatal(err)
			}
			srv.Do("CONFIG", "RESETSTAT")
			i := 0
			for b.Loop() {
				if _, err := l.Decide(ctx, []limiter.Request{{Zone: z, Key: "c" + strconv.Itoa(i%1000), Cost: 1}}); err != nil {
					b.Fatal(err)
				}
				i++
			}
			b.ReportMetric(evalUsec(b, srv), "redis-µs/op")
		})
	}
}

// evalUsec is EVALSHA's usec_per_call in srv's INFO commandstats.
func evalUsec(b *testing.B, srv *redistest.Server) float64 {
	for _, line := range strings.Split(fmt.Sprint(srv.Do("INFO", "commandstats")), "\r\n") {
		if rest, ok := strings.CutPrefix(line, "cmdstat_evalsha:"); ok {
			_, v, _ := strings.Cut(rest, "usec_per_call=")
			v, _, _ = strings.Cut(v, ",")
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				b.Fatal(err)
			}
			return f
		}
	}
	b.Fatal("no evalsha in INFO commandstats")
	return 0
}
