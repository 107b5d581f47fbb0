package ratelimitredis

import (
	"context"
	"errors"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
)

// Queues (max_wait on a concurrency zone, or on a token bucket zone with priority): a request
// that the zone alone denies, for want of a free slot or of its tokens, waits in the zone's
// queue in Redis (limiter.Enqueue) instead of a 429, up to max_wait, and takes the next slot
// (or tokens) its turn gets, across every instance: by priority class (Priority), then in
// arrival order, or in turn by tenant with fair_by (fair.go). Granted, it is decided again with its claim (every zone, all-or-nothing), then
// served as any admitted request; at max_wait it is refused with 429 (result wait_timeout), and
// so is a lowest-class waiter whose waiting place a higher class takes (result evicted); a
// client that leaves ends its wait at once with 499 and takes nothing. A token bucket request
// whose tokens would not come within max_wait even first in line is refused at once, as
// without a queue. See docs/queues.md.

// Priority orders the waiters of a queue in classes: a placeholder names the request's class,
// and each class may be guaranteed a share of the slots granted while it has waiters.
type Priority struct {
	// The request's class name: a placeholder (or a literal), resolved per request, such as
	// `{http.request.header.X-Tier}` or a `map` output. A value that names no class is the last
	// class (the lowest), so a client cannot raise its own class by sending garbage.
	Class string `json:"class"`
	// The classes, the highest first: a waiter of a class is granted a slot before any waiter
	// of a lower class, except when a lower class is owed its share.
	Classes []PriorityClass `json:"classes"`
}

// PriorityClass is one priority class of a queue.
type PriorityClass struct {
	// The class's name, as Priority.Class resolves to it.
	Name string `json:"name"`
	// The share of the grants (slots, or waiters given their tokens; percent, 0 to 100, at most
	// one decimal) that the class is guaranteed while it has waiters: of any n grants while it
	// waits, at least
	// floor(share × n / 100), less one per other class owed at the same grant. The shares of all
	// classes add up to at most 100. Default: 0, served only when no higher class waits.
	Share float64 `json:"share,omitempty"`
}

// limiterClasses returns the limiter's Classes of p (shares in permille), or a field error.
func (p *Priority) limiterClasses(z *Zone) ([]int, error) {
	if p == nil {
		return nil, nil
	}
	if p.Class == "" || len(p.Classes) == 0 {
		return nil, z.fieldError("priority", "priority needs a class placeholder and at least one class")
	}
	shares := make([]int, len(p.Classes))
	for i, c := range p.Classes {
		if c.Name == "" || slices.ContainsFunc(p.Classes[:i], func(o PriorityClass) bool { return o.Name == c.Name }) {
			return nil, z.fieldError("priority", "class %d: a class needs a name of its own", i+1)
		}
		if !(c.Share >= 0 && c.Share <= 100) {
			return nil, z.fieldError("priority", "class %s: share %g%% must be 0%% to 100%%", c.Name, c.Share)
		}
		shares[i] = int(math.Round(c.Share * 10))
	}
	return shares, nil
}

// classOf returns the class index of a request of z whose placeholders are in repl: the index
// of the class Priority.Class names, else the last.
func (z *Zone) classOf(repl *caddy.Replacer) int {
	p := z.Priority
	if p == nil {
		return 0
	}
	name := repl.ReplaceAll(p.Class, "")
	for i, c := range p.Classes {
		if c.Name == name {
			return i
		}
	}
	return len(p.Classes) - 1
}

// className is the metric label of class i of z: its name, or "default" without Priority.
func (z *Zone) className(i int) string {
	if z.Priority == nil || i >= len(z.Priority.Classes) {
		return "default"
	}
	return z.Priority.Classes[i].Name
}

// queueMetrics are a queue zone's series, per class: its waiters now and their waits.
type queueMetrics struct {
	waiters []prometheus.Gauge
	waits   []prometheus.Observer
}

