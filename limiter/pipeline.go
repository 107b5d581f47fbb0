package limiter

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// maxBatch bounds the decisions one pipeline carries.
const maxBatch = 128

// Pipeliner is what a Pipeline needs of a client: *redis.Client has it.
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

// Pipeline sends concurrent decisions to Redis in pipelines: each of its workers takes the
// decisions waiting when it is free (up to 128) and sends them in one write, reading their
// replies in one go. Under load many decisions share a round trip and its two system calls; with
// one decision at a time it is a plain round trip, plus a goroutine hand-off. Each decision is
// still one EVALSHA (EVAL after NOSCRIPT) of its own: batching changes the wire, not the count.
// A Pipeline may serve any number of Limiters (Options.Pipeline) and outlive them; it is safe for
// concurrent use.
type Pipeline struct {
	rdb   Pipeliner
	calls chan *call
	stop  chan struct{}
	wg    sync.WaitGroup
}

// NewPipeline starts a Pipeline of workers (at least 1) sending through rdb.
func NewPipeline(rdb Pipeliner, workers int) *Pipeline {
	workers = max(workers, 1)
	b := &Pipeline{rdb: rdb, calls: make(chan *call), stop: make(chan struct{})}
	b.wg.Add(workers)
	for range workers {
		go b.work()
	}
	return b
}

// Close stops the workers once they finish the batches under way; decisions sent after it fail.
func (b *Pipeline) Close() {
	close(b.stop)
	b.wg.Wait()
}

// run sends one decision and waits for its reply, or for ctx to end.
func (b *Pipeline) run(ctx context.Context, keys []string, args []any) (any, error) {
	if err := ctx.Err(); err != nil {
		return nil, err // never charge for a decision nobody waits for
	}
	c := &call{keys: keys, args: args, ctx: ctx, done: make(chan struct{})}
	select {
	case b.calls <- c:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-b.stop:
		return nil, errors.New("limiter pipeline closed")
	}
	select {
	case <-c.done:
		return c.reply, c.err
	case <-ctx.Done():
		// The worker may still run it: a decision that admits charges the zones unseen, which
		// errs on the safe side, as a timed-out single call would.
		return nil, ctx.Err()
	}
}

func (b *Pipeline) work() {
	defer b.wg.Done()
	batch := make([]*call, 0, maxBatch)
	for {
		batch = batch[:0]
		select {
		case c := <-b.calls:
			batch = c.appendTo(batch)
		case <-b.stop:
			return
		}
	more:
		for len(batch) < maxBatch {
			select {
			case c := <-b.calls:
				batch = c.appendTo(batch)
			default:
				break more
			}
		}
		if len(batch) > 0 {
			b.send(batch)
		}
	}
}

// appendTo appends c to batch, unless its context ended while it waited for a worker: then it
// is answered with the context's error and never sent, so it charges no zone.
func (c *call) appendTo(batch []*call) []*call {
	if err := c.ctx.Err(); err != nil {
		c.err = err
		close(c.done)
		return batch
	}
	return append(batch, c)
}

// send runs the batch's scripts in one pipeline (a second for those that met NOSCRIPT) and
// hands each call its reply. The pipeline's deadline is the latest of the calls'. A panic while
// reading replies (go-redis allocates whatever array length a reply declares, and panics on an
// absurd one) fails the batch with ErrBadResponse instead of killing the process: this goroutine
// is not a request's, so nothing else would recover it.
func (b *Pipeline) send(batch []*call) {
	delivered := false
	defer func() {
		if r := recover(); r != nil && !delivered {
			for _, c := range batch {
				c.reply, c.err = nil, fmt.Errorf("%w: reading the reply panicked: %v", ErrBadResponse, r)
				close(c.done)
			}
		}
	}()
	ctx, cancel := batchContext(batch)
	defer cancel()
	cmds := make([]*redis.Cmd, len(batch))
	pipe := b.rdb.Pipeline()
	for i, c := range batch {
		cmds[i] = decideScript.EvalSha(ctx, pipe, c.keys, c.args...)
	}
	_, _ = pipe.Exec(ctx) // each command carries its own error
	var again []int
	for i, cmd := range cmds {
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		pipe := b.rdb.Pipeline()
		for _, i := range again {
			cmds[i] = decideScript.Eval(ctx, pipe, batch[i].keys, batch[i].args...)
		}
		_, _ = pipe.Exec(ctx)
	}
	delivered = true
	for i, c := range batch {
		c.reply, c.err = cmds[i].Result()
		close(c.done)
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
