package limiter

import (
	"testing"
	"time"
)

// TestPreparedZoneArgs checks that a prepared zone's boxed numbers are its script arguments, and
// that a copy whose numbers changed after Prepare (a zone with placeholder numbers, per request)
// sends its own numbers, not the boxed ones.
func TestPreparedZoneArgs(t *testing.T) {
	l := &Limiter{}
	bucket := &Zone{Name: "b", Algorithm: TokenBucket, Capacity: 1000, RefillRate: 2.5}
	window := &Zone{Name: "w", Algorithm: SlidingWindowCounter, Limit: 300, Window: time.Minute}
	bucket.Prepare()
	window.Prepare()
	changedBucket, changedWindow := *bucket, *window
	changedBucket.Capacity, changedBucket.RefillRate = 7000, 0.5
	changedWindow.Limit, changedWindow.Window = 900, time.Hour
	args := l.scriptArgs([]Request{
		{Zone: bucket, Cost: 1}, {Zone: window, Cost: 1},
		{Zone: &changedBucket, Cost: 1}, {Zone: &changedWindow, Cost: 1},
	}, false, time.Now())
	want := []any{
		"tb", int64(1000), 2.5, int64(1), "",
		"sc", int64(300), int64(60_000_000), int64(1), "",
		"tb", int64(7000), 0.5, int64(1), "",
		"sc", int64(900), int64(3_600_000_000), int64(1), "",
	}
	got := args[4:]
	if len(got) != len(want) {
		t.Fatalf("got %d zone arguments %v, want %d", len(got), got, len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("argument %d: got %v (%T), want %v (%T)", i, got[i], got[i], want[i], want[i])
		}
	}
	if n := testing.AllocsPerRun(100, func() { bucket.bucketArgs() }); n != 0 {
		t.Errorf("a prepared zone's bucket arguments allocate %v times, want 0", n)
	}
}
