package limiter

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/lua"
)

// Queues: a concurrency zone with a MaxWait, or a token bucket zone with a MaxWait and
// priority classes (Zone.Queues), keeps the requests that find every slot (or the tokens they
// cost) taken in a queue in Redis (queue.lua), in priority classes (Zone.Classes), instead of
// denying them. A request enters it (Enqueue) and waits for its Waiter's signal: queue.lua
// reserves a freed slot (or the tokens) for the next waiter across every instance and
// publishes its id on its instance's channel, `<prefix>queue:<instance>`. The request is then
// decided again with the claim (Request.Claim), which takes the reservation in place of a free
// slot or of the bucket's tokens. A waiter that gives up leaves (Leave), handing a reservation
// to the next. While a Limiter has waiters, its keeper hears their grants and renews their
// leases every QueueRefreshEvery (RefreshQueues, one call per queue it waits in), which also
// tells it of grants whose message was lost; a waiter whose instance dies is dropped when its
// lease ends, QueueLease after its last renewal. A token bucket's waiters are granted as it
// refills: each instance with waiters in its queue calls queue.lua's promote when the next
// waiter's cost is in the bucket (at most once per QueuePromoteEvery). With Zone.FairTenants,
// a class's waiters are granted in turn by tenant (Request.Tenant; start-time fair queuing in
// queue.lua), not in arrival order.

var queueScript = newScript(lua.Queue)

const (
	// QueueLease is how long a waiter stays in its queue after its last renewal (µs precision):
	// a waiter whose instance died or lost Redis is dropped at most this long after.
	QueueLease = 3 * time.Second
	// QueueRefreshEvery is how often an instance renews its waiters' leases (one call per queue
	// it has waiters in), and so the longest a lost grant message delays a waiter.
	QueueRefreshEvery = time.Second
	// QueueClaim is how long a reservation (a slot, or tokens) waits for the waiter's decision;
	// a slot not claimed by then frees itself, tokens count as charged.
	QueueClaim = 3 * time.Second
	// QueuePromoteEvery is the shortest time between two grant calls (queue.lua's promote) an
	// instance makes for one token bucket queue: each grants every waiter whose cost the bucket
	// holds, so waiters are granted up to this late, and a queue costs each instance with
	// waiters in it at most 1/QueuePromoteEvery calls a second.
	QueuePromoteEvery = 10 * time.Millisecond
	// MaxClasses is the most priority classes a queue may have.
	MaxClasses = 8
	// DefaultFairTenants is the Zone.FairTenants a caller should default to: the most tenants
	// with a place in a class's fair line at once.
	DefaultFairTenants = 1000
	// MaxFairTenants bounds Zone.FairTenants.
	MaxFairTenants = 100000
)

// Queues reports whether z keeps the requests it cannot admit now waiting in a queue: a
// concurrency zone with a MaxWait, or a token bucket zone with a MaxWait and Classes (without
// classes, a token bucket's MaxWait holds each request for its turn: see MaxWait).
func (z *Zone) Queues() bool {
	return z.MaxWait > 0 && (z.Algorithm.HoldsSlots() || z.Algorithm.shapes() && len(z.Classes) > 0)
}

// validateQueue checks the queue of z, a zone that Queues.
func (z *Zone) validateQueue() *FieldError {
	if z.Overrides {
		return z.fieldError("overrides", "overrides do not apply to a zone with a queue (max_wait): its queue grants by the zone's own numbers")
	}
	if z.FairTenants < 0 || z.FairTenants > MaxFairTenants {
		return z.fieldError("fair_tenants", "fair_tenants %d must be 1 to %d", z.FairTenants, MaxFairTenants)
	}
	if len(z.Classes) > MaxClasses {
		return z.fieldError("priority", "%d priority classes, at most %d", len(z.Classes), MaxClasses)
	}
	sum := 0
	for _, s := range z.Classes {
		if s < 0 || s > 1000 {
			return z.fieldError("priority", "a class's share must be 0%% to 100%%")
		}
		sum += s
	}
	if sum > 1000 {
		return z.fieldError("priority", "the classes' shares add up to %g%%, more than 100%%", float64(sum)/10)
	}
	return nil
}

// classes is the number of z's priority classes: len(Classes), at least 1.
func (z *Zone) classes() int { return max(1, len(z.Classes)) }

