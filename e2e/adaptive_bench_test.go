package e2e_test

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/limiter"
	"github.com/rate-limit-redis/caddy-rate-limit-redis/internal/redistest"
)

// cpuTicks is the user and system CPU of process pid so far, in clock ticks (/proc/<pid>/stat
// fields 14 and 15; 100 per second on Linux).
func cpuTicks(tb testing.TB, pid int) int64 {
	tb.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		tb.Fatal(err)
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:])) // fields from 3 on
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return u + s
}

// redisCalls is the script calls Redis has run (EVALSHA and EVAL, INFO commandstats): one per
// round trip of a decision, settlement or queue operation (the commands a script runs inside
// it are no round trip).
func redisCalls(srv *redistest.Server) int64 {
	info := fmt.Sprint(srv.Do("INFO", "commandstats"))
	var n int64
	for _, cmd := range []string{"cmdstat_evalsha:calls=", "cmdstat_eval:calls="} {
		if _, v, ok := strings.Cut(info, cmd); ok {
			c, _ := strconv.ParseInt(v[:strings.IndexByte(v, ',')], 10, 64)
			n += c
		}
	}
	return n
}

// slotRun is what a closed-loop run through three instances cost.
type slotRun struct {
	requests               int
	cpuPerRequest          time.Duration // the three Caddy processes' CPU per request served
	callsPerSecondInstance float64       // Redis script calls per second per instance
}

// measureSlots runs 24 closed-loop clients for d through insts, before up, and measures it.
func measureSlots(b *testing.B, srv *redistest.Server, up *capacityUpstream, insts []*adaptiveInstance, d time.Duration) slotRun {
	b.Helper()
	ticks := func() (n int64) {
		for _, in := range insts {
			n += cpuTicks(b, in.proc.cmd.Process.Pid)
		}
		return n
	}
	start, cpu0, cmd0 := time.Now(), ticks(), redisCalls(srv)
	stop := make(chan struct{})
	wait := closedLoop(24, insts, stop)
	time.Sleep(d)
	close(stop)
	wait()
	cpu, cmds := ticks()-cpu0, redisCalls(srv)-cmd0
	served, _ := up.window(start, time.Now())
	return slotRun{requests: served, cpuPerRequest: time.Duration(cpu) * 10 * time.Millisecond / time.Duration(max(served, 1)),
		callsPerSecondInstance: float64(cmds) / time.Since(start).Seconds() / float64(len(insts))}
}

// settleTime steps the upstream's capacity to c and returns how long until the learnt limit in
// Redis (polled every 20 ms) is within 25% of c × 1.25 (where the controller settles) and stays
// there for a second; at most 15 s.
func settleTime(srv *redistest.Server, up *capacityUpstream, c int) time.Duration {
	key := limiter.StateKey("rl:", &limiter.Zone{Name: "upstream", Algorithm: limiter.AdaptiveConcurrency}, "upstream") + ":ctl"
	target := 1.25 * float64(c)
	up.setCapacity(c)
	start := time.Now()
	var in time.Time // since when the limit has been within the band; zero when it is not
	for time.Since(start) < 15*time.Second {
		e, _ := strconv.ParseFloat(fmt.Sprint(srv.Do("HGET", key, "e")), 64)
		switch {
		case e < 0.75*target || e > 1.25*target:
			in = time.Time{}
		case in.IsZero():
			in = time.Now()
		case time.Since(in) >= time.Second:
			return in.Sub(start)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return 15 * time.Second
}

// BenchmarkAdaptiveConcurrency: three Caddy processes (CADDY_BINARY) with a concurrency zone of
// limit 10, then three with an adaptive_concurrency zone (ceiling 32), each before an upstream of
// 8 places (100 ms a request) with 24 closed-loop clients for 10 s, in the same run: Caddy's CPU
// per request and Redis's script calls per second per instance of each, and their ratio; then the
// adaptive zone's time to settle after the capacity steps 8 → 4 and 4 → 8. `make bench` runs it
// (make bench-adaptive alone).
func BenchmarkAdaptiveConcurrency(b *testing.B) {
	if os.Getenv("CADDY_BINARY") == "" {
		b.Skip("CADDY_BINARY is not set: run `make bench-adaptive`")
	}
	for range b.N {
		srv := redistest.Start(b)
		up, url := startCapacityUpstream(b, 8)
		static := startSlotInstances(b, 3, srv.Addr, url, "concurrency", 10, "open")
		cc := measureSlots(b, srv, up, static, 10*time.Second)
		for _, in := range static {
			_ = in.proc.cmd.Process.Kill()
		}
		adaptive := startSlotInstances(b, 3, srv.Addr, url, "adaptive_concurrency", 32, "open")
		ac := measureSlots(b, srv, up, adaptive, 10*time.Second)
		stop := make(chan struct{})
		wait := closedLoop(24, adaptive, stop)
		time.Sleep(3 * time.Second)
		down, back := settleTime(srv, up, 4), settleTime(srv, up, 8)
		close(stop)
		wait()
		b.ReportMetric(float64(cc.cpuPerRequest.Microseconds()), "cc-cpu-µs/req")
		b.ReportMetric(float64(ac.cpuPerRequest.Microseconds()), "ac-cpu-µs/req")
		b.ReportMetric(float64(ac.cpuPerRequest)/float64(cc.cpuPerRequest), "cpu-ratio")
		b.ReportMetric(cc.callsPerSecondInstance, "cc-redis-calls/s/instance")
		b.ReportMetric(ac.callsPerSecondInstance, "ac-redis-calls/s/instance")
		b.ReportMetric(float64(cc.requests)/10, "cc-req/s")
		b.ReportMetric(float64(ac.requests)/10, "ac-req/s")
		b.ReportMetric(float64(down.Milliseconds()), "settle-8to4-ms")
		b.ReportMetric(float64(back.Milliseconds()), "settle-4to8-ms")
	}
}
