package ratelimitredis

import (
	"context"
	"sync"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// waitingRoom bounds the requests a handler holds for a max_wait (shaping), and those being
// decided that may be: at most max at once, and at most share of them per client, so that one
// client cannot take every place and turn another's burst, which would have waited, into 429s.
// A client is a client key of a zone: a request takes a place only when, in each of its zones
// whose key has a placeholder, its client key has fewer than share places. A zone keyed on a
// literal (one key for every request, a limit of the whole site) tells no clients apart and
// does not count.
//
// A place is taken before the decision, which may admit the request at once: while a key's
// share is taken by requests still being decided, its next request waits for those decisions
// (one Redis call) instead of being refused, so a client's burst is decided share requests at
// a time and waits as it would with the room to itself. Safe for concurrent use.
type waitingRoom struct {
	max, share int

	mu      sync.Mutex
	n       int                       // places taken, under mu
	keys    map[waitingKey]*keyPlaces // per client key of a zone with a place; under mu
	decided chan struct{}             // closed (and replaced) when a place being decided is resolved; under mu
}

// waitingKey is a client key of a zone, as the limiter gets it (keyed with key_secret).
type waitingKey struct{ zone, key string }

// keyPlaces are the places of one client key: taken, and of those, being decided.
type keyPlaces struct{ taken, deciding int }

// waitingPlace is where a request stands in its handler's waitingRoom.
type waitingPlace uint8

const (
	placeNone     waitingPlace = iota // no place: decided without waiting
	placeDeciding                     // a place, the decision pending
	placeHeld                         // a place, held for its turn
)

// newWaitingRoom returns a room of max places, with a share of max/10 per client, at least 1.
func newWaitingRoom(max int) *waitingRoom {
	return &waitingRoom{max: max, share: waitingShare(max), keys: make(map[waitingKey]*keyPlaces), decided: make(chan struct{})}
}

// waitingShare is the most places one client key may have of max: a tenth rounded up, at
// least 1.
func waitingShare(max int) int {
	return (max + 9) / 10
}

// enter takes a place for a request of keys, as being decided, or reports false when every
// place is taken or one of keys has its share held. While a key's share is taken by requests
// still being decided, it waits for their decisions, or until ctx ends (false).
func (w *waitingRoom) enter(ctx context.Context, keys []waitingKey) bool {
	w.mu.Lock()
	for {
		if w.n >= w.max {
			w.mu.Unlock()
			return false
		}
		pending := false
		for _, k := range keys {
			if p := w.keys[k]; p != nil && p.taken >= w.share {
				if p.deciding == 0 {
					w.mu.Unlock()
					return false
				}
				pending = true
			}
		}
		if !pending {
			break
		}
		decided := w.decided
		w.mu.Unlock()
		select {
		case <-decided:
		case <-ctx.Done():
			return false
		}
		w.mu.Lock()
	}
	w.n++
	for _, k := range keys {
		p := w.keys[k]
		if p == nil {
			p = new(keyPlaces)
			w.keys[k] = p
		}
		p.taken++
		p.deciding++
	}
	w.mu.Unlock()
	return true
}

// leave gives back the place of a request of keys that is at *at, and sets *at to placeNone;
// a held request, or one decided not to be held. A place whose decision was pending wakes the
// requests waiting for it.
func (w *waitingRoom) leave(keys []waitingKey, at *waitingPlace) {
	if *at == placeNone {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.n--
	for _, k := range keys {
		p := w.keys[k]
		p.taken--
		if *at == placeDeciding {
			p.deciding--
		}
		if p.taken == 0 {
			delete(w.keys, k)
		}
	}
	if *at == placeDeciding {
		w.wake()
	}
	*at = placeNone
}

// hold marks the place of a request of keys being decided as held, and wakes the requests
// waiting for its decision.
func (w *waitingRoom) hold(keys []waitingKey, at *waitingPlace) {
	if *at != placeDeciding {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, k := range keys {
		w.keys[k].deciding--
	}
	*at = placeHeld
	w.wake()
}

// wake wakes the requests waiting for a decision; under mu.
func (w *waitingRoom) wake() {
	close(w.decided)
	w.decided = make(chan struct{})
}

// held returns the places taken now.
func (w *waitingRoom) held() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.n
}

// waitingKeys appends to buf the client keys of reqs that count for a waiting place: those of
// the zones whose key has a placeholder.
func (h *Handler) waitingKeys(buf []waitingKey, reqs []limiter.Request) []waitingKey {
	for _, rq := range reqs {
		if h.Zones[rq.Tag].perClient {
			buf = append(buf, waitingKey{rq.Zone.Name, rq.Key})
		}
	}
	return buf
}

// takeWaitingPlace takes one of the handler's MaxWaiting places for a request of reqs that may
// be held, before it is decided (see waitingRoom): placeNone when there is none for it. The
// place is given back (leaveWaiting) when the request is not held after all, or when its hold
// ends.
func (h *Handler) takeWaitingPlace(ctx context.Context, reqs []limiter.Request) waitingPlace {
	var buf [4]waitingKey
	if h.waiting.enter(ctx, h.waitingKeys(buf[:0], reqs)) {
		return placeDeciding
	}
	return placeNone
}

// holdWaiting marks the place of a request of reqs, decided to be held, as held.
func (h *Handler) holdWaiting(placed *waitingPlace, reqs []limiter.Request) {
	if *placed == placeDeciding {
		var buf [4]waitingKey
		h.waiting.hold(h.waitingKeys(buf[:0], reqs), placed)
	}
}

// leaveWaiting gives back the waiting place of a request of reqs that took one (*placed), once.
func (h *Handler) leaveWaiting(placed *waitingPlace, reqs []limiter.Request) {
	if *placed != placeNone {
		var buf [4]waitingKey
		h.waiting.leave(h.waitingKeys(buf[:0], reqs), placed)
	}
}