// Waiter is a request waiting in a queue for a slot (Enqueue).
type Waiter struct {
	id     string // "<instance>.<n>.<class>", or "<instance>.<n>:<cost>.<class>" (a token bucket's)
	key    string // the zone's state key for the request's client
	tenant string // with fair queuing, the request's tenant (ClientKey of Request.Tenant)
	zone   *Zone
	ready  chan struct{} // one signal: granted, or gone
	mu     sync.Mutex
	gone   bool  // the queue lost it (a lapsed lease): enter again
	since  int64 // its arrival, µs by the scripts' clock
	// entered is set once queue.lua has it (RefreshQueues renews only those), claimed once its
	// claim admitted its request (Leave then has nothing to do); under the Limiter's waiters.mu.
	entered, claimed bool
	// Ahead is the number of waiters ahead of it (of its class and the higher ones) when it
	// entered; with fair queuing, those of its class are those of a lesser tag.
	Ahead int64
}

// Ready returns a channel that receives when w holds a reservation (decide its request with
// Request.Claim), or when the queue lost it (Gone: Enqueue it again).
func (w *Waiter) Ready() <-chan struct{} { return w.ready }

// Gone reports whether the queue lost w (its lease lapsed while Redis could not be reached).
func (w *Waiter) Gone() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.gone
}

func (w *Waiter) signal(gone bool) {
	w.mu.Lock()
	w.gone = gone
	w.mu.Unlock()
	select {
	case w.ready <- struct{}{}:
	default:
	}
}

// Claim makes r, a request of w's zone, take w's reservation in place of a free slot or of
// the bucket's tokens.
func (r *Request) Claim(w *Waiter) { r.claim = w.id }

// waitersOf are a Limiter's waiters, by id, and the keeper that hears their grants and renews
// their leases while there are any.
type waitersOf struct {
	mu   sync.Mutex
	m    map[string]*Waiter
	n    uint64
	last time.Time // the last RefreshQueues
	keep *keeper   // nil while no keeper runs

	promotes map[string]*promoteTimer // per token bucket queue's state key, its next promote
}

// keeper hears a Limiter's grants and renews its waiters' leases (keepWaiters) from the first
// waiter until none is left, or Close.
type keeper struct {
	ps         *redis.PubSub // nil without a Subscriber
	subscribed chan struct{} // closed once the subscription was answered (at once without one)
	stop       chan struct{} // closed when the keeper ends
}

// promoteTimer is the next promote this instance makes for a token bucket queue: at at.
type promoteTimer struct {
	at    time.Time
	timer *time.Timer
}

// Waiting returns the number of this Limiter's requests waiting in queues.
func (l *Limiter) Waiting() int {
	l.waiters.mu.Lock()
	defer l.waiters.mu.Unlock()
	return len(l.waiters.m)
}

// queueChannel is the channel prefix of the grants: an instance hears its own on
// queueChannel(prefix) + its id.
func queueChannel(prefix string) string { return prefix + "queue:" }

// Enqueue puts the request r (a Queues zone's, denied for want of a slot or of tokens) in its queue, in
// class r.Class (0 the highest; a class beyond the zone's is its last), arrived at since (µs
// by the scripts' clock; 0: now), and returns its Waiter. When a slot is free already, the
// Waiter is ready at once. Its errors are Redis's; the request is then in no queue.
func (l *Limiter) Enqueue(ctx context.Context, r Request, since int64) (*Waiter, error) {
	if !r.Zone.Queues() {
		return nil, fmt.Errorf("zone %q has no queue (a max_wait on algorithm concurrency, or with priority on token_bucket)", r.Zone.Name)
	}
	class := min(max(r.Class, 0), r.Zone.classes()-1) + 1
	l.waiters.mu.Lock()
	l.waiters.n++
	id := l.instance + "." + strconv.FormatUint(l.waiters.n, 36)
	if !r.Zone.Algorithm.HoldsSlots() {
		id += ":" + strconv.FormatInt(r.Cost, 10)
	}
	w := &Waiter{id: id + "." + strconv.Itoa(class),
		key: StateKey(l.prefix, r.Zone, ClientKey(r.Key)), zone: r.Zone, ready: make(chan struct{}, 1)}
	if r.Zone.FairTenants > 0 {
		w.tenant = ClientKey(r.Tenant)
	}
	if l.waiters.m == nil {
		l.waiters.m = make(map[string]*Waiter)
	}
	l.waiters.m[w.id] = w // before the call: its grant may be published before the reply
	k := l.keeper()
	l.waiters.mu.Unlock()
	k.listening(ctx)
	if err := l.enter(ctx, w, since); err != nil {
		l.forget(w)
		return nil, err
	}
	l.setEntered(w, true)
	return w, nil
}

