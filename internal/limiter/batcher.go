package limiter

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// maxBatch bounds the decisions one batch carries.
const maxBatch = 128

// Pipeliner makes go-redis pipelines: *redis.Client and *redis.ClusterClient have it.
type Pipeliner interface {
	Pipeline() redis.Pipeliner
}

// Processor runs one command: *redis.Client, *redis.ClusterClient and redis.UniversalClient
// have it.
type Processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// BatchClient is what a Batcher needs of a client: single commands (a script call), and go-redis
// pipelines (on Redis Cluster, a batch is one script call per hash slot, all in one pipeline).
// *redis.Client, *redis.ClusterClient and redis.UniversalClient have it.
type BatchClient interface {
	Processor
	Pipeliner
}

// call is one decision (or, with settle, one settlement: settle.lua) waiting for its script reply.
type call struct {
	keys   []string
	args   []any
	settle bool // a settle.lua call: sent as it is, beside the batch's decide.lua call
	ctx    context.Context
	// done receives one value when the call is answered: reply (a settlement's, or a merged
	// call's), arr (a decision's part of its batch's reply) and err are set then.
	done  chan struct{}
	reply any
	arr   []any
	err   error
	// eval: sent as EVAL (after NOSCRIPT); migrating: Redis Cluster refused it with TRYAGAIN
	// (see sendAgain), so a failure is its slot's (ErrMigrating).
	eval, migrating bool
}

// callPool holds the calls of Batcher.run and runSettle, with their done channels, used again once
// answered, so that a decision allocates neither.
var callPool = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

// newCall returns a call of keys and args from the pool.
func newCall(keys []string, args []any, settle bool) *call {
	c := callPool.Get().(*call)
	c.keys, c.args, c.settle = keys, args, settle
	return c
}

// release puts an answered call back in the pool.
func (c *call) release() {
	c.keys, c.args, c.ctx, c.reply, c.arr, c.err = nil, nil, nil, nil, nil, nil
	c.eval, c.migrating = false, false
	callPool.Put(c)
}

// answer tells c's waiter that c is answered. The waiter may use c again at once: nothing may
// touch c after it.
func (c *call) answer() { c.done <- struct{}{} }

// Batcher sends concurrent decisions to Redis in batches, with at most `slots` round trips
// under way. A decision that finds a slot free is sent at once from its own goroutine (no
// hand-off), together with the decisions waiting in the queue (up to 128 in all); one that finds
// every slot taken waits in the queue for the next round trip. So with one decision at a time it
// is a plain round trip, and under load many decisions share a round trip, its two system calls
// and ONE script call: decide.lua decides a batch of decisions in order, each all-or-nothing, in
// one EVALSHA (EVAL after NOSCRIPT). On Redis Cluster a batch is one script call per hash slot,
// all in one go-redis pipeline (one round trip per node). A Batcher may serve any number of
// Limiters (Options.Batcher) and outlive them; it is safe for concurrent use.
type Batcher struct {
	rdb     BatchClient
	cluster bool          // rdb is a Redis Cluster client: a batch is split by hash slot
	slots   chan struct{} // one token per round trip under way
	queue   chan *call    // decisions waiting for a slot
	stop    chan struct{}
	closed  sync.Once
}

// NewBatcher returns a Batcher sending through rdb with at most slots (at least 1) round
// trips under way. A decision's round trip runs on its caller's goroutine when a slot is free,
// so rdb must bound socket reads and writes by the context's deadline (go-redis:
// ContextTimeoutEnabled), or a stalled Redis holds the caller for rdb's own timeouts.
func NewBatcher(rdb BatchClient, slots int) *Batcher {
	_, cluster := rdb.(*redis.ClusterClient)
	return &Batcher{
		rdb:     rdb,
		cluster: cluster,
		slots:   make(chan struct{}, max(slots, 1)),
		queue:   make(chan *call, 4*maxBatch),
		stop:    make(chan struct{}),
	}
}

// Close makes decisions sent after it fail; the round trips under way finish.
func (b *Batcher) Close() { b.closed.Do(func() { close(b.stop) }) }

// run sends one decision and waits for its part of the batch's reply, or for ctx to end.
func (b *Batcher) run(ctx context.Context, keys []string, args []any) ([]any, error) {
	c := newCall(keys, args, false)
	if err := b.do(ctx, c); err != nil {
		return nil, err // c is not answered, and may still be sent: not used again
	}
	arr, err := c.arr, c.err
	c.release()
	return arr, err
}

