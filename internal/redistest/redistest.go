// Package redistest starts real redis-server processes for tests, on free loopback ports, and
// stops them when the test ends. Nothing here mocks Redis.
package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
)

// startDeadline bounds how long a server may take to answer PING after it is started, and a
// cluster to converge: long enough for a machine loaded by another test run.
const startDeadline = 30 * time.Second

// Server is a redis-server process started for a test.
type Server struct {
	// Addr is the server's host:port on the loopback interface.
	Addr string

	t        testing.TB
	dir      string
	args     []string
	password string // requirepass, when StartWithPassword started it
	mu       sync.Mutex
	cmd      *exec.Cmd
	done     chan struct{} // closed when cmd has exited
}

// Start starts a redis-server with no persistence on a free loopback port, waits until it
// answers PING, and stops it when the test ends. Extra redis-server arguments may be given
// ("--maxmemory", "10mb"). It fails the test when redis-server is not installed or does not start.
func Start(t testing.TB, extra ...string) *Server {
	t.Helper()
	return startServer(t, "", extra)
}

// StartWithPassword is Start with `requirepass password`: a client must authenticate with the
// password before any other command. The server's own Client, Do and start-up check do.
func StartWithPassword(t testing.TB, password string, extra ...string) *Server {
	t.Helper()
	return startServer(t, password, append([]string{"--requirepass", password}, extra...))
}

func startServer(t testing.TB, password string, extra []string) *Server {
	t.Helper()
	SkipShort(t)
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Fatal("redis-server is not installed: run `make test`, which installs it, or `apt-get install redis-server`")
	}
	s := &Server{t: t, dir: t.TempDir(), password: password}
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		port, err := freePort()
		if err != nil {
			t.Fatalf("finding a free port: %v", err)
		}
		s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		s.args = append([]string{
			"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", s.dir, "--protected-mode", "no", "--loglevel", "warning",
		}, extra...)
		if lastErr = s.start(); lastErr == nil {
			t.Cleanup(s.Stop)
			return s
		}
	}
	t.Fatalf("starting redis-server: %v", lastErr)
	return nil
}

// SkipShort skips the test under `go test -short`, which runs only the tests that need neither
// redis-server nor Caddy. Every start of a redis-server calls it.
func SkipShort(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts redis-server: skipped with -short")
	}
}

// freePort is a free loopback TCP port no other freePort or freeport.Get of this process
// returned (a node's port and its cluster bus port, picked one after the other, once came out
// equal in kind). Another process may take it before redis-server binds it; Start then tries
// again with another.
func freePort() (int, error) {
	return freeport.Get()
}