// setEntered marks w as in its queue, or not.
func (l *Limiter) setEntered(w *Waiter, in bool) {
	l.waiters.mu.Lock()
	w.entered = in
	l.waiters.mu.Unlock()
}

// Reenter puts w back in its queue, at its first arrival, after the queue lost it (Gone) or
// its reserved slot lapsed before its claim.
func (l *Limiter) Reenter(ctx context.Context, w *Waiter) error {
	w.mu.Lock()
	w.gone = false
	w.mu.Unlock()
	l.waiters.mu.Lock()
	l.waiters.m[w.id] = w
	w.entered = false
	k := l.keeper()
	l.waiters.mu.Unlock()
	k.listening(ctx)
	if err := l.enter(ctx, w, w.since); err != nil {
		return err
	}
	l.setEntered(w, true)
	return nil
}

// enter is queue.lua's enter for w.
func (l *Limiter) enter(ctx context.Context, w *Waiter, since int64) error {
	var arrival any = ""
	if since > 0 {
		arrival = since
	}
	reply, err := runScript(ctx, l.rdb, queueScript, queueKeys(w.key, w.zone), l.queueArgs(w.zone, "enter", w.id, arrival, w.tenant))
	if err != nil {
		return fmt.Errorf("redis queue enter: %w", err)
	}
	v, ok := reply.([]any)
	if !ok || len(v) != 4 {
		return fmt.Errorf("%w: queue enter got %v, want 4 integers", ErrBadResponse, reply)
	}
	granted, ok1 := v[0].(int64)
	arrived, ok2 := v[1].(int64)
	ahead, ok3 := v[2].(int64)
	next, ok4 := v[3].(int64)
	if !ok1 || !ok2 || !ok3 || !ok4 {
		return fmt.Errorf("%w: queue enter got %v, want 4 integers", ErrBadResponse, reply)
	}
	w.since, w.Ahead = arrived, ahead
	if granted == 1 {
		w.signal(false)
	}
	l.schedulePromote(w.key, w.zone, next)
	return nil
}

// Leave takes w out of its queue, and gives its reservation, if any, to the next waiter. Its
// errors are Redis's: the waiter's lease then ends within QueueLease, and a reservation within
// QueueClaim.
func (l *Limiter) Leave(ctx context.Context, w *Waiter) error {
	l.waiters.mu.Lock()
	claimed := w.claimed
	delete(l.waiters.m, w.id)
	l.waiters.mu.Unlock()
	if claimed {
		return nil // its claim took the reserved slot: nothing is left in the queue
	}
	reply, err := runScript(ctx, l.rdb, queueScript, queueKeys(w.key, w.zone), l.queueArgs(w.zone, "leave", w.id))
	if err != nil {
		return fmt.Errorf("redis queue leave: %w", err)
	}
	next, err := lastInt(reply, 2, "leave")
	if err != nil {
		return err
	}
	l.schedulePromote(w.key, w.zone, next)
	return nil
}

// Claimed stops renewing w, whose request was admitted with its claim: the claim took its
// reserved slot, and a Leave after it sends nothing.
func (l *Limiter) Claimed(w *Waiter) {
	l.waiters.mu.Lock()
	w.claimed = true
	delete(l.waiters.m, w.id)
	l.waiters.mu.Unlock()
}

func (l *Limiter) forget(w *Waiter) {
	l.waiters.mu.Lock()
	delete(l.waiters.m, w.id)
	l.waiters.mu.Unlock()
}

// promote has queue.lua grant what zone z's client at state key has free (slots, or tokens)
// to the next waiters, and returns the µs until the next waiter's grant fits (a token
// bucket's; else 0).
func (l *Limiter) promote(ctx context.Context, key string, z *Zone) (int64, error) {
	reply, err := runScript(ctx, l.rdb, queueScript, queueKeys(key, z), l.queueArgs(z, "promote"))
	if err != nil {
		return 0, fmt.Errorf("redis queue promote: %w", err)
	}
	return lastInt(reply, 2, "promote")
}

// lastInt returns the last integer of queue.lua's reply to op, an array of n integers (n 0:
// any length but 0): the µs until its queue's next grant fits.
func lastInt(reply any, n int, op string) (int64, error) {
	v, ok := reply.([]any)
	if ok && len(v) > 0 && (n == 0 || len(v) == n) {
		if x, ok := v[len(v)-1].(int64); ok {
			return x, nil
		}
	}
	return 0, fmt.Errorf("%w: queue %s got %v", ErrBadResponse, op, reply)
}

