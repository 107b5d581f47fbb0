package limiter

import (
	"cmp"
	"context"
	"sync"
	"time"
)

// slotGroups returns, on Redis Cluster, the indexes of keys grouped by hash slot, in order of
// first appearance; nil when the limiter is not on a cluster or every key is in one slot (one
// script call can then decide them all).
func (l *Limiter) slotGroups(keys []string) [][]int {
	if !l.cluster || len(keys) < 2 {
		return nil
	}
	slot := make([]int, len(keys))
	spread := false
	for i, k := range keys {
		slot[i] = hashSlot(k)
		spread = spread || slot[i] != slot[0]
	}
	if !spread {
		return nil
	}
	var groups [][]int
	group := make(map[int]int, len(keys)) // slot -> index in groups
	for i, s := range slot {
		g, ok := group[s]
		if !ok {
			g = len(groups)
			group[s] = g
			groups = append(groups, nil)
		}
		groups[g] = append(groups[g], i)
	}
	return groups
}

// allowSlots decides reqs, whose keys are in several hash slots, with one decide script call
// per slot group, all under way at once (evalEach), taking token bucket charges as holds and
// recording window counter charges (encodeDecision); then it commits every group when all admitted,
// or releases the groups that admitted when one denied or failed (see settle.lua): before it
// returns when every group answered and ctx has time left, else in the background, within
// Options.CallTimeout, so that a failure is not answered later than ctx's deadline. A group that
// failed may have taken its concurrency slots, and a release that fails leaves them: they are
// lost slots, given back by Refresh. A group's denial stands against another group's error,
// which is returned as slotErr; err is returned when no group denied and one failed.
func (l *Limiter) allowSlots(ctx context.Context, reqs []Request, keys []string, groups [][]int, now time.Time) (allowed bool, zones []zoneReply, held *Held, slotErr, err error) {
	calls := make([]*call, len(groups))
	greqs := make([][]Request, len(groups))
	for g, idx := range groups {
		rs, gkeys := make([]Request, len(idx)), make([]string, len(idx))
		for j, i := range idx {
			rs[j], gkeys[j] = reqs[i], keys[i]
		}
		greqs[g] = rs
		ckeys, args := l.encodeDecision(rs, gkeys, true, now)
		calls[g] = &call{keys: ckeys, args: args}
	}
	evalEach(ctx, l.rdb, decideScript, calls)

	zones = make([]zoneReply, len(reqs))
	gzones := make([][]zoneReply, len(calls)) // each group's reply; nil for a group that failed
	allowed = true
	denied := false
	var charged []int // the groups that admitted
	var shadowErr error
	var shadowFailed []int // the groups of shadow zones alone that failed
	for g, c := range calls {
		ok, zs, err := decodeResult(c.reply, c.err, greqs[g])
		if err != nil {
			l.lose(greqs[g], c.keys, c.args)
			if shadowOnly(greqs[g]) {
				// A shadow zone never refuses a request: one that cannot be decided is left out
				// (its zones not Known), and the enforced zones decide.
				shadowFailed = append(shadowFailed, g)
				shadowErr = cmp.Or(shadowErr, err)
				continue
			}
			allowed = false
			slotErr = cmp.Or(slotErr, err)
			continue
		}
		gzones[g] = zs
		if ok {
			charged = append(charged, g)
		} else {
			allowed, denied = false, true
		}
		for j, i := range groups[g] {
			zones[i] = zs[j]
		}
	}
	if len(shadowFailed) > 0 {
		// Its call may have run: what it took is given back (a shadow zone is charged only with
		// a decision that knows it admitted), in the background, as its node may not answer.
		go func() {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.callTime)
			defer cancel()
			l.release(ctx, calls, greqs, nil, shadowFailed)
		}()
	}
	switch {
	case allowed:
		// The zones held until after the response stay held: commit only the others.
		commits := make([]*call, 0, len(calls))
		for g, c := range calls {
			if gzones[g] == nil {
				continue
			}
			held = newHeld(reqs, c.keys, c.args, groups[g], gzones[g]).merge(held)
			commits = append(commits, withoutHeld(inForce(c, gzones[g]), reqs, groups[g]))
		}
		l.settle(ctx, commits, true)
	case len(charged) == 0:
	case slotErr == nil && ctx.Err() == nil:
		l.release(ctx, calls, greqs, gzones, charged)
	default:
		go func() {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.callTime)
			defer cancel()
			l.release(ctx, calls, greqs, gzones, charged)
		}()
	}
	if slotErr != nil && !denied {
		return false, nil, nil, nil, slotErr
	}
	return allowed, zones, held, cmp.Or(slotErr, shadowErr), nil
}

