package usage

import (
	"sync/atomic"
	"testing"
)

// TestDecodeLimit: decoding stops once the bytes decoded pass 8 MiB plus 100 times the bytes
// received, or 256 MiB whatever was received, saying which; under both it passes everything on.
func TestDecodeLimit(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name            string
		received, total int64 // bytes received when decoding; bytes decoded, in 1 MiB writes
		stopped         string
	}{
		{"8 MiB of anything", 0, 8 << 20, ""},
		{"past 8 MiB from nothing", 0, 9 << 20, StopRatio},
		{"100 times 1 MiB, plus 8 MiB", 1 << 20, 108 << 20, ""},
		{"past 100 times 1 MiB, plus 8 MiB", 1 << 20, 109 << 20, StopRatio},
		{"256 MiB from 10 MiB", 10 << 20, 256 << 20, ""},
		{"past 256 MiB from 10 MiB", 10 << 20, 257 << 20, StopSize},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var received atomic.Int64
			received.Store(tc.received)
			var passed countingWriter
			l := &decodeLimit{dst: &passed, received: &received}
			chunk := make([]byte, 1<<20)
			var err error
			for written := int64(0); written < tc.total && err == nil; written += int64(len(chunk)) {
				_, err = l.Write(chunk)
			}
			if l.stopped != tc.stopped {
				t.Fatalf("stopped %q (%v), want %q", l.stopped, err, tc.stopped)
			}
			if want := min(tc.total, l.decoded-int64(len(chunk))); tc.stopped != "" && passed.n != want {
				t.Fatalf("passed on %d bytes, want the %d before the bound", passed.n, want)
			}
			if tc.stopped == "" && passed.n != tc.total {
				t.Fatalf("passed on %d bytes of %d", passed.n, tc.total)
			}
		})
	}
}

// countingWriter counts the bytes written to it.
type countingWriter struct{ n int64 }

func (c *countingWriter) Write(p []byte) (int, error) {
	c.n += int64(len(p))
	return len(p), nil
}
