package l4_test

import (
	"bufio"
	"net"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// BenchmarkNewConnections: new connections through caddy-l4 to its echo handler, one at a time
// (dial, a line and its echo, close), with and without rate_limit_redis (a token bucket no
// connection exhausts) before echo, in the same Caddy and the same run: compare the two.
// cpu-ns/conn is this process's CPU (Caddy, the client and go-redis alike) per connection;
// Redis's own CPU is not in it.
func BenchmarkNewConnections(b *testing.B) {
	srv := redistest.Start(b)
	zone := "zone new {\n\t\t\t\t\t\tcapacity 1000000000\n\t\t\t\t\t\trefill_rate 1000000\n\t\t\t\t\t}"
	ports := load(b, []string{"\t\t\t\techo", route(srv.Addr, "\t\t\t\t\ttimeout 2s", zone)})
	for i, name := range []string{"echo", "rate_limit_redis+echo"} {
		b.Run(name, func(b *testing.B) {
			addr := "127.0.0.1:" + strconv.Itoa(ports[i])
			var before syscall.Rusage
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &before)
			for b.Loop() {
				c, err := net.DialTimeout("tcp", addr, 5*time.Second)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := c.Write([]byte("ping\n")); err != nil {
					b.Fatal(err)
				}
				if line, err := bufio.NewReader(c).ReadString('\n'); err != nil || line != "ping\n" {
					b.Fatalf("connection %d: %q, %v; want its echo", b.N, line, err)
				}
				_ = c.Close()
			}
			var after syscall.Rusage
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &after)
			cpu := time.Duration(after.Utime.Nano() + after.Stime.Nano() - before.Utime.Nano() - before.Stime.Nano())
			b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/conn")
		})
	}
}
