package limiter

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// goldenDecision is a decision with a zone of every option: a token bucket with overrides, a
// block, a bound (UpTo) and a near limit, a fixed window asking for a lease's grant (its charge
// recorded), a sliding window counter held until after the response (recorded) with a near limit,
// a shadow sliding window log and a concurrency zone, all of client "c".
func goldenDecision() []Request {
	api := &Zone{Name: "api", Algorithm: TokenBucket, Capacity: 10, RefillRate: 2, Overrides: true, Block: 10 * time.Second, BlockMax: time.Minute, UpTo: true, NearLimit: 0.6}
	fw := &Zone{Name: "fw", Algorithm: FixedWindow, Limit: 100, Window: time.Minute, Lease: &Lease{Max: 20, TTL: time.Second}}
	sc := &Zone{Name: "sc", Algorithm: SlidingWindowCounter, Limit: 50, Window: time.Minute, NearLimit: 0.04}
	sh := &Zone{Name: "sh", Algorithm: SlidingWindow, Limit: 5, Window: time.Second, Shadow: true}
	cc := &Zone{Name: "cc", Algorithm: Concurrency, Limit: 3, MaxWait: time.Second}
	cq := &Zone{Name: "cq", Algorithm: Concurrency, Limit: 3, MaxWait: time.Second, Classes: []int{0, 200}}
	return []Request{
		{Zone: api, Key: "c", Cost: 1, ask: 8}, // more than half its 12: granted all 8
		{Zone: fw, Key: "c", Cost: 1, ask: 20},
		{Zone: sc, Key: "c", Cost: 2, Hold: 30 * time.Second},
		{Zone: sh, Key: "c", Cost: 1},
		{Zone: cc, Key: "c", Cost: 1, Hold: time.Minute, claim: "ab.o1.2"}, // a waiter's claim: its id is no flag
		{Zone: cq, Key: "c", Cost: 1, Hold: time.Minute, Class: 1},
	}
}

// TestCallLayout pins decide.lua's whole call layout for goldenDecision: its KEYS, its ARGV and
// the decoding of a reply, every zone's part where its options put it.
func TestCallLayout(t *testing.T) {
	at := time.UnixMicro(1_700_000_000_000_000)
	l := &Limiter{prefix: "rl:", instance: "i", now: func() time.Time { return at }}
	reqs := goldenDecision()
	keys, args := l.encodeDecision(reqs, stateKeys(l.prefix, reqs), false, at)
	wantKeys := []string{
		"rl:{c}:api:tb", "rl:{c}:fw:fw", "rl:{c}:sc:sc", "rl:{c}:sh:sw", "rl:{c}:cc:cc", "rl:{c}:cq:cc", // state keys
		"rl:{c}:fw:fw:i.1", "rl:{c}:fw:fw:gen", // fw's record and generation keys (its grant)
		"rl:{c}:sc:sc:i.1", "rl:{c}:sc:sc:gen", // sc's (its Hold)
		"rl:{c}:api:ov", "rl:{c}:api:block", // api's override key (key 11) and block key (key 12)
		"rl:{c}:cq:cc:ql", // cq's queue's waiters (key 13); cc claims, and reads none
	}
	if !reflect.DeepEqual(keys, wantKeys) {
		t.Errorf("KEYS\n got %q\nwant %q", keys, wantKeys)
	}
	wantArgs := []string{
		"int64 1700000000000000", // now (the Limiter's clock)
		"string i.1",             // nonce
		"string 0,2000000,30000000,0,60000000,60000000", // hold per zone (µs): fw's grant, sc's, cc's and cq's Hold
		"int 6", // zones
		"string tb", "int64 10", "float64 2", "string 1,8", "string uo11:0b10000000,60000000:12n600000",
		"string fw", "int64 100", "string 1699999920000000,1699999980000000,1700000040000000,1700000100000000", "string 1,20", "string ",
		"string sc", "int64 50", "int64 60000000", "int64 2", "string n40000", // a near limit names no key
		"string sw", "int64 5", "int64 1000000", "int64 1", "string s",
		"string cc", "int64 3", "string 0", "int64 1", "string |ab.o1.2",
		"string cc", "int64 3", "string 0", "int64 1", "string q13",
	}
	gotArgs := make([]string, len(args))
	for i, a := range args {
		gotArgs[i] = fmt.Sprintf("%T %v", a, a)
	}
	if !reflect.DeepEqual(gotArgs, wantArgs) {
		t.Errorf("ARGV\n got %q\nwant %q", gotArgs, wantArgs)
	}

	// The reply: api's grant, block integer, override integers and near integer after its five,
	// fw's grant after its five, sc's near integer after its five; the shadow zone's denial does
	// not deny the decision.
	reply := []any{int64(1),
		int64(1), int64(8), int64(0), int64(1_000_000), int64(500_000), int64(8), int64(0), int64(12), int64(6_000_000), int64(12), int64(1), // api
		int64(1), int64(79), int64(0), int64(40_000_000), int64(40_000_000), int64(20), // fw
		int64(1), int64(48), int64(0), int64(60_000_000), int64(1_000_000), int64(1), // sc
		int64(0), int64(0), int64(300_000), int64(1_000_000), int64(300_000), // sh
		int64(1), int64(2), int64(0), int64(0), int64(1), // cc
		int64(1), int64(2), int64(0), int64(0), int64(1), // cq
	}
	c := &call{keys: keys, args: args}
	if c.replyLen() != len(reply) {
		t.Errorf("replyLen %d, want %d", c.replyLen(), len(reply))
	}
	ok, zones, err := decodeReply(reply, reqs, nil)
	want := []zoneReply{
		{allowed: true, near: true, remaining: 8, reset: 1_000_000, next: 500_000, granted: 8, ov: overrideReply{quota: 12, windowUs: 6_000_000, maxCost: 12}},
		{allowed: true, remaining: 79, reset: 40_000_000, next: 40_000_000, granted: 20},
		{allowed: true, near: true, remaining: 48, reset: 60_000_000, next: 1_000_000},
		{remaining: 0, retryAfter: 300_000, reset: 1_000_000, next: 300_000},
		{allowed: true, remaining: 2, next: 1},
		{allowed: true, remaining: 2, next: 1},
	}
	if err != nil || !ok || !reflect.DeepEqual(zones, want) {
		t.Fatalf("decoded %v %+v (%v)\nwant true %+v", ok, zones, err, want)
	}

	// api's block integer: 2, its block started (the zone denied).
	reply[0], reply[1], reply[6], reply[7] = int64(0), int64(0), int64(0), int64(replyBlockStarted)
	if _, zones, err := decodeReply(reply, reqs, nil); err != nil || zones[0].allowed || zones[0].block != replyBlockStarted {
		t.Fatalf("block started: %+v (%v), want api denied with its block started", zones, err)
	}
	// A block integer out of range, a first integer of 2, grants above what was asked and a near
	// integer of 2 are not Redis's answer.
	for _, bad := range []struct{ i, v int }{{7, 3}, {1, 2}, {6, 9}, {17, 21}, {11, 2}, {23, 2}} {
		r := append([]any(nil), reply...)
		r[bad.i] = int64(bad.v)
		if _, _, err := decodeReply(r, reqs, nil); !errors.Is(err, ErrBadResponse) {
			t.Errorf("value %d at %d: %v, want ErrBadResponse", bad.v, bad.i, err)
		}
	}
}

