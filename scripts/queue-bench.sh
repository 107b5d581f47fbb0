#!/usr/bin/env bash
# `make bench-queue`: what waiting in a queue costs (docs/queues.md, "What waiting costs").
#
# For each kind of queue in QUEUE_KIND ("concurrency fair" by default), one after the other: a
# throwaway redis-server, three instances of bin/caddy (each its own process, Limiter and grant
# subscription) with one site-wide queue of 4 slots (bench/queue.Caddyfile: concurrency, limit
# 4, max_wait 60s) in front of an upstream that holds every request (a Python server that sleeps
# QUEUE_HOLD seconds, 120 by default): 4 requests take the slots, and WAITERS (500) more wait,
# sent by TENANTS (50) tenants (X-Tenant: t<n>), each tenant's requests at once to one of the
# three instances in turn. Once they all wait (the waiters' sorted set holds WAITERS), it
# measures over QUEUE_WINDOW seconds (10): Redis's calls (INFO commandstats: every command, and
# the script calls) and its CPU (INFO used_cpu_sys + used_cpu_user), and each Caddy's CPU (utime
# + stime of /proc/<pid>/stat). Printed per waiter per second, and, when both ran, fair's as a
# ratio of concurrency's. The kinds:
#   concurrency  waiters in arrival order;
#   fair         the same queue with fair_by {http.request.header.X-Tenant};
#   bucket       a token bucket queue (bench/queue-bucket.Caddyfile: capacity 4, refilled at
#                1/s, with priority): the same 4 admitted at once, then a grant a second.
# Everything is stopped at the end of each kind.
set -euo pipefail
cd "$(dirname "$0")/.."
WAITERS=${WAITERS:-500}
TENANTS=${TENANTS:-50}
QUEUE_WINDOW=${QUEUE_WINDOW:-10}
QUEUE_HOLD=${QUEUE_HOLD:-120}
QUEUE_KIND=${QUEUE_KIND:-concurrency fair}
for tool in redis-server redis-cli hey python3; do
	command -v "$tool" >/dev/null || { echo "bench-queue: $tool is not installed"; exit 1; }
done
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
results=$(mktemp -d)
tmp=
pids=()
stop() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	pids=()
	[ -z "$tmp" ] || rm -rf "$tmp"
	tmp=
}
trap 'stop; rm -rf "$results"' EXIT INT TERM

# measure runs one kind and writes its figures to $results/<kind>.
measure() {
	local kind=$1 config fair='' waiters_key extra
	case "$kind" in
	concurrency) config=bench/queue.Caddyfile waiters_key='rl:{upstream}:llm:cc:ql' extra=2 ;;
	fair) config=bench/queue.Caddyfile waiters_key='rl:{upstream}:llm:cc:ql' extra=2 fair='fair_by {http.request.header.X-Tenant}' ;;
	bucket) config=bench/queue-bucket.Caddyfile waiters_key='rl:{upstream}:llm:tb:ql' extra=62 ;; # granted 1/s meanwhile
	*) echo "bench-queue: QUEUE_KIND lists concurrency, fair or bucket, not $kind"; exit 1 ;;
	esac
	tmp=$(mktemp -d)
	local redis_port up_port
	redis_port=$(free_port)
	redis-server --port "$redis_port" --save '' --appendonly no --dir "$tmp" >"$tmp/redis.log" 2>&1 &
	pids+=($!)
	until redis-cli -p "$redis_port" ping >/dev/null 2>&1; do sleep 0.1; done

	up_port=$(free_port)
	python3 -c "
