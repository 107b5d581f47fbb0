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

func decodeAndPick(reqs []Request, reply any) (Decision, error) {
	allowed, zones, err := decodeReply(reply, len(reqs))
	if err != nil {
		return Decision{}, err
	}
	return pick(reqs, allowed, zones), nil
}