// TestCallLayoutRuns: decide.lua reads goldenDecision as encodeDecision lays it out: the call
// admits, its reply decodes for those zones, api reports the client's override (capacity 12) and its grant of 8,
// fw its grant of 20 and sh its own denial past its limit of 5, which denies nothing; api's grant
// of 8 of 12 and sc's cost of 2 of 50 each cross their near limit (8 and 2 units used).
func TestCallLayoutRuns(t *testing.T) {
	srv := redistest.Start(t)
	at := time.UnixMicro(1_700_000_000_000_000)
	l := New(srv.Client(), Options{KeyPrefix: "rl:", Now: func() time.Time { return at }})
	reqs := goldenDecision()
	if err := l.SetOverride(context.Background(), reqs[0].Zone, "c", Override{Capacity: 12}, 0); err != nil {
		t.Fatal(err)
	}
	reqs[3].Cost = 6
	keys, args := l.encodeDecision(reqs, stateKeys(l.prefix, reqs), false, at)
	reply, err := l.run(context.Background(), keys, args)
	ok, zones, err := decodeResult(reply, err, reqs)
	if err != nil || !ok {
		t.Fatalf("%v %+v (%v), want admitted", ok, zones, err)
	}
	if zones[0].ov.quota != 12 || zones[0].granted != 8 || zones[0].remaining != 4 || zones[0].block != 0 {
		t.Errorf("api: %+v, want the override's capacity 12, 8 granted (all it asked, though above half), 4 left, no block", zones[0])
	}
	if !zones[0].near || !zones[2].near {
		t.Errorf("api %+v, sc %+v: want each to report its near limit crossed", zones[0], zones[2])
	}
	if zones[1].granted != 20 || zones[3].allowed || zones[2].remaining != 48 || zones[4].remaining != 2 {
		t.Errorf("zones %+v, want fw granted 20, sc 48 left, sh denied, cc 2 slots left", zones)
	}
}

// TestUnknownAlgorithmIsAnError: decide.lua refuses a zone whose algorithm tag it does not know
// with an error naming it, and writes nothing, instead of deciding it by another algorithm.
func TestUnknownAlgorithmIsAnError(t *testing.T) {
	srv := redistest.Start(t)
	l := New(srv.Client(), Options{KeyPrefix: "rl:"})
	_, err := l.run(context.Background(), []string{"rl:{c}:x:zz"}, []any{"", "", "0", 1, "zz", 5, 1_000_000, 1, ""})
	if err == nil || !strings.Contains(err.Error(), "unknown algorithm zz") {
		t.Fatalf("an unknown tag: %v, want an error naming it", err)
	}
	if n := srv.Do("DBSIZE"); n != int64(0) {
		t.Fatalf("%v keys written, want none", n)
	}
}