// promoteFreed grants what the settlement of p gave back (slots, or tokens held) to the next
// waiters of their queues. A promote that fails is left to the waiters' instances: their next
// RefreshQueues grants it, within QueueRefreshEvery.
func (l *Limiter) promoteFreed(ctx context.Context, p heldPart) {
	for j, z := range p.queues {
		if z != nil {
			if next, err := l.promote(ctx, p.keys[j], z); err == nil {
				l.schedulePromote(p.keys[j], z, next)
			}
		}
	}
}

// schedulePromote has this instance call promote for the token bucket queue of state key next
// µs from now (at least QueuePromoteEvery), when it has no earlier call scheduled; next 0:
// nothing to schedule. The call is made only while this instance has waiters in the queue.
func (l *Limiter) schedulePromote(key string, z *Zone, next int64) {
	if next <= 0 {
		return
	}
	d := max(time.Duration(next)*time.Microsecond, QueuePromoteEvery)
	at := time.Now().Add(d)
	l.waiters.mu.Lock()
	defer l.waiters.mu.Unlock()
	if t := l.waiters.promotes[key]; t != nil {
		if !t.at.After(at) {
			return
		}
		t.timer.Stop()
	}
	if l.waiters.promotes == nil {
		l.waiters.promotes = make(map[string]*promoteTimer)
	}
	t := &promoteTimer{at: at}
	t.timer = time.AfterFunc(d, func() { l.promoteDue(key, z, t) })
	l.waiters.promotes[key] = t
}

// promoteDue is the promote t scheduled for the queue of state key: made while this instance
// has waiters in it, and the next one scheduled from its reply.
func (l *Limiter) promoteDue(key string, z *Zone, t *promoteTimer) {
	l.waiters.mu.Lock()
	if l.waiters.promotes[key] == t {
		delete(l.waiters.promotes, key)
	}
	waiting := false
	for _, w := range l.waiters.m {
		if w.key == key {
			waiting = true
			break
		}
	}
	l.waiters.mu.Unlock()
	if !waiting {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), QueueRefreshEvery)
	defer cancel()
	if next, err := l.promote(ctx, key, z); err == nil {
		l.schedulePromote(key, z, next)
	}
}

// queueKeys are queue.lua's KEYS for zone z's client whose state key is key: with fair
// queuing (FairTenants), its fair lines, tenants' tags and tenants of waiters too.
func queueKeys(key string, z *Zone) []string {
	n := z.classes()
	keys := make([]string, 3, 4+3*n)
	keys[0], keys[1], keys[2] = key, waitersKey(key), key+":qm"
	for c := 1; c <= n; c++ {
		keys = append(keys, key+":q"+strconv.Itoa(c))
	}
	if z.FairTenants > 0 {
		for _, set := range []string{":qv", ":qf"} {
			for c := 1; c <= n; c++ {
				keys = append(keys, key+set+strconv.Itoa(c))
			}
		}
		keys = append(keys, tenantsKey(key))
	}
	if z.Algorithm.Adapts() { // last: queue.lua reads it as KEYS[#KEYS]
		keys = append(keys, controlKey(key))
	}
	return keys
}

// tenantsKey is the hash of the tenant of each waiter of the fair queue of state key.
func tenantsKey(key string) string { return key + ":qt" }

// waitersKey is the sorted set of the waiters (and their leases) of the queue of state key.
func waitersKey(key string) string { return key + ":ql" }

// queueArgs are queue.lua's ARGV for operation op of zone z, then more.
func (l *Limiter) queueArgs(z *Zone, op string, more ...any) []any {
	var now any = ""
	if l.now != nil {
		now = l.now().UnixMicro()
	}
	shares := make([]string, z.classes())
	for c := range shares {
		shares[c] = "0"
		if c < len(z.Classes) {
			shares[c] = strconv.Itoa(z.Classes[c])
		}
	}
	var zone any = z.Limit
	switch {
	case z.Algorithm.Adapts():
		zone = strconv.FormatInt(z.Ceiling(), 10) + "/" + strconv.FormatInt(z.Adaptive.MinLimit, 10)
	case !z.Algorithm.HoldsSlots():
		zone = strconv.FormatInt(z.Capacity, 10) + "," + strconv.FormatFloat(z.RefillRate, 'f', -1, 64)
	}
	args := []any{now, op, zone, QueueClaim.Microseconds(), queueChannel(l.prefix), strings.Join(shares, ","), QueueLease.Microseconds(), z.FairTenants}
	return append(args, more...)
}

