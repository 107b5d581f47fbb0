// Package freeport hands out free loopback TCP ports for tests, each at most once per process.
//
// Asking the kernel for port 0 and closing the listener gives a port that was free a moment
// ago, but the next such request may get the very same port back: two sites of one Caddyfile
// given the same port make an "ambiguous site definition", and a Redis Cluster bus port may be
// the port picked next for a node. Get never returns a port it returned before in this process,
// so the ports of one test are distinct, and a port a finished test's server may still be
// closing (Caddy listens with SO_REUSEPORT) is not handed to the next test. Another process may
// still take a port before the test binds it; the servers the tests start fail then, and
// redistest tries again with another port.
package freeport

import (
	"fmt"
	"net"
	"sync"
	"testing"
)

// attempts bounds how many ports the kernel is asked for before Get gives up: each answer is a
// port free at the time, and only the ports given out before (a few hundred in a test binary of
// the ~28000 ephemeral ports) are refused.
const attempts = 100

var (
	mu    sync.Mutex
	given = make(map[int]bool) // the ports Get returned
)

// Get returns a loopback TCP port that was free a moment ago and that Get has not returned
// before in this process.
func Get() (int, error) {
	mu.Lock()
	defer mu.Unlock()
	for range attempts {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		if err := l.Close(); err != nil {
			return 0, err
		}
		if !given[port] {
			given[port] = true
			return port, nil
		}
	}
	return 0, fmt.Errorf("no loopback port not given out before in %d attempts", attempts)
}

// Must is Get for a test: it fails the test if no port is found.
func Must(t testing.TB) int {
	t.Helper()
	port, err := Get()
	if err != nil {
		t.Fatalf("finding a free port: %v", err)
	}
	return port
}