// shadowOnly reports whether every one of reqs is a shadow zone's.
func shadowOnly(reqs []Request) bool {
	for _, r := range reqs {
		if !r.Zone.Shadow {
			return false
		}
	}
	return true
}

// release gives back what the groups at charged of a decision across hash slots (calls, of the
// requests greqs) took: settle.lua's release, with the numbers in force of each zone with
// overrides (gzones, each group's reply; nil: the zones' own). The concurrency slots of a
// release that fails are lost slots, given back by Refresh.
func (l *Limiter) release(ctx context.Context, calls []*call, greqs [][]Request, gzones [][]zoneReply, charged []int) {
	rel := make([]*call, len(charged))
	for k, g := range charged {
		rel[k] = calls[g]
		if gzones != nil {
			rel[k] = inForce(calls[g], gzones[g])
		}
	}
	for k, err := range l.settle(ctx, rel, false) {
		if err != nil {
			g := charged[k]
			l.lose(greqs[g], calls[g].keys, calls[g].args)
		}
	}
}

// settle runs settle.lua for each call, all under way at once: commit when the request was
// admitted, else release. It returns each call's error (nil for a call it had no need to send). A
// hold that is never settled counts as a charge once decide.lua finds it older than 5s, and a
// window counter's charge whose record is never settled stays counted (the record expires after
// 5s), which denies too much, never admits too much.
func (l *Limiter) settle(ctx context.Context, charged []*call, commit bool) []error {
	var now any = "" // the Redis server clock
	if l.now != nil {
		now = l.now().UnixMicro()
	}
	mode := "release"
	if commit {
		mode = "commit"
	}
	settles := make([]*call, 0, len(charged))
	sent := make([]int, 0, len(charged)) // the index in charged of each of settles
	for i, c := range charged {
		if commit && !c.holdsInState() && len(c.keys) == c.zones() {
			continue // no hold to commit, no record to delete: a sliding window keeps its entries
		}
		// decide.lua's arguments were now, nonce, hold, n, then the zones: settle.lua takes
		// now, the same nonce, the mode, then the same zones and costs.
		settles = append(settles, &call{keys: c.keys, args: settleArgs(c.args, now, mode)})
		sent = append(sent, i)
	}
	evalEach(ctx, l.rdb, settleScript, settles)
	errs := make([]error, len(charged))
	for k, c := range settles {
		_, errs[sent[k]] = decodeSettled(c.reply, c.err, (len(c.args)-3)/4) // now, nonce, mode, then 4 per zone
	}
	return errs
}

// evalEach runs script for every call, each in a pipeline of its own, concurrently: one round
// trip per call, all under way at once. Not one pipeline for all: go-redis fails every command
// of a cluster pipeline when one node times out, and a slot whose node answered must keep its
// answer (a denial stands against another slot's failure).
func evalEach(ctx context.Context, rdb Pipeliner, s *script, calls []*call) {
	var wg sync.WaitGroup
	for _, c := range calls {
		wg.Go(func() { evalBatch(ctx, rdb, s, []*call{c}) })
	}
	wg.Wait()
}