// keeper returns the running keeper, starting one (a subscription to this instance's grants
// channel, and keepWaiters) when none runs; under waiters.mu. Without a Subscriber (Options), or
// while the subscription fails, grants reach waiters through RefreshQueues.
func (l *Limiter) keeper() *keeper {
	if k := l.waiters.keep; k != nil {
		return k
	}
	k := &keeper{subscribed: make(chan struct{}), stop: make(chan struct{})}
	l.waiters.keep = k
	if l.sub == nil {
		close(k.subscribed)
	} else {
		k.ps = l.sub.Subscribe(context.Background()) // no channel: no call yet
		go l.hear(k.ps.Channel())
		go func() {
			defer close(k.subscribed)
			_ = k.ps.Subscribe(context.Background(), queueChannel(l.prefix)+l.instance) // go-redis subscribes again on reconnection
		}()
	}
	go l.keepWaiters(k)
	return k
}

// keepWaiters renews the Limiter's waiters every QueueRefreshEvery (RefreshQueues) until none
// is left or k is stopped, then ends k. A failed renewal is tried again at the next tick: a
// waiter outlives renewals that fail for less than QueueLease.
func (l *Limiter) keepWaiters(k *keeper) {
	t := time.NewTicker(QueueRefreshEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-k.stop:
			return
		}
		l.waiters.mu.Lock()
		mine := l.waiters.keep == k // else Close ended k
		idle := mine && len(l.waiters.m) == 0
		if idle {
			l.waiters.keep = nil
		}
		l.waiters.mu.Unlock()
		if idle {
			_ = k.end()
		}
		if !mine || idle {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), QueueRefreshEvery)
		_ = l.RefreshQueues(ctx)
		cancel()
	}
}

// listening returns once k's subscription was answered, so that it hears the grant of an
// enter call made next, or once ctx is done.
func (k *keeper) listening(ctx context.Context) {
	select {
	case <-k.subscribed:
	case <-ctx.Done():
	}
}

// end stops k's renewals and closes its subscription.
func (k *keeper) end() error {
	close(k.stop)
	if k.ps == nil {
		return nil
	}
	return k.ps.Close()
}

// hear signals the waiters whose grants msgs carry, until the subscription is closed.
func (l *Limiter) hear(msgs <-chan *redis.Message) {
	for msg := range msgs {
		l.waiters.mu.Lock()
		w := l.waiters.m[msg.Payload]
		l.waiters.mu.Unlock()
		if w != nil {
			w.signal(false)
		}
	}
}

// RefreshQueues renews the leases of this Limiter's waiters, one queue.lua call per queue (in
// one pipeline), at most once per QueueRefreshEvery (the keeper calls it that often while the
// Limiter has waiters); each call also grants what the queue has free. A waiter found holding
// a reserved slot is signalled (its grant's message may have been
// lost), and one the queue lost is signalled as Gone. It returns the Redis errors joined.
func (l *Limiter) RefreshQueues(ctx context.Context) error {
	now := l.clock()
	l.waiters.mu.Lock()
	if now.Sub(l.waiters.last) < QueueRefreshEvery*9/10 || len(l.waiters.m) == 0 {
		l.waiters.mu.Unlock()
		return nil
	}
	l.waiters.last = now
	byKey := map[string][]*Waiter{}
	for _, w := range l.waiters.m {
		if w.entered { // one still entering could be told it is gone
			byKey[w.key] = append(byKey[w.key], w)
		}
	}
	l.waiters.mu.Unlock()
	calls := make([]*call, 0, len(byKey))
	ws := make([][]*Waiter, 0, len(byKey))
	for key, group := range byKey {
		ids := make([]any, len(group))
		for i, w := range group {
			ids[i] = w.id
		}
		calls = append(calls, &call{keys: queueKeys(key, group[0].zone), args: l.queueArgs(group[0].zone, "refresh", ids...)})
		ws = append(ws, group)
	}
	evalBatch(ctx, l.rdb, queueScript, calls)
	var errs []error
	for k, c := range calls {
		v, ok := c.reply.([]any)
		switch {
		case c.err != nil:
			errs = append(errs, fmt.Errorf("redis queue refresh: %w", c.err))
			continue
		case !ok || len(v) != len(ws[k])+1:
			errs = append(errs, fmt.Errorf("%w: queue refresh got %v", ErrBadResponse, c.reply))
			continue
		}
		if next, err := lastInt(v, 0, "refresh"); err == nil {
			l.schedulePromote(ws[k][0].key, ws[k][0].zone, next)
		}
		for i, w := range ws[k] {
			switch v[i] {
			case int64(1):
				w.signal(false)
			case int64(2):
				w.signal(true)
			}
		}
	}
	return errors.Join(errs...)
}