// runSettle sends one settle.lua call in the next round trip, beside the decisions, and waits
// for its reply, or for ctx to end.
func (b *Batcher) runSettle(ctx context.Context, keys []string, args []any) (any, error) {
	c := newCall(keys, args, true)
	if err := b.do(ctx, c); err != nil {
		return nil, err
	}
	reply, err := c.reply, c.err
	c.release()
	return reply, err
}

// do sends c and waits until it is answered (nil: c's reply or arr and its err are set), or
// until ctx ends or the batcher is closed first: that error, c unanswered.
func (b *Batcher) do(ctx context.Context, c *call) error {
	if err := ctx.Err(); err != nil {
		return err // never charge for a decision nobody waits for
	}
	select {
	case <-b.stop:
		return errors.New("limiter batcher closed")
	default:
	}
	c.ctx = ctx
	select {
	case b.slots <- struct{}{}:
		b.lead(c) // c's reply is delivered in the first batch
	default:
		select {
		case b.queue <- c:
		case <-ctx.Done():
			return ctx.Err()
		}
		// Every slot was taken: each holder looks at the queue after releasing its slot. But
		// all may have released and looked before c was queued, so try to take a slot now.
		select {
		case b.slots <- struct{}{}:
			b.lead(nil)
		default:
		}
	}
	select {
	case <-c.done: // a leader's own call is done when lead returns: never lose its error to ctx's
		return nil
	default:
	}
	select {
	case <-c.done:
		return nil
	case <-ctx.Done():
		// It may still be sent: a decision that admits charges the zones unseen, which errs on
		// the safe side, as a timed-out single call would.
		return ctx.Err()
	}
}

// lead holds a slot: it sends first (if any) with the decisions waiting, releases the slot, and
// when decisions are waiting again hands them to a new goroutine holding a slot, so that a
// request never waits on the round trips of others after its own.
func (b *Batcher) lead(first *call) {
	batch := make([]*call, 0, 8)
	if first != nil {
		batch = first.appendTo(batch)
	}
more:
	for len(batch) < maxBatch {
		select {
		case c := <-b.queue:
			batch = c.appendTo(batch)
		default:
			break more
		}
	}
	if len(batch) > 0 {
		b.send(batch)
	}
	<-b.slots
	if len(b.queue) > 0 {
		select {
		case b.slots <- struct{}{}:
			go b.lead(nil)
		default: // another slot holder will look at the queue when it is done
		}
	}
}

// appendTo appends c to batch, unless its context ended while it waited for a slot: then it is
// answered with the context's error and never sent, so it charges no zone.
func (c *call) appendTo(batch []*call) []*call {
	if err := c.ctx.Err(); err != nil {
		c.err = err
		c.answer()
		return batch
	}
	return append(batch, c)
}

// send decides the batch with one decide.lua call (one per hash slot on Redis Cluster, and each
// settlement as it is) and hands each call its part of the reply. The batch's deadline is the
// latest of the calls'. A script call that Redis Cluster refused with TRYAGAIN (its keys split by
// a slot migration) is sent again by a goroutine of its own (sendLater), and send answers the
// others at once: a slot being migrated never holds the round trip that the decisions of other
// slots of its node share. A panic while reading replies fails the batch with ErrBadResponse
// instead of killing the process: this goroutine is not a request's, so nothing else would
// recover it.
func (b *Batcher) send(batch []*call) {
	ctx, cancel := batchContext(batch)
	defer cancel()
	if !b.cluster && !slices.ContainsFunc(batch, func(c *call) bool { return c.settle }) {
		merged := mergeCalls(batch)
		merged.reply, merged.err = runScript(ctx, b.rdb, decideScript, merged.keys, merged.args)
		merged.split(batch)
		for _, c := range batch {
			c.answer()
		}
		return
	}
	scripts, answers := b.scriptCalls(batch)
	later, sent := evalFrom(ctx, b.rdb, decideScript, scripts, 1, false)
	var laterAnswers [][]*call
	for i, sc := range scripts {
		if slices.Contains(later, sc) {
			laterAnswers = append(laterAnswers, answers[i])
			continue
		}
		sc.answerAll(answers[i])
	}
	if len(later) > 0 {
		go sendLater(b.rdb, later, laterAnswers, sent)
	}
}

