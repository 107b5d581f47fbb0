package limiter

import (
	"context"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Subscriber is what a ResetListener needs of a client: *redis.Client (standalone, or
// Sentinel's failover client, which follows the primary) and *redis.ClusterClient (classic
// pub/sub reaches every node of a cluster) have it.
type Subscriber interface {
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
}

// ResetListener delivers the resets other instances announce (Limiter.Reset publishes the state key
// it deleted on `<prefix>reset`) to the Limiters added to it, which forget their cached denials and
// lease grants of that key: a reset then reaches every instance's deny cache at once, not only
// after DenyCacheMaxAge. It subscribes when one of its Limiters first caches a denial (before that
// there is nothing to forget), on one connection dialled in the background; go-redis reconnects and
// subscribes again after a failure (a message published while it is disconnected is lost, and
// DenyCacheMaxAge bounds what that costs). One listener serves any number of Limiters and key
// prefixes; it is safe for concurrent use.
type ResetListener struct {
	// SubscribeFailed, when set (before the listener is used), is told of a subscription whose
	// first attempt failed: go-redis subscribes again when it reconnects, but until then this
	// instance's deny caches hear of no reset.
	SubscribeFailed func(channel string, err error)

	rdb    Subscriber
	start  sync.Once
	mu     sync.Mutex
	ps     *redis.PubSub                    // nil until started
	subs   map[string]map[*Limiter]struct{} // channel -> Limiters of that prefix
	closed bool
	done   chan struct{} // closed when run returns
}

// NewResetListener returns a listener on rdb's Redis. It contacts Redis only once a Limiter
// added to it caches a denial. Close stops it.
func NewResetListener(rdb Subscriber) *ResetListener {
	return &ResetListener{rdb: rdb, subs: make(map[string]map[*Limiter]struct{}), done: make(chan struct{})}
}

// Add makes l receive the resets of its key prefix, until Remove.
func (rl *ResetListener) Add(l *Limiter) {
	l.resets.Store(rl)
	ch := resetChannel(l.prefix)
	rl.mu.Lock()
	defer rl.mu.Unlock()
	ls, ok := rl.subs[ch]
	if !ok {
		ls = make(map[*Limiter]struct{})
		rl.subs[ch] = ls
		if rl.ps != nil {
			rl.subscribe(ch)
		}
	}
	ls[l] = struct{}{}
}

// Remove stops delivering resets to l. The channel stays subscribed: a reload adds the next
// config's Limiters right back.
func (rl *ResetListener) Remove(l *Limiter) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	delete(rl.subs[resetChannel(l.prefix)], l)
}

// listen subscribes to the channels of the Limiters added, the first time it is called.
func (rl *ResetListener) listen() {
	rl.start.Do(func() {
		rl.mu.Lock()
		defer rl.mu.Unlock()
		if rl.closed {
			return
		}
		rl.ps = rl.rdb.Subscribe(context.Background())
		go rl.run(rl.ps.Channel())
		for ch := range rl.subs {
			rl.subscribe(ch)
		}
	})
}

// subscribe subscribes to ch in the background: it dials when no connection is up yet, and
// go-redis keeps the channel to subscribe again on every reconnection even when this first
// attempt fails (which SubscribeFailed is told). rl.mu is held.
func (rl *ResetListener) subscribe(ch string) {
	ps, failed := rl.ps, rl.SubscribeFailed
	go func() {
		if err := ps.Subscribe(context.Background(), ch); err != nil && failed != nil {
			failed(ch, err)
		}
	}()
}

// Close ends the subscription and its connection, if any.
func (rl *ResetListener) Close() error {
	rl.mu.Lock()
	rl.closed = true
	ps := rl.ps
	rl.mu.Unlock()
	if ps == nil {
		return nil
	}
	err := ps.Close()
	<-rl.done
	return err
}

func (rl *ResetListener) run(msgs <-chan *redis.Message) {
	defer close(rl.done)
	for msg := range msgs {
		rl.mu.Lock()
		for l := range rl.subs[msg.Channel] {
			l.forgetKey(msg.Payload)
		}
		rl.mu.Unlock()
	}
}
