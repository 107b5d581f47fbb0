package limiter

// LeaseAsks is how many grants this Limiter has asked Redis for and not yet had an answer to
// (a grant request's, or a successor's: renew), for tests that read a lease table's figures
// only once its background asks are over.
func (l *Limiter) LeaseAsks() int {
	t := l.leases
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.asking)
}