// scriptCalls returns the script calls that decide batch (a batch holding settle.lua calls, or
// on Redis Cluster): its decisions merged into one decide.lua call (one per hash slot on Redis
// Cluster), then each settlement as it is; and, per script call, the calls of batch it answers.
func (b *Batcher) scriptCalls(batch []*call) (scripts []*call, answers [][]*call) {
	var decides, settles []*call
	for _, c := range batch {
		if c.settle {
			settles = append(settles, c)
		} else {
			decides = append(decides, c)
		}
	}
	switch {
	case len(decides) == 0:
	case b.cluster:
		answers = bySlot(decides)
	default:
		answers = [][]*call{decides}
	}
	scripts = make([]*call, len(answers), len(answers)+len(settles))
	for i, g := range answers {
		scripts[i] = mergeCalls(g)
	}
	for _, c := range settles {
		scripts = append(scripts, c)
		answers = append(answers, []*call{c})
	}
	return scripts, answers
}

// answerAll hands each of calls (those c answers: the decisions merged into it, or c itself,
// a settlement) its part of c's reply, and tells them they are answered.
func (c *call) answerAll(calls []*call) {
	if !c.settle {
		c.split(calls)
	}
	for _, part := range calls {
		part.answer()
	}
}

// sendLater sends again, after a pause, the script calls later that Redis Cluster refused with
// TRYAGAIN (sent times so far), until they run or their calls' latest deadline ends, and then
// answers the calls of each (answers, in order).
func sendLater(rdb Pipeliner, later []*call, answers [][]*call, sent int) {
	ctx, cancel := batchContext(slices.Concat(answers...))
	defer cancel()
	if pause(ctx, sent) {
		evalFrom(ctx, rdb, decideScript, later, sent+1, true)
	} else {
		for _, sc := range later {
			sc.err = sc.failure()
		}
	}
	for i, sc := range later {
		sc.answerAll(answers[i])
	}
}

// split hands each of calls (the calls merged into c, in order) its part of c's reply in arr: 1 +
// 5n values for a call of n zones (n keys, and its record keys). Every call gets c's error, or
// ErrBadResponse when the reply is not an array of exactly their lengths.
func (c *call) split(calls []*call) {
	if c.err != nil {
		for _, part := range calls {
			part.arr, part.err = nil, c.err
		}
		return
	}
	arr, ok := c.reply.([]any)
	want := 0
	for _, part := range calls {
		want += part.replyLen()
	}
	if !ok || len(arr) != want {
		err := fmt.Errorf("%w: a batch of %d decisions got %T of %d values, want %d", ErrBadResponse, len(calls), c.reply, len(arr), want)
		for _, part := range calls {
			part.arr, part.err = nil, err
		}
		return
	}
	off := 0
	for _, part := range calls {
		w := part.replyLen()
		part.arr, part.err = arr[off:off+w:off+w], nil
		off += w
	}
}

// bySlot groups calls by the hash slot of their keys (each call's keys share one), in order of
// first appearance, keeping each group's calls in order.
func bySlot(calls []*call) [][]*call {
	if len(calls) == 1 {
		return [][]*call{calls}
	}
	var groups [][]*call
	index := make(map[int]int, len(calls))
	for _, c := range calls {
		s := hashSlot(c.keys[0])
		g, ok := index[s]
		if !ok {
			g = len(groups)
			index[s] = g
			groups = append(groups, nil)
		}
		groups[g] = append(groups[g], c)
	}
	return groups
}

// runScript runs one call of s (EVALSHA; EVAL after NOSCRIPT; again after TRYAGAIN: see
// sendAgain), never sent again once it may have run (see onceCmd). A panic while reading the
// reply (go-redis allocates whatever array length a reply declares, and panics on an absurd one)
// is returned as ErrBadResponse.
func runScript(ctx context.Context, rdb Processor, s *script, keys []string, args []any) (reply any, err error) {
	defer func() {
		if r := recover(); r != nil {
			reply, err = nil, fmt.Errorf("%w: reading the reply panicked: %v", ErrBadResponse, r)
		}
	}()
	var c call // how it is sent, and its outcome
	for sent := 1; ; sent++ {
		cmd := s.cmd(ctx, c.eval, keys, args)
		perr := rdb.Process(ctx, cmd)
		if c.reply, c.err = cmd.Result(); c.reply == nil && c.err == nil {
			c.err = perr
		}
		again, wait := c.sendAgain(sent)
		if !again || (wait && !pause(ctx, sent)) {
			return c.reply, c.failure()
		}
	}
}

