package limiter

import "context"

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

// allowSlots decides reqs, whose keys are in several hash slots, with one decide script call per
// slot group, all in one pipeline, then refunds the groups that admitted if any group denied or
// failed. It returns the first error of a group when one failed.
func (l *Limiter) allowSlots(ctx context.Context, reqs []Request, keys []string, groups [][]int) (bool, []zoneReply, error) {
	calls := make([]*call, len(groups))
	for g, idx := range groups {
		greqs, gkeys := make([]Request, len(idx)), make([]string, len(idx))
		for j, i := range idx {
			greqs[j], gkeys[j] = reqs[i], keys[i]
		}
		calls[g] = &call{keys: gkeys, args: l.scriptArgs(greqs)}
	}
	evalBatch(ctx, l.rdb, decideScript, calls)

	zones := make([]zoneReply, len(reqs))
	allowed := true
	var firstErr error
	var charged []*call
	for g, c := range calls {
		ok, zs, err := decodeResult(c.reply, c.err, len(groups[g]))
		if err != nil {
			allowed = false
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		if ok {
			charged = append(charged, c)
		} else {
			allowed = false
		}
		for j, i := range groups[g] {
			zones[i] = zs[j]
		}
	}
	if !allowed && len(charged) > 0 {
		l.refund(ctx, charged)
	}
	if firstErr != nil {
		return false, nil, firstErr
	}
	return allowed, zones, nil
}

// refund runs refund.lua for each charged call, in one pipeline. Its errors are dropped: a
// charge that could not be refunded stays until it refills or expires, which denies too much,
// never admits too much.
func (l *Limiter) refund(ctx context.Context, charged []*call) {
	var now any = "" // the Redis server clock
	if l.now != nil {
		now = l.now().UnixMicro()
	}
	refunds := make([]*call, len(charged))
	for i, c := range charged {
		args := append([]any{now}, c.args[1:]...) // the same nonce, zones and costs
		refunds[i] = &call{keys: c.keys, args: args}
	}
	evalBatch(ctx, l.rdb, refundScript, refunds)
}