// Close stops hearing this Limiter's queue grants and renewing its waiters now, as when its
// instance dies: its waiters then lapse within QueueLease, unless a later Enqueue or Reenter
// starts both again. The keeper ends by itself once no request waits (Waiting), so a Limiter
// needs no Close.
func (l *Limiter) Close() error {
	l.waiters.mu.Lock()
	k := l.waiters.keep
	l.waiters.keep = nil
	l.waiters.mu.Unlock()
	if k == nil {
		return nil
	}
	return k.end()
}

// QueueState is a queue's state for one client key of a zone that Queues (Limiter.Queue).
type QueueState struct {
	// Waiting is the number of waiters per class, the highest class first; lapsed waiters
	// (their lease ended) that no call has dropped yet are counted.
	Waiting []int64
	// Oldest is the earliest arrival of a waiter, by the scripts' clock; zero when none waits.
	Oldest time.Time
	// Tenants are, with fair queuing (Zone.FairTenants), the tenants waiting (as ClientKey
	// gives them; "" the place shared by the tenants beyond FairTenants) and their waiters,
	// every class together, the most waiters first (then by tenant), at most
	// QueueTenantsListed of them; TenantsWaiting is how many tenants wait in all.
	Tenants        []TenantWaiting
	TenantsWaiting int
}

// TenantWaiting is one tenant of a fair queue and its number of waiters.
type TenantWaiting struct {
	Tenant  string
	Waiting int64
}

// QueueTenantsListed is the most tenants Limiter.Queue lists.
const QueueTenantsListed = 100

// Queue reads the queue of zone z (one that Queues) for clientKey (raw, as State takes it)
// without changing it: the waiters per class and the earliest arrival. Its errors are Redis's.
func (l *Limiter) Queue(ctx context.Context, z *Zone, clientKey string) (QueueState, error) {
	key := StateKey(l.prefix, z, ClientKey(clientKey))
	keys := queueKeys(key, z)[3 : 3+z.classes()]
	counts := make([]*redis.IntCmd, len(keys))
	heads := make([]*redis.ZSliceCmd, len(keys))
	var tenants *redis.MapStringStringCmd
	if _, err := l.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		for c, k := range keys {
			counts[c] = p.ZCard(ctx, k)
			heads[c] = p.ZRangeWithScores(ctx, k, 0, 0)
		}
		if z.FairTenants > 0 {
			tenants = p.HGetAll(ctx, tenantsKey(key))
		}
		return nil
	}); err != nil {
		return QueueState{}, fmt.Errorf("redis read of the queue of %s: %w", keys[0], err)
	}
	var q QueueState
	for c := range keys {
		q.Waiting = append(q.Waiting, counts[c].Val())
		if h := heads[c].Val(); len(h) > 0 {
			at := time.UnixMicro(int64(h[0].Score))
			if q.Oldest.IsZero() || at.Before(q.Oldest) {
				q.Oldest = at
			}
		}
	}
	if tenants != nil {
		q.Tenants, q.TenantsWaiting = countTenants(tenants.Val())
	}
	return q, nil
}

// countTenants counts the waiters of each tenant of byWaiter (a fair queue's waiter ids and
// their tenants), and returns the first QueueTenantsListed of them (the most waiters first),
// and how many there are.
func countTenants(byWaiter map[string]string) ([]TenantWaiting, int) {
	n := map[string]int64{}
	for _, t := range byWaiter {
		n[t]++
	}
	out := make([]TenantWaiting, 0, len(n))
	for t, c := range n {
		out = append(out, TenantWaiting{t, c})
	}
	slices.SortFunc(out, func(a, b TenantWaiting) int {
		if a.Waiting != b.Waiting {
			return cmp.Compare(b.Waiting, a.Waiting)
		}
		return strings.Compare(a.Tenant, b.Tenant)
	})
	return out[:min(len(out), QueueTenantsListed)], len(out)
}
