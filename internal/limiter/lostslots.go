package limiter

import (
	"cmp"
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Lost slots: a concurrency slot whose fate this instance no longer knows, although it is alive.
// A decision that failed after it may have reached Redis (its reply lost to a timeout, a dropped
// connection, a client gone) may have taken a slot that no request holds: a Redis that stalled
// runs it when it resumes. A settlement that failed, or was not sent (a circuit breaker open),
// leaves its request's slot taken after the request has ended. Nobody refreshes such a slot, and
// it denies its client until its deadline, up to hold_max later.
//
// The slot's member is its decision's nonce, so `ZREM key nonce` gives back exactly that slot,
// and nothing when the decision never ran or the slot is gone. The Limiter keeps each such slot
// (lose) and Refresh sends its ZREM on every tick, until one finds and removes it, or two in a
// row, on two ticks, find it absent: the decision never ran (or the slot was given back), as a
// Redis that answers on the first tick has run what was already written to it by the second. A
// slot is given up once its hold time has passed since it was lost (it has freed itself by
// then, but for a decision Redis ran later still), and beyond maxLostSlots none is kept: the
// slot frees itself at its deadline.

// maxLostSlots bounds the lost slots a Limiter keeps: beyond it, a lost slot frees itself at its
// deadline. 10,000 slots are about 1 MB.
const maxLostSlots = 10000

// lostSlot is one slot whose decision or settlement failed: its state key and member.
type lostSlot struct {
	key, nonce string
	until      time.Time // by the Limiter's clock: its hold time after it was lost
	absent     int       // ZREMs in a row, on ticks in a row, that found it absent
}

// lostSlots are a Limiter's lost slots, in the order they were lost.
type lostSlots struct {
	mu sync.Mutex
	s  []lostSlot
}

// lose keeps, to be given back, the slot of each concurrency zone of reqs decided by a decide.lua
// call with keys and args (whose nonce is args[1]) that failed after it may have reached Redis.
func (l *Limiter) lose(reqs []Request, keys []string, args []any) {
	for j, r := range reqs {
		if r.Zone.Algorithm.HoldsSlots() {
			l.loseSlot(keys[j], args[1].(string), r.Hold)
		}
	}
}

// loseHeld keeps, to be given back, the slots of the concurrency zones of parts (a Held's): their
// settlement failed, or will not be sent.
func (l *Limiter) loseHeld(parts []heldPart) {
	for _, p := range parts {
		p.slotHolds(l.loseSlot)
	}
}

// loseSlot keeps the slot nonce of state key key, held for hold, to be given back.
func (l *Limiter) loseSlot(key, nonce string, hold time.Duration) {
	until := l.clock().Add(hold)
	l.lost.mu.Lock()
	if len(l.lost.s) < maxLostSlots {
		l.lost.s = append(l.lost.s, lostSlot{key: key, nonce: nonce, until: until})
	}
	l.lost.mu.Unlock()
}

// LostSlots returns the number of lost slots this Limiter is still giving back: concurrency slots
// of decisions or settlements that failed (see Refresh).
func (l *Limiter) LostSlots() int {
	l.lost.mu.Lock()
	defer l.lost.mu.Unlock()
	return len(l.lost.s)
}

// giveBackLost sends one ZREM per lost slot, all in one pipeline (one round trip; one per node on
// Redis Cluster), and forgets the slots it removed, those found absent on this tick and the
// previous one, and those past their hold time. It returns the number of slots removed, and the
// first error with the number of ZREMs that failed. A panic while reading the replies (a Redis
// answering garbage) fails them all, as a script call's does.
func (l *Limiter) giveBackLost(ctx context.Context) (removed int, err error) {
	now := l.clock()
	l.lost.mu.Lock()
	lost := make([]lostSlot, 0, len(l.lost.s))
	for _, s := range l.lost.s {
		if now.Before(s.until) {
			lost = append(lost, s)
		}
	}
	l.lost.s = l.lost.s[:0]
	l.lost.mu.Unlock()
	if len(lost) == 0 {
		return 0, nil
	}
	cmds := make([]*redis.IntCmd, len(lost))
	execErr := func() (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("%w: reading the reply panicked: %v", ErrBadResponse, r)
			}
		}()
		pipe := l.rdb.Pipeline()
		for i, s := range lost {
			cmds[i] = pipe.ZRem(ctx, s.key, s.nonce)
		}
		_, err = pipe.Exec(ctx)
		return err
	}()
	keep, failed := lost[:0], 0
	for i, s := range lost {
		n, cerr := cmds[i].Result()
		switch {
		case n > 0 && cerr == nil:
			removed++
		case cerr != nil || execErr != nil:
			// Not an answer that it is absent (a command Exec left unset reads as 0): Redis
			// failing resets "in a row".
			if err == nil {
				err = cmp.Or(cerr, execErr)
			}
			failed++
			s.absent = 0
			keep = append(keep, s)
		case s.absent == 0:
			s.absent = 1
			keep = append(keep, s)
		}
	}
	l.lost.mu.Lock()
	// Slots lost meanwhile were appended: those kept go first, in their order.
	l.lost.s = append(keep, l.lost.s...)
	if len(l.lost.s) > maxLostSlots {
		l.lost.s = l.lost.s[:maxLostSlots]
	}
	l.lost.mu.Unlock()
	if err != nil {
		err = fmt.Errorf("redis give back of %d lost concurrency slots: %w", failed, err)
	}
	return removed, err
}
