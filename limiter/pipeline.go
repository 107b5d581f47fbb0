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

// maxBatch bounds the decisions one pipeline carries.
const maxBatch = 128

// Pipeliner is what a Pipeline needs of a client: *redis.Client and *redis.ClusterClient have it.
type Pipeliner interface {
	Pipeline() redis.Pipeliner
}

// call is one decision waiting for its script reply.
type call struct {
	keys  []string
	args  []any
	ctx   context.Context
	done  chan struct{} // closed when reply and err are set
	reply any
	err   error
}

// Pipeline sends concurrent decisions to Redis in pipelines, with at most `slots` round trips
// under way. A decision that finds a slot free is sent at once from its own goroutine (no
// hand-off), together with the decisions waiting in the queue (up to 128 in all); one that finds
// every slot taken waits in the queue for the next round trip. So with one decision at a time it
// is a plain round trip, and under load many decisions share a round trip and its two system
// calls. Each decision is still one EVALSHA (EVAL after NOSCRIPT) of its own: batching changes
// the wire, not the count. A Pipeline may serve any number of Limiters (Options.Pipeline) and
// outlive them; it is safe for concurrent use.
type Pipeline struct {
	rdb    Pipeliner
	slots  chan struct{} // one token per round trip under way
	queue  chan *call    // decisions waiting for a slot
	stop   chan struct{}
	closed sync.Once
}

// NewPipeline returns a Pipeline sending through rdb with at most slots (at least 1) round
// trips under way. A decision's round trip runs on its caller's goroutine when a slot is free,
// so rdb must bound socket reads and writes by the context's deadline (go-redis:
// ContextTimeoutEnabled), or a stalled Redis holds the caller for rdb's own timeouts.
func NewPipeline(rdb Pipeliner, slots int) *Pipeline {
	return &Pipeline{
		rdb:   rdb,
		slots: make(chan struct{}, max(slots, 1)),
		queue: make(chan *call, 4*maxBatch),
		stop:  make(chan struct{}),
	}
}

// Close makes decisions sent after it fail; the round trips under way finish.
func (b *Pipeline) Close() { b.closed.Do(func() { close(b.stop) }) }

// run sends one decision and waits for its reply, or for ctx to end.
func (b *Pipeline) run(ctx context.Context, keys []string, args []any) (any, error) {
	if err := ctx.Err(); err != nil {
		return nil, err // never charge for a decision nobody waits for
	}
	select {
	case <-b.stop:
		return nil, errors.New("limiter pipeline closed")
	default:
	}
	c := &call{keys: keys, args: args, ctx: ctx, done: make(chan struct{})}
	select {
	case b.slots <- struct{}{}:
		b.lead(c) // c's reply is delivered in the first batch
	default:
		select {
		case b.queue <- c:
		case <-ctx.Done():
			return nil, ctx.Err()
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
		return c.reply, c.err
	default:
	}
	select {
	case <-c.done:
		return c.reply, c.err
	case <-ctx.Done():
		// It may still be sent: a decision that admits charges the zones unseen, which errs on
		// the safe side, as a timed-out single call would.
		return nil, ctx.Err()
	}
}

// lead holds a slot: it sends first (if any) with the decisions waiting, releases the slot, and
// when decisions are waiting again hands them to a new goroutine holding a slot, so that a
// request never waits on the round trips of others after its own.
func (b *Pipeline) lead(first *call) {
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
		close(c.done)
		return batch
	}
	return append(batch, c)
}

// send runs the batch's scripts in one pipeline (see evalBatch) and hands each call its reply.
// The pipeline's deadline is the latest of the calls'. A panic while reading replies fails the
// batch with ErrBadResponse instead of killing the process: this goroutine is not a request's, so
// nothing else would recover it.
func (b *Pipeline) send(batch []*call) {
	ctx, cancel := batchContext(batch)
	defer cancel()
	evalBatch(ctx, b.rdb, decideScript, batch)
	for _, c := range batch {
		close(c.done)
	}
}

// evalBatch runs script for every call in one go-redis pipeline (a second one for
// those that met NOSCRIPT) and sets each call's reply and err. On Redis Cluster, go-redis splits
// a pipeline by node and sends to the nodes concurrently: one round trip per node. A panic while
// reading replies (go-redis allocates whatever array length a reply declares, and panics on an
// absurd one) sets every call's err to ErrBadResponse.
func evalBatch(ctx context.Context, rdb Pipeliner, script *redis.Script, batch []*call) {
	defer func() {
		if r := recover(); r != nil {
			for _, c := range batch {
				c.reply, c.err = nil, fmt.Errorf("%w: reading the reply panicked: %v", ErrBadResponse, r)
			}
		}
	}()
	cmds := make([]*redis.Cmd, len(batch))
	pipe := rdb.Pipeline()
	for i, c := range batch {
		cmds[i] = script.EvalSha(ctx, pipe, c.keys, c.args...)
	}
	// Each command carries its own error, except when setting up the connection failed with a
	// Redis error (AUTH's WRONGPASS): go-redis then leaves the commands unset, and only Exec
	// returns the error.
	_, err := pipe.Exec(ctx)
	var again []int
	var errAgain error
	for i, cmd := range cmds {
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		pipe := rdb.Pipeline()
		for _, i := range again {
			cmds[i] = script.Eval(ctx, pipe, batch[i].keys, batch[i].args...)
		}
		_, errAgain = pipe.Exec(ctx)
	}
	for i, c := range batch {
		c.reply, c.err = cmds[i].Result()
		if c.reply == nil && c.err == nil {
			c.err = err
			if slices.Contains(again, i) {
				c.err = errAgain
			}
		}
	}
}

// batchContext has the latest deadline of the batch's calls (none if one has none), so that no
// call's reply is cut short by another's shorter deadline, and none waits forever.
func batchContext(batch []*call) (context.Context, context.CancelFunc) {
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
	return context.WithDeadline(context.Background(), latest)
}
