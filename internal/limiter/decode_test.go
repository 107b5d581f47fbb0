package limiter

import (
	"errors"
	"testing"
	"time"
)

// TestDecodeReplyRejectsWrongShapes feeds the decoder replies a broken or hostile Redis could
// send: each must be an error wrapping ErrBadResponse, never a panic or a decision.
func TestDecodeReplyRejectsWrongShapes(t *testing.T) {
	for name, reply := range map[string]any{
		"nil":                nil,
		"string":             "OK",
		"integer":            int64(1),
		"empty array":        []any{},
		"too short":          []any{int64(1), int64(1), int64(0), int64(0), int64(0)},
		"too long":           []any{int64(1), int64(1), int64(0), int64(0), int64(0), int64(0), int64(0)},
		"string in array":    []any{int64(1), "1", int64(0), int64(0), int64(0), int64(0)},
		"nested array":       []any{int64(1), []any{}, int64(0), int64(0), int64(0), int64(0)},
		"nil in array":       []any{int64(1), nil, int64(0), int64(0), int64(0), int64(0)},
		"allowed 2":          []any{int64(2), int64(1), int64(0), int64(0), int64(0), int64(0)},
		"zone allowed 7":     []any{int64(1), int64(7), int64(0), int64(0), int64(0), int64(0)},
		"negative remaining": []any{int64(1), int64(1), int64(-1), int64(0), int64(0), int64(0)},
		"negative reset":     []any{int64(1), int64(1), int64(0), int64(0), int64(-5), int64(0)},
		"negative next":      []any{int64(1), int64(1), int64(0), int64(0), int64(0), int64(-1)},
	} {
		reqs := []Request{{Zone: &Zone{Name: "z", Algorithm: TokenBucket, Capacity: 1, RefillRate: 1}, Cost: 1}}
		d, err := decodeAndPick(reqs, reply)
		if !errors.Is(err, ErrBadResponse) || d != (Decision{}) {
			t.Errorf("%s: got %+v, %v; want the zero Decision and ErrBadResponse", name, d, err)
		}
	}
}

func TestDecodeReplyGoodShape(t *testing.T) {
	reqs := []Request{{Zone: &Zone{Name: "z", Algorithm: SlidingWindow, Limit: 10, Window: time.Second}, Cost: 1}}
	d, err := decodeAndPick(reqs, []any{int64(0), int64(0), int64(3), int64(250), int64(900), int64(100)})
	want := Decision{Limit: 10, Remaining: 3, RetryAfter: 250 * time.Microsecond, Reset: 900 * time.Microsecond, Next: 100 * time.Microsecond}
	if err != nil || d != want {
		t.Fatalf("got %+v, %v; want %+v", d, err, want)
	}
}

// TestDecodeReplyDelays: an admitted zone's retry after is its delay, taken as the Decision's
// (the longest, whose zone decides), but only up to how long the zone may hold the request: a
// delay without max_wait, with NoWait, or beyond max_wait is a bad response, so that no reply
// can hold a request past its max_wait.
func TestDecodeReplyDelays(t *testing.T) {
	shaping := &Zone{Name: "s", Algorithm: TokenBucket, Capacity: 10, RefillRate: 10, MaxWait: time.Second}
	plain := &Zone{Name: "p", Algorithm: TokenBucket, Capacity: 10, RefillRate: 10}
	for _, tc := range []struct {
		name  string
		reqs  []Request
		reply []any
		want  Decision // the zero Decision: ErrBadResponse
	}{
		{"a delay of max_wait", []Request{{Zone: plain, Cost: 1}, {Zone: shaping, Cost: 1}},
			[]any{int64(1), int64(1), int64(5), int64(0), int64(500000), int64(100000), int64(1), int64(0), int64(1000000), int64(2000000), int64(1100000)},
			Decision{Allowed: true, Delay: time.Second, Zone: 1, Limit: 10, Reset: 2 * time.Second, Next: 1100 * time.Millisecond}},
		{"a delay beyond max_wait", []Request{{Zone: shaping, Cost: 1}},
			[]any{int64(1), int64(1), int64(0), int64(1000001), int64(2000000), int64(1100000)}, Decision{}},
		{"a delay without max_wait", []Request{{Zone: plain, Cost: 1}},
			[]any{int64(1), int64(1), int64(0), int64(1), int64(2000000), int64(1100000)}, Decision{}},
		{"a delay with NoWait", []Request{{Zone: shaping, Cost: 1, NoWait: true}},
			[]any{int64(1), int64(1), int64(0), int64(1), int64(2000000), int64(1100000)}, Decision{}},
		{"a denial's retry after is no delay", []Request{{Zone: plain, Cost: 1}},
			[]any{int64(0), int64(0), int64(0), int64(100000), int64(1000000), int64(100000)},
			Decision{Limit: 10, RetryAfter: 100 * time.Millisecond, Reset: time.Second, Next: 100 * time.Millisecond}},
	} {
		d, err := decodeAndPick(tc.reqs, tc.reply)
		if tc.want == (Decision{}) {
			if !errors.Is(err, ErrBadResponse) || d != (Decision{}) {
				t.Errorf("%s: got %+v, %v; want ErrBadResponse", tc.name, d, err)
			}
		} else if err != nil || d != tc.want {
			t.Errorf("%s: got %+v, %v; want %+v", tc.name, d, err, tc.want)
		}
	}
}

func decodeAndPick(reqs []Request, reply any) (Decision, error) {
	allowed, zones, err := decodeResult(reply, nil, reqs)
	if err != nil {
		return Decision{}, err
	}
	return pick(reqs, allowed, zones), nil
}
