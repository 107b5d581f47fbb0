package limiter

import (
	"context"
	"time"
)

// LeaseAsks is how many grants this Limiter has asked Redis for and not yet had an answer to
// (a grant request's, or a successor's: renew), for tests that read a lease table's figures
// only once its background asks are over.
func (l *Limiter) LeaseAsks() int {
	t := l.leases
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.asking)
}

// Decide's stages one by one, for the tests of one of them: Leased (the grants in hand), Denied
// (the deny cache) and Allow (Redis).

func (l *Limiter) Leased(reqs []Request) (Decision, bool) { return l.leased(reqs, true) }

func (l *Limiter) Denied(reqs []Request) (Decision, bool) { return l.denied(reqs) }

func (l *Limiter) Allow(ctx context.Context, reqs []Request) (Decision, error) {
	return l.allow(ctx, reqs)
}

// Names the handler does not use, for the tests that check them.

const MaxClientKeyBytes = maxClientKeyBytes

func ResetChannel(prefix string) string { return resetChannel(prefix) }

func (z *Zone) WindowAt(t time.Time) (start, end time.Time) { return z.windowAt(t) }

// WaiterID is w's id in its queue, as queue.lua publishes it when it grants w.
func WaiterID(w *Waiter) string { return w.id }

// EveryAlgorithm returns every algorithm of the table, in its order.
func EveryAlgorithm() []Algorithm {
	out := make([]Algorithm, 0, len(algorithms)-1)
	for a := 1; a < len(algorithms); a++ {
		out = append(out, Algorithm(a))
	}
	return out
}
