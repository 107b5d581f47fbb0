package limiter

import (
	"fmt"
	"reflect"
	"testing"
	"time"
)

// settleDecision is a decision of a zone of every algorithm, each held until after the
// response (a token bucket twice, the second shaping with a max_wait), of client "c"; with
// overrides, each zone has Overrides.
func settleDecision(overrides bool) []Request {
	zones := []*Zone{
		{Name: "tb", Algorithm: TokenBucket, Capacity: 10, RefillRate: 2},
		{Name: "tw", Algorithm: TokenBucket, Capacity: 10, RefillRate: 2, MaxWait: 2 * time.Second},
		{Name: "fw", Algorithm: FixedWindow, Limit: 100, Window: time.Minute},
		{Name: "sc", Algorithm: SlidingWindowCounter, Limit: 50, Window: time.Minute},
		{Name: "sw", Algorithm: SlidingWindow, Limit: 5, Window: time.Second},
		{Name: "cc", Algorithm: Concurrency, Limit: 3},
	}
	reqs := make([]Request, len(zones))
	for i, z := range zones {
		z.Overrides = overrides
		reqs[i] = Request{Zone: z, Key: "c", Cost: 2, Hold: 30 * time.Second}
	}
	reqs[5].Cost = 1 // a slot
	return reqs
}

// settleCall returns the KEYS and ARGV of the settle.lua call that settles reqs, admitted with
// the zone replies zones, with an amount of 35 each, right after the decision.
func settleCall(t *testing.T, reqs []Request, zones []zoneReply) ([]string, []string) {
	t.Helper()
	at := time.UnixMicro(1_700_000_000_000_000)
	l := &Limiter{prefix: "rl:", instance: "i", now: func() time.Time { return at }}
	keys, args := l.encodeDecision(reqs, stateKeys(l.prefix, reqs), false, at)
	h := newHeld(reqs, keys, args, nil, zones)
	if h == nil || len(h.parts) != 1 {
		t.Fatalf("held %+v, want one part", h)
	}
	p := h.parts[0]
	amounts := []int64{35, 35, 35, 35, 35, 35}
	var got []string
	for _, a := range p.amountArgs(at.UnixMicro(), amounts, 0, "") {
		got = append(got, fmt.Sprintf("%T %v", a, a))
	}
	return p.keys, got
}

// TestSettleLayout pins settle.lua's call for a charge settled after the response: its KEYS and
// ARGV. A zone without overrides sends its own numbers, as decide.lua got them; a zone with
// overrides, the numbers in force that decided it (its reply's): the token bucket's capacity
// and refill rate (the zone's own rate when the policy window says the override kept it), a
// window's limit and window (a fixed window's as one number of µs), and its charge is bounded
// by the max cost in force.
func TestSettleLayout(t *testing.T) {
	wantKeys := []string{
		"rl:{c}:tb:tb", "rl:{c}:tw:tb", "rl:{c}:fw:fw", "rl:{c}:sc:sc", "rl:{c}:sw:sw", "rl:{c}:cc:cc",
		"rl:{c}:fw:fw:i.1", "rl:{c}:fw:fw:gen", "rl:{c}:sc:sc:i.1", "rl:{c}:sc:sc:gen",
	}
	head := []string{"int64 1700000000000000", "string i.1", "string amount"}
	allowed := make([]zoneReply, 6)
	for i := range allowed {
		allowed[i].allowed = true
	}
	keys, args := settleCall(t, settleDecision(false), allowed)
	want := append(append([]string{}, head...),
		"string tb", "int64 10", "float64 2", "int64 2",
		"string tb", "int64 10", "string 2,2000000", "int64 2",
		"string fw", "int64 100", "string 1699999920000000,1699999980000000,1700000040000000,1700000100000000", "int64 2",
		"string sc", "int64 50", "int64 60000000", "int64 2",
		"string sw", "int64 5", "int64 1000000", "int64 2",
		"string cc", "int64 3", "string 0", "int64 1",
		"int64 10", "int64 10", "int64 35", "int64 35", "int64 5", "int64 1", // amounts, each at most its zone's max cost
	)
	if !reflect.DeepEqual(keys, wantKeys) || !reflect.DeepEqual(args, want) {
		t.Errorf("without overrides:\nKEYS %q\nwant %q\nARGV %q\nwant %q", keys, wantKeys, args, want)
	}

	ov := []overrideReply{
		{quota: 40, windowUs: 10_000_000, maxCost: 40}, // capacity 40, refill 4/s
		{quota: 40, windowUs: 20_000_000, maxCost: 30}, // capacity 40, the zone's refill of 2/s
		{quota: 500, windowUs: 5_400_000_000, maxCost: 500},
		{maxCost: 50}, // no override in force: the zone's own numbers
		{quota: 9, windowUs: 2_000_000, maxCost: 9},
		{quota: 5, maxCost: 5},
	}
	for i := range allowed {
		allowed[i].ov = ov[i]
	}
	keys, args = settleCall(t, settleDecision(true), allowed)
	want = append(append([]string{}, head...),
		"string tb", "int64 40", "string 4", "int64 2",
		"string tb", "int64 40", "string 2,2000000", "int64 2",
		"string fw", "int64 500", "int64 5400000000", "int64 2",
		"string sc", "int64 50", "int64 60000000", "int64 2",
		"string sw", "int64 9", "int64 2000000", "int64 2",
		"string cc", "int64 5", "string 0", "int64 1",
		"int64 35", "int64 30", "int64 35", "int64 35", "int64 9", "int64 1", // at most the max cost in force
	)
	if !reflect.DeepEqual(keys, wantKeys) || !reflect.DeepEqual(args, want) {
		t.Errorf("with overrides:\nKEYS %q\nwant %q\nARGV %q\nwant %q", keys, wantKeys, args, want)
	}
}
