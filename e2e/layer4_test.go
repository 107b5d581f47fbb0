package e2e_test

import (
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/caddytest"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestConnectionsKilledInstance: two bin/caddy processes (CADDY_BINARY, which `make test` sets)
// with one caddy-l4 concurrency zone of limit 2 and hold_max 3s: A holds both slots with open
// connections, so B refuses; A is killed with SIGKILL, its connections' slots come back within
// hold_max (and a second), and B admits again.
func TestConnectionsKilledInstance(t *testing.T) {
	caddyBin := os.Getenv("CADDY_BINARY")
	if caddyBin == "" {
		t.Skip("CADDY_BINARY is not set: run `make test`, which builds bin/caddy from this checkout and sets it")
	}
	const hold = 3 * time.Second
	echoes := func(t *testing.T, port int) bool { _, ok := caddytest.DialEcho(t, port, ""); return ok }
	srv := redistest.Start(t)
	site := func(port int) string {
		return fmt.Sprintf(`{
	admin off
	persist_config off
	layer4 {
		127.0.0.1:%d {
			route {
				rate_limit_redis {
					redis {
						address %s
					}
					zone ssh {
						algorithm concurrency
						limit 2
						hold_max %s
					}
				}
				echo
			}
		}
	}
}
`, port, srv.Addr, hold)
	}
	portA, portB := freeport.Must(t), freeport.Must(t)
	a := startCaddyProcess(t, caddyBin, site(portA), portA)
	startCaddyProcess(t, caddyBin, site(portB), portB)
	// startCaddyProcess's probe connections each held a slot for a moment: wait until none is
	// held (the client's slots in Redis, zone ssh).
	redistest.WaitFor(t, 5*time.Second, "the probes' slots to come back", func() bool {
		n, _ := srv.Do("ZCARD", "rl:{127.0.0.1}:ssh:cc").(int64)
		return n == 0
	})
	for n := range 2 {
		if !echoes(t, portA) {
			t.Fatalf("A refused connection %d of two against a limit of 2", n+1)
		}
	}
	if echoes(t, portB) {
		t.Fatal("B admitted a third connection open at once against a limit of 2")
	}
	if err := a.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	<-a.exited
	redistest.WaitFor(t, hold+time.Second, "B to admit once A's slots came back", func() bool { return echoes(t, portB) })
	t.Logf("B admitted %v after A's SIGKILL (hold_max %v)", time.Since(killed).Round(10*time.Millisecond), hold)
	if !echoes(t, portB) {
		t.Fatal("B refused a second connection once both slots came back")
	}
	if echoes(t, portB) {
		t.Fatal("B admitted a third connection open at once")
	}
}