func (s *Server) start() error {
	cmd := exec.Command("redis-server", append(s.args, "--logfile", s.logFile())...)
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()

	c := redis.NewClient(&redis.Options{Addr: s.Addr, Password: s.password, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer c.Close()
	deadline := time.Now().Add(startDeadline)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-done:
			log, _ := os.ReadFile(s.logFile())
			return fmt.Errorf("redis-server on %s exited during start-up: %w; its log:\n%s", s.Addr, err, log)
		default:
		}
		if time.Now().After(deadline) {
			s.Stop()
			return fmt.Errorf("redis-server on %s did not answer PING within %v: %w", s.Addr, startDeadline, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (s *Server) logFile() string { return filepath.Join(s.dir, "redis.log") }

// Stop kills the server (SIGKILL: state is lost, as in a crash) and waits until it has exited
// and its port is closed. Stopping a stopped server does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-done
}

// Pause stops the server process (SIGSTOP): connections stay open but nothing is answered, as
// with a stalled or partitioned server. Resume undoes it; a paused server is resumed before it
// is stopped when the test ends.
func (s *Server) Pause() { s.signal(syscall.SIGSTOP) }

// Resume continues a paused server (SIGCONT).
func (s *Server) Resume() { s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) {
	s.t.Helper()
	s.mu.Lock()
	cmd := s.cmd
	s.mu.Unlock()
	if cmd == nil {
		s.t.Fatalf("redis-server on %s is not running", s.Addr)
	}
	if err := cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("signalling redis-server on %s: %v", s.Addr, err)
	}
}

// Restart stops the server and starts a fresh one on the same address, with no state and an
// empty script cache, as after a crash.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	var err error
	// The port was just freed; a short retry loop covers a slow kernel release of the socket.
	for deadline := time.Now().Add(startDeadline); ; {
		if err = s.start(); err == nil {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("restarting redis-server on %s: %v", s.Addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Client returns a new go-redis client of the server, closed when the test ends.
func (s *Server) Client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr, Password: s.password})
	s.t.Cleanup(func() { _ = c.Close() })
	return c
}

var scriptCallsRE = regexp.MustCompile(`cmdstat_(?:evalsha|eval):calls=(\d+),.*?rejected_calls=(\d+),failed_calls=(\d+)`)

// ScriptCalls is the number of EVAL and EVALSHA calls the server has seen, refused and failed
// ones included, from INFO commandstats.
func (s *Server) ScriptCalls() int {
	s.t.Helper()
	n := 0
	for _, m := range scriptCallsRE.FindAllStringSubmatch(s.Do("INFO", "commandstats").(string), -1) {
		for _, v := range m[1:] {
			x, _ := strconv.Atoi(v)
			n += x
		}
	}
	return n
}

// Errors is how many error replies of code (TRYAGAIN, NOSCRIPT…) the server has sent, from INFO
// errorstats.
func (s *Server) Errors(code string) int {
	s.t.Helper()
	_, rest, ok := strings.Cut(s.Do("INFO", "errorstats").(string), "errorstat_"+code+":count=")
	if !ok {
		return 0
	}
	n, _ := strconv.Atoi(rest[:strings.IndexAny(rest, ",\r\n")])
	return n
}

// Keys returns every key of the server (KEYS *), failing t on an error.
func (s *Server) Keys(t testing.TB) []string {
	t.Helper()
	keys, err := s.Client().Keys(t.Context(), "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	return keys
}

// Do runs one command on a fresh connection and returns its reply: nil for redis.Nil. Any other
// error fails the test.
func (s *Server) Do(args ...any) any {
	s.t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr, Password: s.password, MaxRetries: -1})
	defer c.Close()
	v, err := c.Do(context.Background(), args...).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		s.t.Fatalf("redis %v: %v", args, err)
	}
	return v
}

// Time is the server's clock, TIME, to the microsecond: the clock the scripts read by default.
// Read before a request is sent and after its reply, it bounds when Redis decided the request,
// whatever this process's clock says.
func (s *Server) Time() time.Time {
	s.t.Helper()
	v, ok := s.Do("TIME").([]any)
	if !ok || len(v) != 2 {
		s.t.Fatalf("redis TIME replied %#v", v)
	}
	sec, err1 := strconv.ParseInt(fmt.Sprint(v[0]), 10, 64)
	usec, err2 := strconv.ParseInt(fmt.Sprint(v[1]), 10, 64)
	if err1 != nil || err2 != nil {
		s.t.Fatalf("redis TIME replied %#v", v)
	}
	return time.UnixMicro(sec*1000000 + usec)
}

// WaitFor polls cond every 10ms until it is true, failing the test with what when it is still
// false after d: a deadline, never a sleep that hopes.
func WaitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// BucketUsed returns the tokens the token bucket at state has used (its "u"), once none of its
// charges is held (no "h"), polling for up to 5 seconds; the test fails when that never comes.
func (s *Server) BucketUsed(t testing.TB, state string) float64 {
	t.Helper()
	var u float64
	WaitFor(t, 5*time.Second, "the charges of "+state+" settled", func() bool {
		m, _ := s.Do("HGETALL", state).(map[any]any)
		_, held := m["h"]
		u, _ = strconv.ParseFloat(fmt.Sprint(m["u"]), 64)
		return m != nil && !held
	})
	return u
}
