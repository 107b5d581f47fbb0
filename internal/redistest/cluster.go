package redistest

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// clusterSlots is the number of Redis Cluster hash slots.
const clusterSlots = 16384

// Cluster is a Redis Cluster of primaries only, started for a test: each node a redis-server
// with cluster mode on, on free loopback ports, the slots split evenly in order.
type Cluster struct {
	// Nodes are the primaries; Nodes[i] holds the i-th range of slots.
	Nodes []*Server
	t     testing.TB
}

// StartCluster starts n primaries, joins them, assigns the slots and waits until every node
// reports the cluster state ok and the same slot map. It fails the test otherwise.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	c := &Cluster{t: t}
	var bus0 int // node 0's cluster bus port
	for i := 0; i < n; i++ {
		bus, err := freePort()
		if err != nil {
			t.Fatalf("finding a free port: %v", err)
		}
		c.Nodes = append(c.Nodes, Start(t,
			"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-port", strconv.Itoa(bus), "--cluster-node-timeout", "2000",
			"--cluster-require-full-coverage", "yes"))
		if i == 0 {
			bus0 = bus
		}
	}
	for i, s := range c.Nodes {
		lo, hi := i*clusterSlots/n, (i+1)*clusterSlots/n-1
		s.Do("CLUSTER", "ADDSLOTSRANGE", lo, hi)
		if i > 0 {
			host, port := splitAddr(t, c.Nodes[0].Addr)
			s.Do("CLUSTER", "MEET", host, port, bus0)
		}
	}
	c.waitConsistent()
	return c
}

// Addrs returns the nodes' addresses, the seeds of a cluster client.
func (c *Cluster) Addrs() []string {
	a := make([]string, len(c.Nodes))
	for i, s := range c.Nodes {
		a[i] = s.Addr
	}
	return a
}

// Client returns a cluster client of the cluster, closed when the test ends.
func (c *Cluster) Client() *redis.ClusterClient {
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	c.t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// NodeOf returns the node that owns slot, from that node's own view.
func (c *Cluster) NodeOf(slot int) *Server {
	c.t.Helper()
	for _, s := range c.Nodes {
		if s.owns(slot) {
			return s
		}
	}
	c.t.Fatalf("no node owns slot %d", slot)
	return nil
}

// owns reports whether s's slot map gives slot to s itself.
func (s *Server) owns(slot int) bool {
	me := s.Do("CLUSTER", "MYID").(string)
	for _, r := range s.Do("CLUSTER", "SLOTS").([]any) {
		r := r.([]any)
		if int(r[0].(int64)) <= slot && slot <= int(r[1].(int64)) {
			return r[2].([]any)[2].(string) == me
		}
	}
	return false
}

// MoveSlot migrates slot from one node to another, as redis-cli --cluster reshard does:
// IMPORTING on the target, MIGRATING on the source, MIGRATE the keys in batches of batch keys
// (calling between after each batch, so a test can act mid-migration), then SETSLOT NODE on
// every node. Clients meet ASK redirections during the migration and MOVED after it.
func (c *Cluster) MoveSlot(slot int, from, to *Server, batch int, between func()) {
	c.t.Helper()
	fromID, toID := from.Do("CLUSTER", "MYID"), to.Do("CLUSTER", "MYID")
	to.Do("CLUSTER", "SETSLOT", slot, "IMPORTING", fromID)
	from.Do("CLUSTER", "SETSLOT", slot, "MIGRATING", toID)
	host, port := splitAddr(c.t, to.Addr)
	for {
		keys := from.Do("CLUSTER", "GETKEYSINSLOT", slot, batch).([]any)
		if len(keys) == 0 {
			break
		}
		args := []any{"MIGRATE", host, port, "", 0, 5000, "KEYS"}
		args = append(args, keys...)
		from.Do(args...)
		if between != nil {
			between()
		}
	}
	for _, s := range []*Server{to, from} {
		s.Do("CLUSTER", "SETSLOT", slot, "NODE", toID)
	}
	for _, s := range c.Nodes {
		if s != to && s != from {
			s.Do("CLUSTER", "SETSLOT", slot, "NODE", toID)
		}
	}
	c.waitConsistent()
}

// waitConsistent waits until every node reports cluster_state:ok, knows every node, and has
// the same slot map (the config epochs have converged).
func (c *Cluster) waitConsistent() {
	c.t.Helper()
	deadline := time.Now().Add(startDeadline)
	var why string
	for time.Now().Before(deadline) {
		why = c.inconsistency()
		if why == "" {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.t.Fatalf("the cluster did not converge within %v: %s", startDeadline, why)
}

// inconsistency says why the cluster is not yet consistent, or "" when it is.
func (c *Cluster) inconsistency() string {
	var first string
	for i, s := range c.Nodes {
		cl := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1})
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		info, err := cl.ClusterInfo(ctx).Result()
		var shards []redis.ClusterShard
		if err == nil {
			shards, err = cl.ClusterShards(ctx).Result()
		}
		cancel()
		_ = cl.Close()
		if err != nil {
			return fmt.Sprintf("node %s: %v", s.Addr, err)
		}
		if !strings.Contains(info, "cluster_state:ok") {
			return fmt.Sprintf("node %s: cluster_state is not ok", s.Addr)
		}
		if !strings.Contains(info, "cluster_known_nodes:"+strconv.Itoa(len(c.Nodes))+"\r") {
			return fmt.Sprintf("node %s does not know every node yet", s.Addr)
		}
		m := slotMap(shards)
		if i == 0 {
			first = m
		} else if m != first {
			return fmt.Sprintf("node %s has another slot map", s.Addr)
		}
	}
	return ""
}

// slotMap renders a CLUSTER SHARDS reply as "lo-hi=addr" ranges (addr: the primary of the
// range's shard), sorted by lo.
func slotMap(shards []redis.ClusterShard) string {
	byStart := make(map[int64]string)
	for _, sh := range shards {
		primary := "none"
		for _, n := range sh.Nodes {
			if n.Role == "master" {
				primary = net.JoinHostPort(n.IP, strconv.FormatInt(n.Port, 10))
			}
		}
		for _, r := range sh.Slots {
			byStart[r.Start] = fmt.Sprintf("%d-%d=%s", r.Start, r.End, primary)
		}
	}
	var b strings.Builder
	for lo := int64(0); lo < clusterSlots; lo++ {
		if r, ok := byStart[lo]; ok {
			b.WriteString(r)
			b.WriteByte(' ')
		}
	}
	return b.String()
}

func splitAddr(t testing.TB, addr string) (string, int) {
	t.Helper()
	i := strings.LastIndexByte(addr, ':')
	port, err := strconv.Atoi(addr[i+1:])
	if i < 0 || err != nil {
		t.Fatalf("bad address %q", addr)
	}
	return addr[:i], port
}