// provisionQueue looks up the series of z's queue, when it has one.
func (z *Zone) provisionQueue() {
	if !z.lz.Queues() || !limiter.ValidZoneName(z.Name) {
		return
	}
	initMetrics()
	n := max(1, len(z.lz.Classes))
	q := &queueMetrics{}
	for i := range n {
		q.waiters = append(q.waiters, metrics.queueWaiters.WithLabelValues(z.Name, z.className(i)))
		q.waits = append(q.waits, metrics.queueWait.WithLabelValues(z.Name, z.className(i)))
	}
	z.queue = q
}

// queueing returns the index in f.reqs of the zone whose queue f's request may wait in: the
// one zone that denied it, a zone with a queue, every other zone admitting it (a shadow zone
// aside); -1 when it may not wait (another zone denied it, Redis failed, dry_run, no waiting
// place was left for it, or a token bucket's tokens would come after max_wait).
func (h *Handler) queueing(f *flight) int {
	if f.d.Allowed || f.degraded || h.DryRun || f.noWait || f.d.Unsatisfiable || f.d.Blocked || f.d.Cached {
		return -1
	}
	at := -1
	for i := range f.reqs {
		rq := &f.reqs[i]
		if rq.Result.Allowed || rq.Zone.Shadow {
			continue
		}
		if at >= 0 || !rq.Zone.Queues() || !rq.Result.Known {
			return -1
		}
		at = i
	}
	if at >= 0 && !f.reqs[at].Zone.Algorithm.HoldsSlots() && f.d.RetryAfter > f.reqs[at].Zone.MaxWait {
		return -1
	}
	return at
}

// waitInQueue lets f's request, denied by the queue of f.reqs[at] alone, wait there for a slot,
// up to the zone's max_wait. done and err are as decideFlight's: on a grant, f.d is the
// decision of its claim (admitted, or denied by another zone now); at max_wait, f.d is a
// denial of the queue's zone, counted as wait_timeout.
func (h *Handler) waitInQueue(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, f *flight, at int) (done bool, err error) {
	rq := f.reqs[at]
	z := h.Zones[rq.Tag]
	start := time.Now()
	h.holdWaiting(f)
	if q := z.queue; q != nil {
		q.waiters[rq.Class].Inc()
		defer q.waiters[rq.Class].Dec()
	}
	ctx, cancel := context.WithTimeout(r.Context(), time.Duration(h.Timeout))
	waiter, err := h.limiter.Enqueue(ctx, rq, 0)
	cancel()
	if err != nil {
		return h.failed(w, r, next, f, err)
	}
	defer h.leaveQueue(waiter) // a no-op once its claim admitted it (Claimed)
	if q := z.queue; q != nil {
		defer func() { q.waits[rq.Class].Observe(time.Since(start).Seconds()) }()
	}
	if f.placed == placeHeld {
		f.seat = h.waiting.sit(rq.Class >= len(rq.Zone.Classes)-1)
		defer h.waiting.stand(f.seat)
	}
	timer := time.NewTimer(time.Until(start.Add(rq.Zone.MaxWait)))
	defer timer.Stop()
	for {
		select {
		case <-waiter.Ready():
			if f.seat != nil && !h.waiting.claiming(f.seat, true) {
				return h.evicted(z, f, start), nil
			}
			if done, again, err := h.claim(w, r, next, f, at, waiter); !again {
				f.queued = time.Since(start)
				return done, err
			}
			if f.seat != nil && !h.waiting.claiming(f.seat, false) {
				return h.evicted(z, f, start), nil
			}
		case <-f.seatEvicted():
			return h.evicted(z, f, start), nil
		case <-r.Context().Done():
			f.queued = time.Since(start)
			h.logQueue("client left while waiting in the queue", z, f)
			return true, caddyhttp.HandlerError{StatusCode: statusClientClosed, Err: errLeftWhileQueued}
		case <-timer.C:
			f.queued, f.waitTimeout = time.Since(start), true
			return false, nil
		}
	}
}

// evicted ends the wait of f's request, whose waiting place a request of a higher class took
// (waitingRoom): it is denied (429, result evicted) and leaves the queue (waitInQueue's
// leaveQueue), so it is not granted afterwards. done is false: the caller denies it.
func (h *Handler) evicted(z *Zone, f *flight, start time.Time) (done bool) {
	f.queued, f.evicted = time.Since(start), true
	h.logQueue("a higher class took the waiting place of a request in the queue", z, f)
	return false
}

