package ratelimitredis

import (
	"container/list"
	"context"
	"net"
	"net/http"
	"sync"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/clientip"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// waitingRoom bounds the requests a handler holds for a max_wait (shaping), and those being
// decided that may be: at most max at once, and at most share of them per client, so that one
// client cannot take every place and turn another's burst, which would have waited, into 429s.
// A client is a client identity (waitingIdentity): a request takes a place only when each of
// its identities has fewer than share places.
//
// A place is taken before the decision, which may admit the request at once: while a key's
// share is taken by requests still being decided, its next request waits for those decisions
// (one Redis call) instead of being refused, so a client's burst is decided share requests at
// a time and waits as it would with the room to itself.
//
// When every place is taken, a request above its queue's lowest priority class takes the place
// of the newest waiter of a lowest class waiting in a queue (seat): that waiter is told to go
// (its evict channel closes) and is answered 429. Safe for concurrent use.
type waitingRoom struct {
	max, share int

	mu      sync.Mutex
	n       int                       // places taken, under mu
	keys    map[waitingKey]*keyPlaces // per client identity with a place; under mu
	decided chan struct{}             // closed (and replaced) when a place being decided is resolved; under mu
	queued  list.List                 // of *seat: the waiters in a queue, oldest first; under mu
}

// waitingKey is a client identity in a waiting room: a zone's tenant (fair_by), or a client key
// of a zone whose key has a placeholder, as the limiter gets it (keyed with key_secret), or,
// with zone "", the client address (waitingIdentity).
type waitingKey struct{ zone, key string }

// keyPlaces are the places of one client identity: taken, and of those, being decided.
type keyPlaces struct{ taken, deciding int }

// waitingPlace is where a request stands in its handler's waitingRoom.
type waitingPlace uint8

const (
	placeNone     waitingPlace = iota // no place: decided without waiting
	placeDeciding                     // a place, the decision pending
	placeHeld                         // a place, held for its turn
)

// seat is the place of a request waiting in a queue, as the room sees it: whether it is of its
// queue's lowest class (it may be evicted), and whether it was. Its fields are under the
// room's mu.
type seat struct {
	lowest   bool
	claiming bool          // its grant is being claimed: it is not evicted meanwhile
	evicted  bool          // its place was given to a higher class: it is answered 429
	evict    chan struct{} // closed when evicted
	at       *list.Element // in queued, nil once it left
}

// newWaitingRoom returns a room of max places, with a share of max/10 per client, at least 1.
func newWaitingRoom(max int) *waitingRoom {
	return &waitingRoom{max: max, share: waitingShare(max), keys: make(map[waitingKey]*keyPlaces), decided: make(chan struct{})}
}

// waitingShare is the most places one client identity may have of max: a tenth rounded up, at
// least 1.
func waitingShare(max int) int {
	return (max + 9) / 10
}

// enter takes a place for a request of keys, as being decided, or reports false when every
// place is taken or one of keys has its share held. A request that is not of its queue's
// lowest class (lowest false) that finds every place taken takes the place of the newest
// lowest-class waiter (evictNewest). While a key's share is taken by requests still being
// decided, it waits for their decisions, or until ctx ends (false).
func (w *waitingRoom) enter(ctx context.Context, keys []waitingKey, lowest bool) bool {
	w.mu.Lock()
	for {
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
			if w.n < w.max || !lowest && w.evictNewest() {
				break
			}
			w.mu.Unlock()
			return false
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

// evictNewest gives up the place of the newest lowest-class waiter in a queue that is not
// claiming a grant, and tells it to go; false when there is none. Under mu.
func (w *waitingRoom) evictNewest() bool {
	for e := w.queued.Back(); e != nil; e = e.Prev() {
		s := e.Value.(*seat)
		if !s.lowest || s.claiming {
			continue
		}
		w.queued.Remove(e)
		s.at, s.evicted = nil, true
		close(s.evict)
		w.n--
		return true
	}
	return false
}

// sit registers a held request as waiting in a queue, of its queue's lowest class or not.
func (w *waitingRoom) sit(lowest bool) *seat {
	s := &seat{lowest: lowest, evict: make(chan struct{})}
	w.mu.Lock()
	defer w.mu.Unlock()
	s.at = w.queued.PushBack(s)
	return s
}

// claiming marks s as claiming its grant (on) or waiting again (off); it reports false when s
// was evicted already, and must then go.
func (w *waitingRoom) claiming(s *seat, on bool) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	s.claiming = on
	return !s.evicted
}

// stand takes s out of the queue's waiters: it waits no more.
func (w *waitingRoom) stand(s *seat) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if s.at != nil {
		w.queued.Remove(s.at)
		s.at = nil
	}
}

// leave gives back the place of a request of keys that is at *at, and sets *at to placeNone;
// a held request, or one decided not to be held. The place of an evicted waiter (s) was given
// away already. A place whose decision was pending wakes the requests waiting for it.
func (w *waitingRoom) leave(keys []waitingKey, at *waitingPlace, s *seat) {
	if *at == placeNone {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if s == nil || !s.evicted {
		w.n--
	}
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

// waitingIdentity appends to buf the client identities of a request of reqs that count for its
// waiting place: the tenants of its zones with fair_by, and the client keys of its other zones
// whose key has a placeholder; when it has none (every zone keyed on a literal, such as one
// queue for a whole upstream), its client address, {client_ip} masked to its first zone's
// ipv4_prefix or ipv6_prefix.
func (h *Handler) waitingIdentity(buf []waitingKey, r *http.Request, reqs []limiter.Request) []waitingKey {
	for _, rq := range reqs {
		switch {
		case rq.Zone.FairTenants > 0:
			buf = append(buf, waitingKey{rq.Zone.Name, rq.Tenant})
		case h.Zones[rq.Tag].perClient:
			buf = append(buf, waitingKey{rq.Zone.Name, rq.Key})
		}
	}
	if len(buf) > 0 || len(reqs) == 0 {
		return buf
	}
	ip, _ := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string)
	if ip == "" { // not served by Caddy's HTTP server, which sets it
		ip, _, _ = net.SplitHostPort(r.RemoteAddr)
	}
	z := h.Zones[reqs[0].Tag]
	return append(buf, waitingKey{"", clientip.Mask(ip, z.v4, z.v6)})
}

// waitingLowest reports whether a request of reqs is of its queue's lowest class: the class of
// its first zone with priority classes is the last of them. A request of no such zone is.
func waitingLowest(reqs []limiter.Request) bool {
	for _, rq := range reqs {
		if n := len(rq.Zone.Classes); n > 0 && rq.Zone.Queues() {
			return rq.Class >= n-1
		}
	}
	return true
}

// placeForWait takes a waiting place for a request that may be held, before it is decided (see
// waitingRoom), so that no more than MaxWaiting are ever held; with none left for it (or its
// client's share of them taken) it is decided without waiting. The place is given back
// (leaveWaiting) when the request is not held after all, or when its hold ends.
func (h *Handler) placeForWait(r *http.Request, f *flight) {
	f.waitKeys = h.waitingIdentity(f.waitKeysBuf[:0], r, f.reqs)
	if h.waiting.enter(r.Context(), f.waitKeys, waitingLowest(f.reqs)) {
		f.placed = placeDeciding
	}
	f.noWait = f.placed == placeNone
	for i := range f.reqs {
		f.reqs[i].NoWait = f.noWait
	}
}

// holdWaiting marks f's place, decided to be held, as held.
func (h *Handler) holdWaiting(f *flight) {
	h.waiting.hold(f.waitKeys, &f.placed)
}

// leaveWaiting gives back f's waiting place, if it took one, once.
func (h *Handler) leaveWaiting(f *flight) {
	if f.placed != placeNone {
		h.waiting.leave(f.waitKeys, &f.placed, f.seat)
	}
}
