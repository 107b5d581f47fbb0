package ratelimitredis

import (
	"testing"
	"time"
)

// TestPolicyWindow: the quota and window of the RateLimit-Policy field, the IETF draft's q and w
// (seconds), for windows and refill rates of every size.
func TestPolicyWindow(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		quota  int64
		window time.Duration
		q, w   int64
	}{
		{3, 6 * time.Second, 3, 6},
		{10, time.Hour, 10, 3600},
		{10, 1500 * time.Millisecond, 10, 2},                           // rounded up: never more than the rate
		{100, time.Minute - time.Nanosecond, 100, 60},                  // 100/1m as a float refill rate
		{10, 100 * time.Millisecond, 100, 1},                           // the rate per second
		{3, 700 * time.Millisecond, 4, 1},                              // rounded down
		{1, time.Millisecond, 1000, 1},                                 //
		{1_000_000, time.Millisecond, 1_000_000_000, 1},                //
		{1 << 53, time.Second, sfMaxInteger, 1},                        // an Integer has 15 digits
		{1 << 53, time.Millisecond, sfMaxInteger, 1},                   //
		{1, 0, sfMaxInteger, 1},                                        // a refill so fast the window is 0
		{999_999_999_999_999, 999 * time.Millisecond, sfMaxInteger, 1}, //
	} {
		if q, w := policyWindow(tc.quota, tc.window); q != tc.q || w != tc.w {
			t.Errorf("policyWindow(%d, %v) = q=%d;w=%d, want q=%d;w=%d", tc.quota, tc.window, q, w, tc.q, tc.w)
		}
	}
}
