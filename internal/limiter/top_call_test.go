package limiter

import (
	"fmt"
	"reflect"
	"testing"
	"time"
)

// TestCallLayoutTop pins the part of decide.lua's call that a zone's top adds: its denied and
// used keys and their error keys after the zone's other flag keys, and its flag
// "t<key>:<entries>,<ttl ms>" after the others; a zone without a top in the same decision keeps its call unchanged.
func TestCallLayoutTop(t *testing.T) {
	at := time.UnixMicro(1_700_000_000_000_000) // bucket 28333333 of 60s
	l := &Limiter{prefix: "rl:", instance: "i", now: func() time.Time { return at }}
	api := &Zone{Name: "api", Algorithm: TokenBucket, Capacity: 10, RefillRate: 2, Block: 10 * time.Second, Top: 100, TopWindow: time.Minute}
	plain := &Zone{Name: "plain", Algorithm: TokenBucket, Capacity: 10, RefillRate: 2}
	reqs := []Request{{Zone: api, Key: "c", Cost: 1}, {Zone: plain, Key: "c", Cost: 1}}
	keys, args := l.encodeDecision(reqs, stateKeys(l.prefix, reqs), false, at)
	wantKeys := []string{
		"rl:{c}:api:tb", "rl:{c}:plain:tb",
		"rl:{c}:api:block",                                           // key 3
		"rl:{top}:api:top:d:28333333", "rl:{top}:api:top:u:28333333", // keys 4 and 5
		"rl:{top}:api:top:d:28333333:e", "rl:{top}:api:top:u:28333333:e", // keys 6 and 7
	}
	if !reflect.DeepEqual(keys, wantKeys) {
		t.Errorf("KEYS\n got %q\nwant %q", keys, wantKeys)
	}
	wantArgs := []string{
		"int64 1700000000000000", "string ", "string 0", "int 2",
		"string tb", "int64 10", "float64 2", "int64 1", "string b10000000,0:3t4:100,120000",
		"string tb", "int64 10", "float64 2", "int64 1", "string ",
	}
	gotArgs := make([]string, len(args))
	for i, a := range args {
		gotArgs[i] = fmt.Sprintf("%T %v", a, a)
	}
	if !reflect.DeepEqual(gotArgs, wantArgs) {
		t.Errorf("ARGV\n got %q\nwant %q", gotArgs, wantArgs)
	}
	if c := (&call{keys: keys, args: args}); c.replyLen() != 1+5+1+5 {
		t.Errorf("replyLen %d, want 12: a top adds nothing to the reply", c.replyLen())
	}

	// A zone without a top sends what it sent before tops existed: its state key, no flags.
	keys, args = l.encodeDecision(reqs[1:], stateKeys(l.prefix, reqs[1:]), false, at)
	if !reflect.DeepEqual(keys, []string{"rl:{c}:plain:tb"}) || args[4+4] != "" {
		t.Errorf("plain alone: KEYS %q, flags %q; want its state key alone and no flags", keys, args[4+4])
	}
}

// TestTopKeysShareTheClientSlot: on Redis Cluster a top key's hash tag is a tag of its client's
// slot, for every slot, so that one script call writes it with the client's state.
func TestTopKeysShareTheClientSlot(t *testing.T) {
	l := &Limiter{prefix: "rl:", cluster: true}
	z := &Zone{Name: "api", Algorithm: TokenBucket, Capacity: 10, RefillRate: 2, Top: 5, TopWindow: time.Minute}
	tags := slotTags()
	for s := range slots {
		if got := hashSlot(tags[s]); got != s {
			t.Fatalf("slot %d's tag %q hashes to slot %d", s, tags[s], got)
		}
	}
	for _, client := range []string{"alice", "2=203.0.113.7", "~x", "bob"} {
		state := StateKey(l.prefix, z, client)
		d, u, de, ue := l.topKeys(&Request{Zone: z, Key: client}, state, time.Unix(0, 0))
		for _, k := range []string{d, u, de, ue} {
			if hashSlot(k) != hashSlot(state) {
				t.Errorf("client %q: %s is not in %s's slot", client, k, state)
			}
		}
	}
}
