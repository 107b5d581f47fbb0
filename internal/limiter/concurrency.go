package limiter

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

// Concurrency zones: a slot per request in flight, taken by decide.lua at admission with a
// deadline of now + its hold time (Request.Hold: the zone's hold_max), given back by settle.lua
// (Limiter.Settle) once the response is complete, and kept alive while the request runs by
// refresh.lua (Limiter.Refresh).
// See decide.lua's "Concurrency" block.

var refreshScript = newScript(lua.Refresh)

// errNoHold is returned by Decide for a concurrency zone's Request without a Hold: its slot
// would have no deadline.
var errNoHold = errors.New("a concurrency zone's request needs a Hold: how long its slot is held without a refresh")

// RefreshEvery is how often a slot held for hold is given a new deadline while its request runs: a
// third of hold, so that two refreshes in a row may fail (or be late) before it expires.
func RefreshEvery(hold time.Duration) time.Duration { return hold / 3 }

// liveSlots are a Limiter's concurrency slots in flight, by the Held of their decision, each
// with the time (the Limiter's clock) its deadline was last set.
type liveSlots struct {
	mu sync.Mutex
	m  map[*Held]time.Time
}

// slotHolds yields, per concurrency zone of h, its state key, the nonce of its slot and how long
// the slot is held without a refresh; nothing when h holds no slot.
func (h *Held) slotHolds(yield func(key, nonce string, hold time.Duration)) {
	for _, p := range h.parts {
		p.slotHolds(yield)
	}
}

// slotHolds is Held.slotHolds for the zones of one decide.lua call.
func (p *heldPart) slotHolds(yield func(key, nonce string, hold time.Duration)) {
	for j := range p.idx {
		if algorithmOfTag(argTag(p.zones[4*j])).HoldsSlots() {
			yield(p.keys[j], p.nonce.(string), p.hold[j])
		}
	}
}

// hasSlots reports whether h holds a concurrency slot.
func (h *Held) hasSlots() bool {
	found := false
	h.slotHolds(func(string, string, time.Duration) { found = true })
	return found
}

// track adds the slots of h (a decision just admitted, at sent) to those Refresh keeps alive.
func (l *Limiter) track(h *Held, sent time.Time) {
	if h == nil || !h.hasSlots() {
		return
	}
	l.live.mu.Lock()
	if l.live.m == nil {
		l.live.m = make(map[*Held]time.Time)
	}
	l.live.m[h] = sent
	l.live.mu.Unlock()
}

// untrack removes the slots of h from those Refresh keeps alive: they are being given back.
func (l *Limiter) untrack(h *Held) {
	l.live.mu.Lock()
	delete(l.live.m, h)
	l.live.mu.Unlock()
}

// Drop stops keeping the concurrency slots of h alive, when its settlement will not be sent (a
// circuit breaker is open): they are lost slots, given back by Refresh once Redis answers.
func (l *Limiter) Drop(h *Held) {
	if h != nil {
		l.untrack(h)
		l.loseHeld(h.parts)
	}
}

// LiveSlots returns the number of decisions whose concurrency slots this Limiter keeps alive: the
// admitted requests of concurrency zones not settled yet.
func (l *Limiter) LiveSlots() int {
	l.live.mu.Lock()
	defer l.live.mu.Unlock()
	return len(l.live.m)
}

// Refresh gives the concurrency slots this Limiter holds whose deadline was set at least
// RefreshEvery(hold) ago a new deadline, now + hold, in one round trip (one per node on Redis
// Cluster). A slot that is gone (given back, expired, or reset by the admin API) is not taken
// again. Callers run it on a ticker shorter than a third of the shortest hold; a slot whose
// refreshes fail keeps the deadline it had, so it frees itself at most its hold time after its
// last refresh that succeeded. Then it gives back the lost slots: those that decisions and
// settlements which failed may have left taken with no request holding them (LostSlots), in a
// round trip of their own when there are any. It returns the number of slots moved on, and the
// Redis errors joined.
func (l *Limiter) Refresh(ctx context.Context) (int, error) {
	// One refresh.lua call per state key, all in one pipeline; then one ZREM per lost slot (see
	// lostslots.go).
	moved, err := l.refreshLive(ctx)
	_, lerr := l.giveBackLost(ctx)
	return moved, errors.Join(err, lerr)
}

// refreshLive is Refresh's refresh of the slots in flight.
func (l *Limiter) refreshLive(ctx context.Context) (int, error) {
	now := l.clock()
	type group struct {
		key  string
		hold time.Duration
	}
	members := map[group][]any{}
	var due []*Held
	l.live.mu.Lock()
	for h, last := range l.live.m {
		isDue := false
		h.slotHolds(func(key, nonce string, hold time.Duration) {
			if now.Sub(last) >= RefreshEvery(hold) {
				g := group{key, hold}
				members[g] = append(members[g], nonce)
				isDue = true
			}
		})
		if isDue {
			due = append(due, h)
		}
	}
	l.live.mu.Unlock()
	if len(members) == 0 {
		return 0, nil
	}
	var ref any = "" // the Redis server clock
	if l.now != nil {
		ref = now.UnixMicro()
	}
	calls := make([]*call, 0, len(members))
	for g, m := range members {
		args := append([]any{ref, max(g.hold.Microseconds(), 1)}, m...)
		calls = append(calls, &call{keys: []string{g.key}, args: args})
	}
	evalBatch(ctx, l.rdb, refreshScript, calls)
	moved, failed := 0, false
	var errs []error
	for _, c := range calls {
		n, ok := c.reply.(int64)
		switch {
		case c.err != nil:
			errs = append(errs, fmt.Errorf("redis refresh of %s: %w", c.keys[0], c.err))
			failed = true
		case !ok:
			errs = append(errs, fmt.Errorf("%w: refresh got %T, want an integer", ErrBadResponse, c.reply))
			failed = true
		default:
			moved += int(n)
		}
	}
	if !failed {
		l.live.mu.Lock()
		for _, h := range due {
			if _, ok := l.live.m[h]; ok {
				l.live.m[h] = now
			}
		}
		l.live.mu.Unlock()
	}
	return moved, errors.Join(errs...)
}