import http.server, socketserver, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep($QUEUE_HOLD); self.send_response(200); self.end_headers(); self.wfile.write(b'ok')
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer): daemon_threads = True
S(('127.0.0.1', $up_port), H).serve_forever()" &
	pids+=($!)

	caddy_pids=()
	local ports=() port i
	for i in 1 2 3; do
		port=$(free_port)
		ports+=("$port")
		BENCH_PORT=$port BENCH_REDIS_ADDR=127.0.0.1:$redis_port BENCH_UPSTREAM=127.0.0.1:$up_port BENCH_FAIR=$fair \
			bin/caddy run --adapter caddyfile --config "$config" >"$tmp/caddy$i.log" 2>&1 &
		pids+=($!)
		caddy_pids+=($!)
	done
	for port in "${ports[@]}"; do
		until curl -s -o /dev/null "http://127.0.0.1:$port/ready"; do sleep 0.1; done
	done

	local per=$(((WAITERS + 4 + extra + TENANTS - 1) / TENANTS))
	for i in $(seq 1 "$TENANTS"); do
		port=${ports[$((i % 3))]}
		hey -n "$per" -c "$per" -t 0 -H "X-Tenant: t$i" "http://127.0.0.1:$port/" >"$tmp/hey$i.log" 2>&1 &
		pids+=($!)
	done
	local deadline=$((SECONDS + 60))
	while [ "$(redis-cli -p "$redis_port" zcard "$waiters_key")" -lt "$WAITERS" ]; do
		[ $SECONDS -lt $deadline ] || { echo "bench-queue: only $(redis-cli -p "$redis_port" zcard "$waiters_key") of $WAITERS waiting after 60s"; for f in "$tmp"/caddy*.log; do tail -n 5 "$f"; done; exit 1; }
		sleep 0.2
	done
	local waiting
	waiting=$(redis-cli -p "$redis_port" zcard "$waiters_key")

	cpu_of() { awk '{print $14 + $15}' "/proc/$1/stat"; } # utime + stime, clock ticks
	redis_stat() { redis-cli -p "$redis_port" info "$1" | tr -d '\r'; }
	calls() { redis_stat commandstats | awk -F'[=,:]' -v c="$1" '$1 == "cmdstat_" c {print $3; f=1} END {if (!f) print 0}'; }
	total() { redis_stat stats | awk -F: '$1 == "total_commands_processed" {print $2}'; }
	rcpu() { redis_stat cpu | awk -F: '$1 == "used_cpu_sys" || $1 == "used_cpu_user" {s += $2} END {print s}'; }
	caddy_cpu() { local s=0 p; for p in "${caddy_pids[@]}"; do s=$((s + $(cpu_of "$p"))); done; echo $s; }

	local e0 t0 r0 c0 e1 t1 r1 c1
	e0=$(($(calls evalsha) + $(calls eval))); t0=$(total); r0=$(rcpu); c0=$(caddy_cpu)
	sleep "$QUEUE_WINDOW"
	e1=$(($(calls evalsha) + $(calls eval))); t1=$(total); r1=$(rcpu); c1=$(caddy_cpu)
	stop
	echo "$kind $waiting $QUEUE_WINDOW $e0 $e1 $t0 $t1 $r0 $r1 $c0 $c1 $(getconf CLK_TCK)" >"$results/$kind"
}

for kind in $QUEUE_KIND; do
	measure "$kind"
done
python3 - "$TENANTS" "$results"/* <<'EOF'
import sys
tenants, runs = sys.argv[1], {}
for path in sys.argv[2:]:
    kind, w, win, e0, e1, t0, t1, r0, r1, c0, c1, tick = open(path).read().split()
    w, win, tick = int(w), float(win), float(tick)
    scripts, cmds = int(e1) - int(e0), int(t1) - int(t0)
    redis_cpu, caddy_cpu = float(r1) - float(r0), (int(c1) - int(c0)) / tick
    runs[kind] = (scripts / win / w, redis_cpu / win / w * 1e6, caddy_cpu / win / w * 1e6)
    print(f"{w} waiters of {tenants} tenants ({kind}) over 3 instances, {win:.0f}s:")
    print(f"  Redis script calls   {scripts} ({scripts / win:.1f}/s; {scripts / win / w:.4f} per waiter per second)")
    print(f"  Redis commands       {cmds} (INFO stats; the measuring's own INFO calls included)")
    print(f"  Redis CPU            {redis_cpu * 1000:.1f} ms ({redis_cpu / win / w * 1e6:.2f} us per waiter per second)")
    print(f"  Caddy CPU (3 procs)  {caddy_cpu * 1000:.0f} ms ({caddy_cpu / win / w * 1e6:.1f} us per waiter per second)")
if "fair" in runs and "concurrency" in runs:
    f, a = runs["fair"], runs["concurrency"]
    ratio = lambda x, y: f"{x / y:.2f}" if y else "n/a"
    print("fair / arrival order, per waiter per second:")
    print(f"  script calls {ratio(f[0], a[0])}, Redis CPU {ratio(f[1], a[1])}, Caddy CPU {ratio(f[2], a[2])}")
EOF
