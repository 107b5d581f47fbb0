package redistest

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Sentinels is a primary, one replica and three Sentinels monitoring them, started for a test.
type Sentinels struct {
	// Master is the name the Sentinels know the primary by.
	Master string
	// Primary and Replica are the data servers as started; after a failover Replica is the
	// primary.
	Primary, Replica *Server
	// Sentinels are the three Sentinel processes (quorum 2).
	Sentinels []*Server
}

// StartSentinels starts a primary, a replica of it and three Sentinels with a quorum of 2 that
// consider the primary down after downAfter without an answer. It waits until the replica is in
// sync and every Sentinel knows the replica and the other Sentinels.
func StartSentinels(t testing.TB, downAfter time.Duration) *Sentinels {
	t.Helper()
	ss := &Sentinels{Master: "mymaster"}
	ss.Primary = Start(t)
	host, port := splitAddr(t, ss.Primary.Addr)
	ss.Replica = Start(t, "--replicaof", host, strconv.Itoa(port))
	waitUntil(t, "the replica to sync", func() bool {
		info := ss.Replica.Do("INFO", "replication").(string)
		return strings.Contains(info, "master_link_status:up")
	})
	for i := 0; i < 3; i++ {
		ss.Sentinels = append(ss.Sentinels, startSentinel(t, ss.Master, host, port, downAfter))
	}
	waitUntil(t, "the Sentinels to know the replica and each other", func() bool {
		for _, s := range ss.Sentinels {
			fields := map[string]string{}
			switch m := s.Do("SENTINEL", "MASTER", ss.Master).(type) {
			case map[any]any: // RESP3
				for k, v := range m {
					fields[fmt.Sprint(k)] = fmt.Sprint(v)
				}
			case []any: // RESP2
				for i := 0; i+1 < len(m); i += 2 {
					fields[fmt.Sprint(m[i])] = fmt.Sprint(m[i+1])
				}
			}
			if fields["num-slaves"] != "1" || fields["num-other-sentinels"] != "2" {
				return false
			}
		}
		return true
	})
	return ss
}

// Addrs returns the Sentinels' addresses.
func (ss *Sentinels) Addrs() []string {
	a := make([]string, len(ss.Sentinels))
	for i, s := range ss.Sentinels {
		a[i] = s.Addr
	}
	return a
}

// startSentinel starts a Sentinel monitoring the primary at host:port as master.
func startSentinel(t testing.TB, master, host string, port int, downAfter time.Duration) *Server {
	t.Helper()
	s := &Server{t: t, dir: t.TempDir()}
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		p, err := freePort()
		if err != nil {
			t.Fatalf("finding a free port: %v", err)
		}
		s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
		conf := filepath.Join(s.dir, "sentinel.conf") // Sentinel rewrites it: it must be writable
		text := fmt.Sprintf("port %d\nbind 127.0.0.1\nprotected-mode no\ndir %s\n"+
			"sentinel monitor %s %s %d 2\n"+
			"sentinel down-after-milliseconds %s %d\n"+
			"sentinel failover-timeout %s 10000\n"+
			"sentinel parallel-syncs %s 1\n",
			p, s.dir, master, host, port, master, downAfter.Milliseconds(), master, master)
		if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		s.args = []string{conf, "--sentinel", "--loglevel", "warning"}
		if lastErr = s.start(); lastErr == nil {
			t.Cleanup(s.Stop)
			return s
		}
	}
	t.Fatalf("starting redis-server --sentinel: %v", lastErr)
	return nil
}

func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(startDeadline)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", startDeadline, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