// seatEvicted is closed when f's request, waiting in a queue, is evicted; nil (never ready)
// when it has no seat.
func (f *flight) seatEvicted() <-chan struct{} {
	if f.seat == nil {
		return nil
	}
	return f.seat.evict
}

// errLeftWhileQueued ends (as a 499) a request whose client went away while it waited in a
// queue; it took no slot.
var errLeftWhileQueued = errors.New("client closed the request while it waited in the queue (max_wait); it took no slot")

// claim decides f's request again with the slot waiter was granted (or enters the queue again
// when the queue lost it). again is true when it waits on: the queue lost it, or its
// reservation lapsed before the claim and it entered again at its first arrival.
func (h *Handler) claim(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, f *flight, at int, waiter *limiter.Waiter) (done, again bool, err error) {
	if !waiter.Gone() {
		f.reqs[at].Claim(waiter)
		done, err = h.decideFlight(w, r, next, f)
		if done || f.d.Allowed {
			if f.d.Allowed {
				h.limiter.Claimed(waiter)
			}
			return done, false, err
		}
		if h.queueing(f) != at {
			return false, false, nil // another zone denies it now: leaveQueue hands the slot on
		}
	}
	ctx, cancel := context.WithTimeout(r.Context(), time.Duration(h.Timeout))
	defer cancel()
	if err := h.limiter.Reenter(ctx, waiter); err != nil {
		done, err = h.failed(w, r, next, f, err)
		return done, false, err
	}
	return false, true, nil
}

// leaveQueue takes waiter out of its queue (handing a reserved slot on), in the background:
// the request's answer does not wait for it. A waiter whose claim admitted it is gone already.
func (h *Handler) leaveQueue(waiter *limiter.Waiter) {
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), max(time.Duration(h.Timeout), time.Second))
		defer cancel()
		if err := h.limiter.Leave(ctx, waiter); err != nil {
			if c := h.logger.Check(zapcore.DebugLevel, "leaving a queue failed; the waiter's lease ends within 3s"); c != nil {
				c.Write(zap.Error(err))
			}
		}
	}()
}

// logQueue logs msg about f's request in zone z's queue, at debug level.
func (h *Handler) logQueue(msg string, z *Zone, f *flight) {
	if c := h.logger.Check(zapcore.DebugLevel, msg); c != nil {
		c.Write(zap.String("zone", z.Name), zap.Int64("waited_ms", limiter.CeilMs(f.queued)))
	}
}

// setWaited publishes how long f's request waited in a queue: {http.rate_limit_redis.waited}
// and, with headers on, X-RateLimit-Waited (milliseconds, rounded up).
func (h *Handler) setWaited(w http.ResponseWriter, f *flight) {
	if f.queued <= 0 {
		return
	}
	f.waited = limiter.CeilMs(f.queued)
	if h.Headers != HeadersOff {
		w.Header()[hdrWaited] = []string{strconv.FormatInt(f.waited, 10)}
	}
}

// hdrWaited is the header of a request that waited in a queue: the milliseconds it waited.
var hdrWaited = http.CanonicalHeaderKey("X-RateLimit-Waited")

// parsePriority reads `priority <class placeholder> { <class> [share <percent>%] ... }`.
func parsePriority(d *caddyfile.Dispenser, z *Zone) error {
	p := &Priority{}
	if !d.NextArg() {
		return d.ArgErr()
	}
	p.Class = d.Val()
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		c := PriorityClass{Name: d.Val()}
		if d.NextArg() {
			if d.Val() != "share" || !d.NextArg() {
				return d.Errf("priority class %s: want `share <percent>%%`", c.Name)
			}
			v, ok := strings.CutSuffix(d.Val(), "%")
			s, err := strconv.ParseFloat(v, 64)
			if !ok || err != nil {
				return d.Errf("priority class %s: share %q must be a percentage such as 20%%", c.Name, d.Val())
			}
			c.Share = s
		}
		if d.NextArg() {
			return d.ArgErr()
		}
		p.Classes = append(p.Classes, c)
	}
	z.Priority = p
	return nil
}
