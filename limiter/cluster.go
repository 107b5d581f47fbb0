package limiter

import (
	"context"
	"slices"
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
// recording window counter charges (withRecords); then it commits every group when all admitted,
// or releases the groups that admitted when one denied or failed (see settle.lua). A group's denial stands against another group's error, which is returned as
// slotErr; err is returned when no group denied and one failed.
func (l *Limiter) allowSlots(ctx context.Context, reqs []Request, keys []string, groups [][]int, now time.Time) (allowed bool, zones []zoneReply, held *Held, slotErr, err error) {
	calls := make([]*call, len(groups))
	greqs := make([][]Request, len(groups))
	for g, idx := range groups {
		rs, gkeys := make([]Request, len(idx)), make([]string, len(idx))
		for j, i := range idx {
			rs[j], gkeys[j] = reqs[i], keys[i]
		}
		greqs[g] = rs
		args := l.scriptArgs(rs, true, now)
		calls[g] = &call{keys: withRecords(gkeys, rs, args, true), args: args}
	}
	evalEach(ctx, l.rdb, decideScript, calls)

	zones = make([]zoneReply, len(reqs))
	allowed = true
	denied := false
	var charged []*call
	for g, c := range calls {
		ok, zs, err := decodeResult(c.reply, c.err, greqs[g])
		if err != nil {
			allowed = false
			if slotErr == nil {
				slotErr = err
			}
			continue
		}
		if ok {
			charged = append(charged, c)
		} else {
			allowed, denied = false, true
		}
		for j, i := range groups[g] {
			zones[i] = zs[j]
		}
	}
	if allowed {
		// The zones held until after the response stay held: commit only the others.
		for g, c := range calls {
			held = newHeld(reqs, c.keys, c.args, groups[g]).merge(held)
			charged[g] = withoutHeld(c, reqs, groups[g])
		}
	}
	if len(charged) > 0 {
		l.settle(ctx, charged, allowed)
	}
	if slotErr != nil && !denied {
		return false, nil, nil, nil, slotErr
	}
	return allowed, zones, held, slotErr, nil
}

// settle runs settle.lua for each call, all under way at once: commit when the request was admitted,
// else release. Its errors are dropped: a hold that is never settled counts as a charge once
// decide.lua finds it older than 5s, and a window counter's charge whose record is never settled
// stays counted (the record expires after 5s), which denies too much, never admits too much.
func (l *Limiter) settle(ctx context.Context, charged []*call, commit bool) {
	var now any = "" // the Redis server clock
	if l.now != nil {
		now = l.now().UnixMicro()
	}
	mode := "release"
	if commit {
		mode = "commit"
	}
	settles := make([]*call, 0, len(charged))
	for _, c := range charged {
		if commit && !slices.Contains(c.args[4:], any("tb")) && len(c.keys) == c.zones() {
			continue // no hold to commit, no record to delete: a sliding window keeps its entries
		}
		// decide.lua's arguments were now, nonce, hold, n, then the zones: settle.lua takes
		// now, the same nonce, the mode, then the same zones and costs.
		args := append([]any{now, c.args[1], mode}, c.args[4:]...)
		settles = append(settles, &call{keys: c.keys, args: args})
	}
	evalEach(ctx, l.rdb, settleScript, settles)
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
