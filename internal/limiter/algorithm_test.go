package limiter

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// describedZone returns a valid zone of algorithm a, quota 10.
func describedZone(a Algorithm) *Zone {
	z := &Zone{Name: "z", Algorithm: a}
	d := a.describe()
	switch {
	case d.capacity:
		z.Capacity, z.RefillRate = 10, 1
	case d.window:
		z.Limit, z.Window = 10, time.Minute
	default:
		z.Limit = 10
	}
	if d.adapts {
		a := Adaptive{}.WithDefaults(z.Limit)
		z.Adaptive = &a
	}
	return z
}

// TestEveryAlgorithmDescribed: every algorithm of the table has a name ParseAlgorithm reads, a
// tag of its own, one quota (capacity or limit), a state reader that reads a client's state in
// a real Redis, and script arguments that name it; an algorithm missing from the table is sent to
// decide.lua under a tag it refuses, never as another algorithm.
func TestEveryAlgorithmDescribed(t *testing.T) {
	srv := redistest.Start(t)
	l := New(srv.Client(), Options{KeyPrefix: "rl:"})
	tags := map[string]bool{}
	for i := 1; i < len(algorithms); i++ {
		a := Algorithm(i)
		d := a.describe()
		if p, err := ParseAlgorithm(d.name); err != nil || p != a {
			t.Errorf("algorithm %d: ParseAlgorithm(%q) = %v, %v", i, d.name, p, err)
		}
		if d.tag == "" || tags[d.tag] {
			t.Errorf("algorithm %s: tag %q is empty or another's", a, d.tag)
		}
		tags[d.tag] = true
		if d.state == nil || d.args == nil {
			t.Errorf("algorithm %s has no state reader or no call arguments", a)
			continue
		}
		z := describedZone(a)
		if err := z.Validate(); err != nil {
			t.Errorf("algorithm %s: %v", a, err)
			continue
		}
		if z.Quota() != 10 {
			t.Errorf("algorithm %s: quota %d, want 10 (its capacity or limit)", a, z.Quota())
		}
		if _, err := l.State(context.Background(), z, "c"); err != nil {
			t.Errorf("algorithm %s: State: %v", a, err)
		}
		args := l.scriptArgs([]Request{{Zone: z, Key: "c", Cost: 1, Hold: time.Minute}}, false, time.Now())
		if args[4] != d.tag {
			t.Errorf("algorithm %s: script arguments name %v, want %q", a, args[4], d.tag)
		}
	}
	unknown := &Zone{Name: "z", Algorithm: Algorithm(len(algorithms)), Capacity: 10, RefillRate: 1}
	args := l.scriptArgs([]Request{{Zone: unknown, Key: "c", Cost: 1}}, false, time.Now())
	keys := stateKeys(l.prefix, []Request{{Zone: unknown, Key: "c", Cost: 1}})
	if _, err := l.run(context.Background(), keys, args); err == nil || !strings.Contains(err.Error(), "unknown algorithm") {
		t.Errorf("an algorithm missing from the table: %v, want decide.lua's unknown algorithm error", err)
	}
	if _, err := l.State(context.Background(), unknown, "c"); err == nil {
		t.Error("State of an algorithm missing from the table: no error")
	}
}
