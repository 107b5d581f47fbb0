package limiter

import (
	"context"
	"time"
)

// withDeadline returns a copy of parent whose Deadline is d (or parent's, when earlier) and
// which starts no timer: its Done is parent's, and its Err is context.DeadlineExceeded once d has
// passed. It costs one small allocation where context.WithDeadline costs a timer and its
// channel per decision.
//
// Everything a Limiter does with it is bounded by d all the same: go-redis sets its socket
// deadlines from Deadline (ContextTimeoutEnabled), dials with it, and a Batcher's round trip
// carries the latest deadline of its batch, so a decision waits at most until its batch's
// round trip ends (for decisions sharing a round trip with the same timeout, at most the few
// microseconds between their sends past their own d). Code that waits on Done alone would not
// see d pass: it is for the limiter's calls, not a general context.
func withDeadline(parent context.Context, d time.Time) context.Context {
	if pd, ok := parent.Deadline(); ok && pd.Before(d) {
		return parent
	}
	return &deadlineCtx{Context: parent, d: d}
}

// deadlineCtx is withDeadline's context.
type deadlineCtx struct {
	context.Context
	d time.Time
}

func (c *deadlineCtx) Deadline() (time.Time, bool) { return c.d, true }

func (c *deadlineCtx) Err() error {
	if err := c.Context.Err(); err != nil {
		return err
	}
	if !time.Now().Before(c.d) {
		return context.DeadlineExceeded
	}
	return nil
}
