package e2e_test

import (
	"bytes"
	"errors"
	"net/http"
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

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/freeport"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// TestMakeRun runs scripts/run.sh (`make run`) as a user would, with the Caddy of this checkout
// (CADDY_BINARY, which `make test` sets) and the demo and admin endpoint moved to free loopback
// ports (SITE_ADDRESS, ADMIN_ADDRESS). Against a Redis that requires a password it must stop
// within 30 seconds, saying a password is required (none given) or that the password is wrong;
// with the password (REDIS_PASSWORD) it serves Caddyfile.example, and the README's curl loop
// gets 200 five times, then 429. SITE_ADDRESS is given as a newcomer writes it, a host and a
// port without a scheme, which Caddy alone would serve over HTTPS with a local CA: the demo must
// be plain HTTP at the address it prints, and Caddy must not have made a CA.
func TestMakeRun(t *testing.T) {
	caddyBin := os.Getenv("CADDY_BINARY")
	if caddyBin == "" {
		t.Skip("CADDY_BINARY is not set: run `make test`, which builds bin/caddy from this checkout and sets it")
	}
	srv := redistest.StartWithPassword(t, "x")
	site := "127.0.0.1:" + strconv.Itoa(freeport.Must(t))
	data := t.TempDir()
	env := []string{
		"CADDY_BINARY=" + caddyBin, "REDIS_ADDR=" + srv.Addr,
		"SITE_ADDRESS=" + site, "ADMIN_ADDRESS=127.0.0.1:" + strconv.Itoa(freeport.Must(t)),
		"XDG_CONFIG_HOME=" + t.TempDir(), "XDG_DATA_HOME=" + data,
	}

	for _, tc := range []struct{ password, want string }{
		{"", "make run: the Redis at " + srv.Addr + " cannot be used: a password is required (NOAUTH): set REDIS_PASSWORD"},
		{"y", "make run: the Redis at " + srv.Addr + " cannot be used: wrong password: Redis refused REDIS_PASSWORD (WRONGPASS)"},
	} {
		run := startRunScript(t, append(env, "REDIS_PASSWORD="+tc.password))
		select {
		case <-run.done:
		case <-time.After(30 * time.Second):
			t.Fatalf("REDIS_PASSWORD=%q: make run still runs after 30s; its output:\n%s", tc.password, run.output())
		}
		var exit *exec.ExitError
		if !errors.As(run.err, &exit) || !strings.Contains(run.output(), tc.want) {
			t.Fatalf("REDIS_PASSWORD=%q: make run ended with %v, want a failure saying %q; its output:\n%s", tc.password, run.err, tc.want, run.output())
		}
	}

	run := startRunScript(t, append(env, "REDIS_PASSWORD=x"))
	redistest.WaitFor(t, 30*time.Second, "make run to say Caddy is up", func() bool {
		select {
		case <-run.done:
			t.Fatalf("make run ended (%v); its output:\n%s", run.err, run.output())
		default:
		}
		return strings.Contains(run.output(), "Caddy is up on http://"+site)
	})
	var codes []string
	for range 7 {
		resp, err := http.Get("http://" + site + "/")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if d := resp.Header.Get("X-RateLimit-Degraded"); d != "" {
			t.Fatalf("X-RateLimit-Degraded: %s: the limiter failed open; make run's output:\n%s", d, run.output())
		}
		codes = append(codes, strconv.Itoa(resp.StatusCode))
	}
	if got := strings.Join(codes, " "); got != "200 200 200 200 200 429 429" {
		t.Fatalf("the README's curl loop got %s, want 200 200 200 200 200 429 429; make run's output:\n%s", got, run.output())
	}
	if _, err := os.Stat(filepath.Join(data, "caddy", "pki")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Caddy made a local CA (%s/caddy/pki: %v): the demo must be plain HTTP", data, err)
	}
	if !regexp.MustCompile(`using the Redis at ` + regexp.QuoteMeta(srv.Addr) + ` \((Redis|Valkey) \d+\.\d+`).MatchString(run.output()) {
		t.Errorf("make run does not say which Redis it uses; its output:\n%s", run.output())
	}
}

// TestMakeSmoke runs scripts/smoke.sh (`make smoke`, which CI runs) with SITE_ADDRESS and
// ADMIN_ADDRESS exported as a user of `make run` may have them, pointing where nothing answers:
// the smoke test must use addresses of its own and pass.
func TestMakeSmoke(t *testing.T) {
	redistest.SkipShort(t) // smoke.sh starts its own redis-server
	caddyBin := os.Getenv("CADDY_BINARY")
	if caddyBin == "" {
		t.Skip("CADDY_BINARY is not set: run `make test`, which builds bin/caddy from this checkout and sets it")
	}
	nothing := "127.0.0.1:" + strconv.Itoa(freeport.Must(t))
	cmd := exec.Command("scripts/smoke.sh")
	cmd.Env = append(os.Environ(), "CADDY_BINARY="+caddyBin, "SITE_ADDRESS="+nothing, "ADMIN_ADDRESS="+nothing)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "smoke: ok") {
		t.Fatalf("make smoke with SITE_ADDRESS=ADMIN_ADDRESS=%s: %v; its output:\n%s", nothing, err, out)
	}
}

// runScript is scripts/run.sh running in a process group of its own.
type runScript struct {
	cmd  *exec.Cmd
	mu   sync.Mutex
	out  bytes.Buffer
	done chan struct{} // closed when the script has exited; err is then its result
	err  error
}

func (r *runScript) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.out.Write(p)
}

func (r *runScript) output() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.out.String()
}

// startRunScript starts scripts/run.sh with env added to the test's environment; when the test
// ends, the script is sent SIGTERM (it stops Caddy and its Redis) and waited for.
func startRunScript(t *testing.T, env []string) *runScript {
	t.Helper()
	r := &runScript{done: make(chan struct{})}
	r.cmd = exec.Command("scripts/run.sh")
	r.cmd.Env = append(os.Environ(), env...)
	r.cmd.Stdout, r.cmd.Stderr = r, r
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { r.err = r.cmd.Wait(); close(r.done) }()
	t.Cleanup(func() {
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-r.done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL)
			<-r.done
			t.Errorf("make run did not stop within 10s of SIGTERM; killed. Its output:\n%s", r.output())
		}
	})
	return r
}