// evalBatch runs s (settle.lua for a settlement: see call.script) for every call in one go-redis
// pipeline, and sets each call's reply and err; the calls Redis refused without running them
// (see sendAgain) are sent again, in a pipeline of their own. No call is sent again once it may
// have run (see onceCmd). On Redis Cluster, go-redis splits a pipeline by node and sends to the
// nodes concurrently: one round trip per node. A panic while reading replies (go-redis allocates
// whatever array length a reply declares, and panics on an absurd one) sets every call's err to
// ErrBadResponse.
func evalBatch(ctx context.Context, rdb Pipeliner, s *script, batch []*call) {
	evalFrom(ctx, rdb, s, batch, 1, true)
}

// evalFrom is evalBatch, batch having been sent sent − 1 times. Unless wait, it does not pause
// before sending calls again after TRYAGAIN: it returns them (later, their replies and errors
// set by the last send), and how many times they were sent, once the others are answered.
func evalFrom(ctx context.Context, rdb Pipeliner, s *script, batch []*call, sent int, wait bool) (later []*call, sends int) {
	defer func() {
		if r := recover(); r != nil {
			for _, c := range batch {
				c.reply, c.err = nil, fmt.Errorf("%w: reading the reply panicked: %v", ErrBadResponse, r)
			}
			later = nil
		}
	}()
	cmds := make([]onceCmd, len(batch))
	for pending := batch; len(pending) > 0; sent++ {
		pipe := rdb.Pipeline()
		for k, c := range pending {
			cmds[k] = c.script(s).cmd(ctx, c.eval, c.keys, c.args)
			_ = pipe.Process(ctx, cmds[k])
		}
		// Each command carries its own error, except when setting up the connection failed with
		// a Redis error (AUTH's WRONGPASS): go-redis then leaves the commands unset, and only Exec
		// returns the error.
		_, err := pipe.Exec(ctx)
		var again []*call
		pausing := false
		for k, c := range pending {
			if c.reply, c.err = cmds[k].Result(); c.reply == nil && c.err == nil {
				c.err = err
			}
			if a, w := c.sendAgain(sent); a {
				again, pausing = append(again, c), pausing || w
			} else {
				c.err = c.failure()
			}
		}
		switch {
		case pausing && !wait:
			return again, sent
		case pausing && !pause(ctx, sent):
			for _, c := range again {
				c.err = c.failure()
			}
			return nil, sent
		}
		pending = again
	}
	return nil, sent
}

// sendAgain reports whether c, sent `sent` times, is sent again (sendAgain), after a pause
// (wait), and records how: as EVAL after NOSCRIPT, and whether it was refused with TRYAGAIN.
func (c *call) sendAgain(sent int) (again, wait bool) {
	again, c.eval, wait = sendAgain(c.err, c.eval, sent)
	c.migrating = c.migrating || redis.HasErrorPrefix(c.err, "TRYAGAIN")
	return again, wait
}

// failure is c's error, wrapping ErrMigrating when Redis Cluster refused c with TRYAGAIN before
// it failed.
func (c *call) failure() error {
	if c.err != nil && c.migrating && !errors.Is(c.err, ErrMigrating) {
		return fmt.Errorf("%w: %w", ErrMigrating, c.err)
	}
	return c.err
}

// script is settle.lua for a settlement, else dflt.
func (c *call) script(dflt *script) *script {
	if c.settle {
		return settleScript
	}
	return dflt
}

// batchContext has the latest deadline of the batch's calls (none if one has none), so that no
// call's reply is cut short by another's shorter deadline, and none waits forever.
func batchContext(batch []*call) (context.Context, context.CancelFunc) {
	if len(batch) == 1 {
		// A decision alone: its own context, no timer of the batch's. Its end (the request gone)
		// then ends the round trip too; the decision is not counted as a Redis failure then.
		return batch[0].ctx, func() {}
	}
	var latest time.Time
	for _, c := range batch {
		d, ok := c.ctx.Deadline()
		if !ok {
			return context.WithCancel(context.Background())
		}
		if d.After(latest) {
			latest = d
		}
	}
	return withDeadline(context.Background(), latest), func() {}
}
