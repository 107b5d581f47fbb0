#!/usr/bin/env bash
# `make bench`: what rate_limit_redis costs, measured against plain Caddy in the same run.
#
# It starts a throwaway redis-server (no persistence), plain Caddy (bin/caddy-plain: the same Caddy
# version without the module, `respond "ok"`) and Caddy with the module (bin/caddy, the same site
# behind rate_limit_redis), all on free 127.0.0.1 ports with the admin API off, so it can run beside
# `make run`. Everything is stopped on exit, Ctrl-C and errors. wrk drives the load (apt-get
# installs it when missing and we are root). Scenarios, each bench/<name>.Caddyfile:
#   1. allowed     10,000 clients (bench/allowed.lua sets X-Client to a random id per request), one
#                  zone keyed on X-Client with a limit so large that every request is allowed.
#   2. deny flood  one client (bench/flood.lua: a constant X-Client) far over its limit
#                  (capacity 1, refill 1/1h): nearly every module response is a 429; plain answers
#                  200, the baseline.
#   3. 3 zones     as 1, with 3 zones on every request (per client, per IP, per-client sliding
#                  window), all decided by one script call.
#   4. latency     the allowed path at concurrency 1 (wrk -t1 -c1): p50/p99 plain vs module.
#   5. status      as 1, with count_status 401 on the zone: every charge is held at admission and
#                  given back after the 200 by a second script call (settle.lua): the cost of
#                  charging after the response (2 script calls per request expected).
#   6. plans       the zone of 1 with its numbers from placeholders (a map's outputs, bench/
#                  plans.Caddyfile) against the same site with literals (bench/plans-literal.
#                  Caddyfile) in the places of plain and module: what placeholder numbers cost.
#   7. charge      LLM token budgets: bench/charge.Caddyfile (a zone with `charge openai_usage`)
#                  against bench/charge-plain.Caddyfile (plain Caddy), both proxying to the same
#                  upstream (bench/llm-upstream.Caddyfile: bin/caddy-plain answering a 5000-token
#                  JSON completion gzip-compressed); bench/gzip.lua's 10,000 clients accept gzip.
#                  What reading the usage from a compressed body and settling it cost (2 script
#                  calls per request expected).
#   8. pinned      "Redis on its own CPU": the load of 1 with Redis pinned alone on CPU 1 and wrk
#                  and the Caddy being measured on CPU 0 (taskset; the script pins itself to CPU 0
#                  and its children inherit it), so Redis's CPU is out of the ratio, as where
#                  Redis runs elsewhere. Fresh Caddys, each one CPU's Go runtime: plain, the module
#                  (bench/allowed.Caddyfile) and, when ANCHOR_SRC names a clone of
#                  github.com/mholt/caddy-ratelimit (`make bench ANCHOR_SRC=...` builds
#                  bin/caddy-anchor from it), the in-memory anchor (bench/anchor.Caddyfile: the
#                  same zone in process memory, no network). The Caddys not being measured are
#                  stopped (SIGSTOP); the sides alternate within each round (plain, module,
#                  lease, anchor). The lease side is the module with the zone's `lease` (bench/
#                  lease.Caddyfile) under bench/hot.lua's 10 hot clients (checked: >= 0.90 of
#                  plain, <= 0.05 script calls per request). Skipped, saying so, when CPUs 0 and 1
#                  are not both available.
#   allocs         the Go benchmarks BenchmarkServeHTTPAllowed1Zone, ...1ZoneParallel and
#                  ...3Zones (go test -bench -benchmem -benchtime 20000x, a real redis-server):
#                  allocations per allowed request, run after the load (they are not pinned).
# Plain and module runs alternate (plain, module, plain, module, ...) for BENCH_ROUNDS rounds so
# that machine noise hits both alike; every figure is the median of the rounds.
#
# How to read the table:
#   rps            requests per second (wrk "Requests/sec"), median of the rounds
#   ratio          module rps / plain rps (1.00 = no cost; 0.50 = the module halves throughput)
#   p50/p99        latency percentiles from wrk --latency (us, ms, s)
#   calls/req      Redis script calls (EVALSHA + EVAL in INFO commandstats) per request wrk counted;
#                  1.00 means one round trip per request whatever the number of zones; in the deny
#                  flood the deny cache (on by default) answers most denials with no Redis call
#   us/call        Redis CPU time of one script call (commandstats usec / calls over the module's
#                  rounds)
#   non-2xx        plain / module: share of responses that were not 2xx or 3xx, all rounds together;
#                  0 expected on the allowed paths, nearly 100% for the module in the deny flood
# The pinned table (8) has a row per side, figures over that side's rounds:
#   rps, ratio     requests per second (median) and the side's median over plain's
#   p50/p99        as above
#   Caddy us/req   that Caddy's CPU time (utime + stime from /proc/PID/stat, before and after each
#                  round) over the requests it served; in parentheses its multiple of plain's
#   Redis us/dec   Redis's CPU time over the module's rounds per request (one decision each)
#   calls/req      script calls per request, as above (the module only)
#   non-2xx        share of responses that were not 2xx or 3xx (0 expected on every side)
# and below it the share of the module's rounds Redis spent waiting for a CPU (run-queue time from
# /proc/PID/task/*/schedstat): near 0 when CPU 1 is Redis's own; over 5% is a check warning
# (other processes ran on CPU 1, and Redis's delays may time decisions out).
# The allocations table: allocs/op, B/op and ns/op of each benchmark (one op is one allowed
# request through ServeHTTP; ns/op includes the Redis round trip).
# wrk, Caddy and Redis share the machine's CPUs, so these figures are the module's cost on this
# machine under this load, not the capacity of a deployment.
#
# Settings (environment, e.g. `BENCH_ROUNDS=5 BENCH_DURATION=20s make bench`):
#   BENCH_ROUNDS=3 BENCH_DURATION=10s BENCH_WARMUP=2s BENCH_THREADS=2 BENCH_CONNECTIONS=32
#   ANCHOR_SRC (unset: no anchor side in 8; the Makefile builds bin/caddy-anchor from it)
#   BENCH_LOGS (unset: /tmp/rate-limit-bench-logs.<PID>) where the Caddy log of a side that answered
#                  non-2xx is kept, named in its check warning
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${BENCH_ROUNDS:-3}
duration=${BENCH_DURATION:-10s}
warmup=${BENCH_WARMUP:-2s}
threads=${BENCH_THREADS:-2}
connections=${BENCH_CONNECTIONS:-32}

die() { echo "bench: $*" >&2; exit 1; }
say() { echo "bench: $*" >&2; }

[[ $rounds =~ ^[1-9][0-9]*$ ]] || die "BENCH_ROUNDS must be a positive integer, not '$rounds'"
[[ $threads =~ ^[1-9][0-9]*$ ]] || die "BENCH_THREADS must be a positive integer, not '$threads'"
[[ $connections =~ ^[1-9][0-9]*$ ]] || die "BENCH_CONNECTIONS must be a positive integer, not '$connections'"
[ "$connections" -ge "$threads" ] || die "BENCH_CONNECTIONS ($connections) must be at least BENCH_THREADS ($threads)"
[[ $duration =~ ^[1-9][0-9]*[smh]?$ ]] || die "BENCH_DURATION must be a wrk duration such as 10s or 1m, not '$duration'"
[[ $warmup =~ ^[0-9]+[smh]?$ ]] || die "BENCH_WARMUP must be a wrk duration such as 2s (0 for none), not '$warmup'"

for bin in bin/caddy bin/caddy-plain; do
	[ -x "$bin" ] || die "$bin is missing: run \`make bench\`, which builds bin/caddy and bin/caddy-plain"
done
caddy_version=$(bin/caddy version | awk '{ print $1 }')
plain_version=$(bin/caddy-plain version | awk '{ print $1 }')
[ "$caddy_version" = "$plain_version" ] ||
	die "bin/caddy is Caddy $caddy_version but bin/caddy-plain is $plain_version: remove bin/caddy-plain and run \`make bench\`"
if ! command -v wrk >/dev/null 2>&1; then
	if [ "$(id -u)" -ne 0 ]; then
		echo "wrk is not installed. Install the Debian package wrk:" >&2
		echo "    sudo apt-get install wrk" >&2
		exit 1
	fi
	say "installing wrk with apt-get"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq wrk >/dev/null
fi
scripts/ensure-redis.sh

# --- processes -------------------------------------------------------------------------------

work=$(mktemp -d)
bg_pids=()

# stop_pid PID: SIGTERM, then SIGKILL when it is still running after 5 seconds.
stop_pid() {
	local pid=$1 i
	kill "$pid" 2>/dev/null || true
	kill -CONT "$pid" 2>/dev/null || true # a stopped Caddy (scenario 8) handles SIGTERM once continued
	for i in $(seq 50); do
		kill -0 "$pid" 2>/dev/null || break
		[ "$i" -eq 50 ] && kill -9 "$pid" 2>/dev/null
		sleep 0.1
	done
	wait "$pid" 2>/dev/null || true
	forget_pid "$pid"
}

forget_pid() {
	local keep=() p
	for p in "${bg_pids[@]}"; do [ "$p" = "$1" ] || keep+=("$p"); done
	bg_pids=("${keep[@]}")
}

# run_waited OUT COMMAND...: runs the command with its output in OUT, in the background and
# waited for, so that Ctrl-C reaches our INT trap at once. (wrk catches SIGINT and exits 0; a
# foreground wrk would leave bash believing the interrupt was handled.)
run_waited() {
	local out=$1 pid rc=0
	shift
	"$@" >"$out" 2>&1 &
	pid=$!
	bg_pids+=("$pid")
	wait "$pid" || rc=$?
	forget_pid "$pid"
	return "$rc"
}

# keep_log NAME: copies Caddy NAME's log out of $work (removed on exit) into a directory that stays
# (BENCH_LOGS, else /tmp/rate-limit-bench-logs.<this script's PID>), and prints the copy's path: a
# side that answered non-2xx keeps its log, where Caddy wrote each 5xx's error (a decision that
# failed: "rate limiter unavailable (fail_mode closed): <why>").
kept_logs=${BENCH_LOGS:-/tmp/rate-limit-bench-logs.$$}
# It never fails (set -e): a log it cannot copy is reported as not kept.
keep_log() {
	if mkdir -p "$kept_logs" && cp "$work/caddy-$1.log" "$kept_logs/" 2>/dev/null; then
		echo "$kept_logs/caddy-$1.log"
	else
		echo "(not kept: $work/caddy-$1.log could not be copied to $kept_logs)"
	fi
}

cleanup() {
	local rc=$? pid
	trap - EXIT INT TERM
	for pid in "${bg_pids[@]}"; do stop_pid "$pid"; done
	rm -rf "$work"
	exit "$rc"
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT
trap 'say "terminated"; exit 143' TERM

# pick_port: sets picked_port to a port nobody listens on, below Linux's ephemeral range
# (32768+) so that no outgoing connection of wrk or Caddy holds it.
used_ports=" "
pick_port() {
	local p _
	for _ in $(seq 200); do
		p=$((20000 + RANDOM % 12000))
		case $used_ports in *" $p "*) continue ;; esac
		if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
			used_ports+="$p "
			picked_port=$p
			return 0
		fi
	done
	die "no free port found"
}

# http_status PORT [HEADER [PATH]]: the status code of GET PATH (default /) on 127.0.0.1:PORT,
# empty when none answers. HEADER may hold several lines, joined by CR LF.
http_status() {
	local port=$1 header=${2:-} path=${3:-/}
	(
		exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 0
		if [ -n "$header" ]; then header+=$'\r\n'; fi
		printf 'GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sConnection: close\r\n\r\n' "$path" "$header" >&3
		IFS=' ' read -r -t 5 _ code _ <&3 || exit 0
		echo "$code"
	) 2>/dev/null
}

pick_port
redis_port=$picked_port
redis_addr=127.0.0.1:$redis_port
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" \
	--loglevel warning >"$work/redis.log" 2>&1 &
bg_pids+=("$!")
redis_pid=$!
rcli() { redis-cli -h 127.0.0.1 -p "$redis_port" "$@"; }
for _ in $(seq 100); do
	rcli ping >/dev/null 2>&1 && break
	kill -0 "${bg_pids[0]}" 2>/dev/null || { cat "$work/redis.log" >&2; die "redis-server did not start"; }
	sleep 0.1
done
rcli ping >/dev/null 2>&1 || die "redis-server on $redis_addr does not answer"

# start_caddy NAME BINARY CADDYFILE: runs Caddy on a free port, waits until it answers HTTP;
# sets caddy_pid and caddy_port.
start_caddy() {
	local name=$1 binary=$2 caddyfile=$3 sc_port sc_pid _
	pick_port
	sc_port=$picked_port
	BENCH_PORT=$sc_port BENCH_REDIS_ADDR=$redis_addr "$binary" run --config "$caddyfile" --adapter caddyfile \
		>"$work/caddy-$name.log" 2>&1 &
	sc_pid=$!
	bg_pids+=("$sc_pid")
	for _ in $(seq 100); do
		[ -n "$(http_status "$sc_port")" ] && break
		kill -0 "$sc_pid" 2>/dev/null || { tail -20 "$work/caddy-$name.log" >&2; die "$binary did not start with $caddyfile"; }
		sleep 0.1
	done
	[ -n "$(http_status "$sc_port")" ] || { tail -20 "$work/caddy-$name.log" >&2; die "$binary with $caddyfile does not answer on port $sc_port"; }
	caddy_pid=$sc_pid
	caddy_port=$sc_port
}

# --- measuring -------------------------------------------------------------------------------

# script_stats: "<calls> <usec>" of EVALSHA and EVAL from INFO commandstats. (The commands a
# script runs are counted there too, so the other counters say nothing about round trips.)
script_stats() {
	rcli info commandstats | tr -d '\r' | awk -F'[:,=]' '
		$1 ~ /^cmdstat_eval(sha)?(_ro)?$/ { calls += $3; usec += $5 }
		END { printf "%d %d\n", calls, usec }'
}

# parse_wrk FILE: "<rps> <requests> <p50 us> <p99 us> <non-2xx> <socket errors>".
parse_wrk() {
	awk '
		function us(v,   n, u) {
			n = v + 0; u = v; sub(/^[0-9.]+/, "", u)
			if (u == "us") return n
			if (u == "ms") return n * 1e3
			if (u == "s") return n * 1e6
			if (u == "m") return n * 6e7
			if (u == "h") return n * 3.6e9
			return -1
		}
		$1 == "50%" { p50 = us($2) }
		$1 == "99%" { p99 = us($2) }
		/ requests in / { req = $1 }
		/Non-2xx or 3xx responses:/ { non = $NF }
		/Socket errors:/ { gsub(/,/, ""); err = $4 + $6 + $8 + $10 }
		/^Requests\/sec:/ { rps = $2 }
		END {
			if (rps == "" || req == "" || p50 == "" || p99 == "") exit 1
			printf "%s %d %.1f %.1f %d %d\n", rps, req, p50, p99, non, err
		}' "$1"
}

# run_wrk LABEL SCRIPT PORT THREADS CONNECTIONS DURATION: one wrk run; sets wrk_line to
# parse_wrk's line.
run_wrk() {
	local label=$1 script=$2 port=$3 t=$4 c=$5 d=$6 out
	out="$work/wrk-$label.txt"
	if ! run_waited "$out" wrk --latency -t"$t" -c"$c" -d"$d" -s "$script" "http://127.0.0.1:$port/"; then
		cat "$out" >&2
		die "wrk failed ($label)"
	fi
	wrk_line=$(parse_wrk "$out") || { cat "$out" >&2; die "cannot read wrk's output ($label)"; }
}

warm() { # PORT SCRIPT
	[[ $warmup =~ ^0+[smh]?$ ]] && return 0
	run_waited "$work/wrk-warmup.txt" wrk -t"$threads" -c"$connections" -d"$warmup" -s "$2" "http://127.0.0.1:$1/" ||
		{ cat "$work/wrk-warmup.txt" >&2; die "wrk warm-up against port $1 failed"; }
}

# cpu_ticks PID: the process's user + system CPU time so far, in clock ticks (/proc/PID/stat
# fields 14 and 15; CPU time per request is steadier than requests/s on a shared machine).
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
clk_tck=$(getconf CLK_TCK)

# bench_rounds SCENARIO SCRIPT PLAIN_PORT MODULE_PORT THREADS CONNECTIONS MODULE_PID: alternating
# rounds; appends "<rps> <requests> <p50> <p99> <non-2xx> <socket errors> <caddy ticks>" per round
# to $work/SCENARIO.plain and "... <caddy ticks> <script calls> <script usec> <redis ticks>" to
# $work/SCENARIO.module.
bench_rounds() {
	local scenario=$1 script=$2 plain_port=$3 module_port=$4 t=$5 c=$6 module_pid=$7 r line before after c0 r0
	for r in $(seq "$rounds"); do
		c0=$(cpu_ticks "$plain_pid")
		run_wrk "$scenario-plain-$r" "$script" "$plain_port" "$t" "$c" "$duration"
		line=$wrk_line
		echo "$line $(($(cpu_ticks "$plain_pid") - c0))" >>"$work/$scenario.plain"
		say "$(printf '%-9s round %d/%d  plain  %10.0f rps' "$scenario" "$r" "$rounds" "${line%% *}")"

		before=$(script_stats)
		c0=$(cpu_ticks "$module_pid")
		r0=$(cpu_ticks "$redis_pid")
		run_wrk "$scenario-module-$r" "$script" "$module_port" "$t" "$c" "$duration"
		line=$wrk_line
		sleep 0.2 # let the requests still in flight when wrk stopped reach Redis
		after=$(script_stats)
		echo "$line $(($(cpu_ticks "$module_pid") - c0)) $(awk -v b="$before" -v a="$after" 'BEGIN {
			split(b, x, " "); split(a, y, " "); print y[1] - x[1], y[2] - x[2] }') $(($(cpu_ticks "$redis_pid") - r0))" \
			>>"$work/$scenario.module"
		say "$(printf '%-9s round %d/%d  module %10.0f rps' "$scenario" "$r" "$rounds" "${line%% *}")"
		if [ "$scenario" = latency ]; then floor_round; fi
	done
}

# floor_round: the floor of the latency at concurrency 1, measured between its rounds: one
# token bucket decision of decide.lua per EVALSHA, sent straight to the same Redis by
# redis-benchmark -c 1 (10,000 fresh keys, the allowed zone's numbers). Appends its p50 (ms) to
# $work/floor. It runs outside the module's measured window, so its calls are not counted there.
floor_round() {
	local sha
	sha=$(rcli script load "$(cat lua/decide.lua)")
	redis-benchmark -h 127.0.0.1 -p "$redis_port" -c 1 -n 20000 -r 10000 --csv \
		evalsha "$sha" 1 'bench-floor:{__rand_int__}:z:tb' '' '' 0 1 tb 1000000000 1000000000 1 |
		awk -F'"' 'NR == 2 { print $10 }' >>"$work/floor"
}

# scenario NAME CADDYFILE SCRIPT [latency]: runs one module Caddy against the shared plain Caddy.
scenario() {
	local name=$1 caddyfile=$2 script=$3 pid port code
	rcli flushall >/dev/null
	start_caddy "$name" bin/caddy "$caddyfile"
	pid=$caddy_pid
	port=$caddy_port
	# The module must reach Redis and decide: a 200 for the first request of a client, and in
	# the deny flood a 429 for the second.
	code=$(http_status "$port" "X-Client: bench-probe")
	[ "$code" = 200 ] || { tail -20 "$work/caddy-$name.log" >&2; die "$name: probe request got '$code', want 200"; }
	if [ "$name" = flood ]; then
		code=$(http_status "$port" "X-Client: bench-probe")
		[ "$code" = 429 ] || die "$name: second probe request got '$code', want 429"
	fi
	warm "$plain_port" "$script"
	warm "$port" "$script"
	bench_rounds "$name" "$script" "$plain_port" "$port" "$threads" "$connections" "$pid"
	if [ "${4:-}" = latency ]; then
		warm "$plain_port" "$script"
		warm "$port" "$script"
		bench_rounds latency "$script" "$plain_port" "$port" 1 1 "$pid"
	fi
	stop_pid "$pid"
}

# --- scenario 8, pinned: Redis on its own CPU --------------------------------------------------
# Redis alone on CPU 1; this script (so wrk, redis-cli and the Caddys it starts) on CPU 0. Three
# fresh Caddys; only the one being measured runs, the others are stopped (SIGSTOP).

pinned_skip=""      # why scenario 8 does not run, when it does not
anchor_skip=""      # why it has no anchor side, when it has none
pinned_sides=()     # plain module lease [anchor]
pinned_warnings=()  # what pinned_report adds to the checks
declare -A pinned_pid pinned_port
declare -A pinned_script=([plain]=bench/allowed.lua [module]=bench/allowed.lua [lease]=bench/hot.lua [anchor]=bench/allowed.lua)

pinned_check() {
	if ! command -v taskset >/dev/null 2>&1; then
		pinned_skip="taskset is not installed (Debian package util-linux)"
	elif ! taskset -c 0 true 2>/dev/null || ! taskset -c 1 true 2>/dev/null; then
		pinned_skip="it needs CPUs 0 and 1; this machine has $(nproc --all) CPU(s) and taskset cannot use both"
	fi
	local how="make bench ANCHOR_SRC=<path to a clone of github.com/mholt/caddy-ratelimit>"
	if [ -z "${ANCHOR_SRC:-}" ]; then
		anchor_skip="ANCHOR_SRC is not set (to measure it: $how)"
	elif [ ! -f "$ANCHOR_SRC/go.mod" ]; then
		anchor_skip="ANCHOR_SRC=$ANCHOR_SRC has no go.mod (to measure it: $how)"
	elif [ ! -x bin/caddy-anchor ]; then
		anchor_skip="bin/caddy-anchor is missing ($how builds it)"
	elif [ "$(bin/caddy-anchor version | awk '{ print $1 }')" != "$plain_version" ]; then
		anchor_skip="bin/caddy-anchor is not Caddy $plain_version (remove it and run $how)"
	fi
}

# pinned_affinity PID: the CPU lists of all the process's threads, e.g. "0" or "0-1".
pinned_affinity() { taskset -a -pc "$1" | awk '{ print $NF }' | sort -u | paste -sd' '; }

# runq_us PID: how long the process's threads have waited for a CPU so far, in microseconds (field
# 2 of /proc/PID/task/*/schedstat, ns): Redis's, on a CPU of its own, stays near 0. (%.0f: mawk's
# %d stops at 2^31.)
runq_us() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ s += $2 } END { printf "%.0f\n", s / 1000 }'; }

pinned_scenario() {
	if [ -n "$pinned_skip" ]; then
		say "8 pinned: skipped: $pinned_skip"
		return 0
	fi
	local own_cpus redis_cpus side code
	own_cpus=$(taskset -pc $$ | awk '{ print $NF }')
	redis_cpus=$(taskset -pc "$redis_pid" | awk '{ print $NF }')
	taskset -a -pc 1 "$redis_pid" >/dev/null
	taskset -pc 0 $$ >/dev/null
	rcli flushall >/dev/null
	pinned_sides=(plain module lease)
	[ -n "$anchor_skip" ] || pinned_sides+=(anchor)
	[ -z "$anchor_skip" ] || say "8 pinned: no anchor side: $anchor_skip"
	start_caddy pinned-plain bin/caddy-plain bench/plain.Caddyfile
	pinned_pid[plain]=$caddy_pid pinned_port[plain]=$caddy_port
	start_caddy pinned-module bin/caddy bench/allowed.Caddyfile
	pinned_pid[module]=$caddy_pid pinned_port[module]=$caddy_port
	start_caddy pinned-lease bin/caddy bench/lease.Caddyfile
	pinned_pid[lease]=$caddy_pid pinned_port[lease]=$caddy_port
	if [ -z "$anchor_skip" ]; then
		start_caddy pinned-anchor bin/caddy-anchor bench/anchor.Caddyfile
		pinned_pid[anchor]=$caddy_pid pinned_port[anchor]=$caddy_port
	fi
	for side in "${pinned_sides[@]}"; do
		code=$(http_status "${pinned_port[$side]}" "X-Client: bench-probe")
		[ "$code" = 200 ] || { tail -20 "$work/caddy-pinned-$side.log" >&2; die "8 pinned: $side's probe request got '$code', want 200"; }
		kill -STOP "${pinned_pid[$side]}"
	done
	for side in "${pinned_sides[@]}"; do
		kill -CONT "${pinned_pid[$side]}"
		warm "${pinned_port[$side]}" "${pinned_script[$side]}"
		kill -STOP "${pinned_pid[$side]}"
		[ "$(pinned_affinity "${pinned_pid[$side]}")" = 0 ] ||
			pinned_warnings+=("8 pinned: $side Caddy runs on CPUs $(pinned_affinity "${pinned_pid[$side]}"), want 0")
	done
	[ "$(pinned_affinity "$redis_pid")" = 1 ] ||
		pinned_warnings+=("8 pinned: Redis runs on CPUs $(pinned_affinity "$redis_pid"), want 1")
	pinned_rounds
	for side in "${pinned_sides[@]}"; do
		kill -CONT "${pinned_pid[$side]}"
		stop_pid "${pinned_pid[$side]}"
	done
	taskset -pc "$own_cpus" $$ >/dev/null
	taskset -a -pc "$redis_cpus" "$redis_pid" >/dev/null
}

# pinned_rounds: BENCH_ROUNDS rounds, each measuring every side in turn with the others stopped;
# appends "<rps> <requests> <p50> <p99> <non-2xx> <socket errors> <caddy ticks> <script calls>
# <script usec> <redis ticks> <redis run-queue us> <wall us>" per round to $work/pinned.SIDE.
pinned_rounds() {
	local r side pid before after c0 r0 q0 t0 line
	for r in $(seq "$rounds"); do
		for side in "${pinned_sides[@]}"; do
			pid=${pinned_pid[$side]}
			kill -CONT "$pid"
			before=$(script_stats)
			c0=$(cpu_ticks "$pid")
			r0=$(cpu_ticks "$redis_pid")
			q0=$(runq_us "$redis_pid")
			t0=$(($(date +%s%N) / 1000))
			run_wrk "pinned-$side-$r" "${pinned_script[$side]}" "${pinned_port[$side]}" "$threads" "$connections" "$duration"
			line=$wrk_line
			sleep 0.2 # let the requests still in flight when wrk stopped reach Redis
			after=$(script_stats)
			echo "$line $(($(cpu_ticks "$pid") - c0)) $(awk -v b="$before" -v a="$after" 'BEGIN {
				split(b, x, " "); split(a, y, " "); print y[1] - x[1], y[2] - x[2] }') $(($(cpu_ticks "$redis_pid") - r0))" \
				"$(($(runq_us "$redis_pid") - q0)) $(($(date +%s%N) / 1000 - t0))" >>"$work/pinned.$side"
			kill -STOP "$pid"
			say "$(printf '%-9s round %d/%d  %-6s %10.0f rps' pinned "$r" "$rounds" "$side" "${line%% *}")"
		done
	done
}

# pinned_report: scenario 8's table (see the header), and its checks.
pinned_report() {
	echo "8 Redis on its own CPU: Redis alone on CPU 1; wrk and the Caddy being measured on CPU 0, the"
	echo "  other Caddys stopped; 10,000 clients (lease: 10 hot ones), every request allowed (wrk -t$threads -c$connections, medians of $rounds rounds):"
	if [ -n "$pinned_skip" ]; then
		echo "    skipped: $pinned_skip"
		return 0
	fi
	local format='%-20s %10s %6s %17s %16s %13s %10s %8s\n' side f prps pcpu rps req cpu calls non errs r
	warnings+=(${pinned_warnings[@]+"${pinned_warnings[@]}"})
	# shellcheck disable=SC2059 # format is the table's format
	printf "    $format" side rps ratio p50/p99 "Caddy us/req" "Redis us/dec" calls/req non-2xx
	f=$work/pinned.plain
	prps=$(col "$f" 1)
	pcpu=$(us_per "$(total "$f" 7)" "$(total "$f" 2)")
	for side in "${pinned_sides[@]}"; do
		f=$work/pinned.$side
		rps=$(col "$f" 1)
		req=$(total "$f" 2)
		cpu=$(us_per "$(total "$f" 7)" "$req")
		calls=$(total "$f" 8)
		non=$(total "$f" 5)
		errs=$(total "$f" 6)
		# shellcheck disable=SC2059
		printf "    $format" "$(pinned_label "$side")" "$(printf '%.0f' "$rps")" "$(ratio "$rps" "$prps")" \
			"$(dur "$(col "$f" 3)")/$(dur "$(col "$f" 4)")" \
			"$cpu ($(ratio "$cpu" "$pcpu")x)" \
			"$([ "$side" = module ] || [ "$side" = lease ] && us_per "$(total "$f" 10)" "$req" || echo -)" \
			"$([ "$side" = module ] || [ "$side" = lease ] && per "$calls" "$req" || echo -)" "$(share "$non" "$req")"
		[ "$non" -eq 0 ] || warnings+=("8 pinned: $side answered $non non-2xx responses of $req (want 0); its Caddy log: $(keep_log "pinned-$side")")
		[ "$errs" -eq 0 ] || warnings+=("8 pinned: wrk reported $errs socket errors against $side")
		if [ "$side" = module ]; then
			awk -v c="$(per "$calls" "$req")" 'BEGIN { exit !(c > 0 && c <= 1.01) }' ||
				warnings+=("8 pinned: $(per "$calls" "$req") script calls per request, expected at most 1")
		fi
		if [ "$side" = lease ]; then
			awk -v c="$(per "$calls" "$req")" 'BEGIN { exit !(c <= 0.05) }' ||
				warnings+=("8 pinned: lease: $(per "$calls" "$req") script calls per request, expected at most 0.05")
			awk -v r="$(ratio "$rps" "$prps")" 'BEGIN { exit !(r >= 0.90) }' ||
				warnings+=("8 pinned: lease: $(ratio "$rps" "$prps") of plain Caddy, expected at least 0.90")
		fi
	done
	[ -z "$anchor_skip" ] || echo "    (no anchor: $anchor_skip)"
	f=$work/pinned.module
	if [ -r "/proc/self/schedstat" ]; then
		r=$(per "$(total "$f" 11)" "$(total "$f" 12)" %.3f)
		echo "    Redis waited for a CPU $(awk -v r="$r" 'BEGIN { printf "%.1f", 100 * r }')% of the module's rounds (run queue, /proc/PID/task/*/schedstat)"
		awk -v r="$r" 'BEGIN { exit !(r > 0.05) }' &&
			warnings+=("8 pinned: Redis waited for a CPU $(awk -v r="$r" 'BEGIN { printf "%.0f", 100 * r }')% of the module's rounds: CPU 1 was not its own (other processes ran there)")
	fi
	printf '    rounds, %s rps:' "$(IFS=/; echo "${pinned_sides[*]}")"
	for r in $(seq "$rounds"); do
		printf '  %s' "$(for side in "${pinned_sides[@]}"; do awk -v r="$r" 'NR == r { printf "%.0f\n", $1 }' "$work/pinned.$side"; done | paste -sd/)"
	done
	echo
}

pinned_label() {
	case $1 in
	plain) echo "plain Caddy" ;;
	module) echo "module (Redis)" ;;
	lease) echo "lease (10 hot)" ;;
	anchor) echo "anchor (in memory)" ;;
	esac
}

# --- allocations per allowed request: the Go benchmarks ----------------------------------------

alloc_benchmarks_re='ServeHTTPAllowed1Zone$|ServeHTTPAllowed1ZoneParallel$|ServeHTTPAllowed3Zones$|ServeHTTPAllowed3ZonesParallel$'
alloc_benchmarks_names=(ServeHTTPAllowed1Zone ServeHTTPAllowed1ZoneParallel ServeHTTPAllowed3Zones)
alloc_skip=""

alloc_benchmarks() {
	if ! command -v go >/dev/null 2>&1; then
		alloc_skip="go is not on PATH"
		return 0
	fi
	say "allocs: go test -run XXX -bench '$alloc_benchmarks_re' -benchmem -benchtime 20000x ."
	if ! run_waited "$work/allocs.txt" go test -run XXX -bench "$alloc_benchmarks_re" -benchmem -benchtime 20000x .; then
		tail -20 "$work/allocs.txt" >&2
		alloc_skip="go test failed (its output is above)"
	fi
}

alloc_report() {
	echo "allocations per allowed request (go test -run XXX -bench '$alloc_benchmarks_re' -benchmem -benchtime 20000x .):"
	if [ -n "$alloc_skip" ]; then
		echo "    not measured: $alloc_skip"
		warnings+=("allocs: not measured: $alloc_skip")
		return 0
	fi
	local name line a b n
	printf '    %-32s %10s %10s %12s\n' benchmark allocs/op B/op ns/op
	for name in "${alloc_benchmarks_names[@]}"; do
		# "BenchmarkX-2   20000   85000 ns/op   3400 B/op   40 allocs/op"
		line=$(awk -v n="Benchmark$name" '$1 == n || index($1, n "-") == 1 {
			for (i = 2; i < NF; i++) v[$(i + 1)] = $i
			print v["allocs/op"], v["B/op"], v["ns/op"]; exit }' "$work/allocs.txt")
		if [ -z "$line" ]; then
			printf '    %-32s %10s\n' "$name" "missing"
			warnings+=("allocs: Benchmark$name is not in this tree's handler_bench_test.go")
			continue
		fi
		read -r a b n <<<"$line"
		printf '    %-32s %10s %10s %12s\n' "$name" "$a" "$b" "$n"
	done
}

# --- the run ---------------------------------------------------------------------------------

seconds() { # a wrk duration in seconds, for the estimate
	local v=${1%[smh]}
	case $1 in *m) echo $((v * 60)) ;; *h) echo $((v * 3600)) ;; *) echo "$v" ;; esac
}
estimate=$(($(seconds "$duration") * rounds * 12 + $(seconds "$warmup") * 12))
pinned_check
[ -n "$pinned_skip" ] || estimate=$((estimate + ($(seconds "$duration") * rounds + $(seconds "$warmup")) * 4))
say "rounds=$rounds duration=$duration warmup=$warmup threads=$threads connections=$connections;" \
	"about $(((estimate + 59) / 60)) min"

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start_caddy plain bin/caddy-plain bench/plain.Caddyfile
plain_pid=$caddy_pid
plain_port=$caddy_port
scenario allowed bench/allowed.Caddyfile bench/allowed.lua latency
scenario flood bench/flood.Caddyfile bench/flood.lua
scenario multizone bench/multizone.Caddyfile bench/allowed.lua
scenario status bench/count_status.Caddyfile bench/allowed.lua

# Scenario 6, plans: the module with placeholder numbers against the module with literals (the
# same site and map), in the places of plain and module: the ratio is what placeholders cost.
plans_scenario() {
	local lit_pid lit_port pl_pid pl_port saved=$plain_pid
	rcli flushall >/dev/null
	start_caddy plans-literal bin/caddy bench/plans-literal.Caddyfile
	lit_pid=$caddy_pid
	lit_port=$caddy_port
	start_caddy plans bin/caddy bench/plans.Caddyfile
	pl_pid=$caddy_pid
	pl_port=$caddy_port
	warm "$lit_port" bench/allowed.lua
	warm "$pl_port" bench/allowed.lua
	plain_pid=$lit_pid
	bench_rounds plans bench/allowed.lua "$lit_port" "$pl_port" "$threads" "$connections" "$pl_pid"
	plain_pid=$saved
	stop_pid "$pl_pid"
	stop_pid "$lit_pid"
}
plans_scenario

# Scenario 7, charge: the module charging openai_usage in front of a gzip-answering JSON upstream
# against plain Caddy in front of the same upstream, in the places of plain and module.
charge_scenario() {
	local up_pid pp_pid pp_port m_pid m_port saved=$plain_pid u code
	mkdir -p "$work/llm"
	# A completion of about 3 kB of word-like text (it compresses as prose does, about 2:1), its
	# usage last, and its gzip for file_server's precompressed.
	awk 'BEGIN { srand(7); printf "{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\""
		for (i = 0; i < 500; i++) { n = 2 + int(rand() * 7); for (j = 0; j < n; j++) printf "%c", 97 + int(rand() * 26); printf " " }
		printf "\"},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":1000,\"completion_tokens\":4000,\"total_tokens\":5000}}" }' \
		>"$work/llm/chat.json"
	gzip -k -9 "$work/llm/chat.json"
	rcli flushall >/dev/null
	export BENCH_ROOT=$work/llm
	start_caddy llm-upstream bin/caddy-plain bench/llm-upstream.Caddyfile
	up_pid=$caddy_pid
	export BENCH_UPSTREAM=127.0.0.1:$caddy_port
	start_caddy charge-plain bin/caddy-plain bench/charge-plain.Caddyfile
	pp_pid=$caddy_pid
	pp_port=$caddy_port
	start_caddy charge bin/caddy bench/charge.Caddyfile
	m_pid=$caddy_pid
	m_port=$caddy_port
	# The module must read the usage through gzip: the probe's bucket is charged 5000 (drained
	# at 3171 tokens/s: more than 1000 for a second), not the reservation (500) nor `missing`.
	code=$(http_status "$m_port" $'X-Client: bench-probe\r\nAccept-Encoding: gzip' /chat.json)
	[ "$code" = 200 ] || { tail -20 "$work/caddy-charge.log" >&2; die "charge: probe request got '$code', want 200"; }
	for _ in $(seq 20); do
		u=$(rcli hget 'rl:{bench-probe}:llm:tb' u)
		awk -v u="$u" 'BEGIN { exit !(u > 1000 && u <= 5000) }' && break
		sleep 0.02
	done
	awk -v u="$u" 'BEGIN { exit !(u > 1000 && u <= 5000) }' ||
		die "charge: the probe's bucket holds '$u' used tokens, want the usage of the gzip body (5000, less its refill)"
	warm "$pp_port" bench/gzip.lua
	warm "$m_port" bench/gzip.lua
	plain_pid=$pp_pid
	bench_rounds charge bench/gzip.lua "$pp_port" "$m_port" "$threads" "$connections" "$m_pid"
	plain_pid=$saved
	stop_pid "$m_pid"
	stop_pid "$pp_pid"
	stop_pid "$up_pid"
}
charge_scenario
stop_pid "$plain_pid"
pinned_scenario
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
alloc_benchmarks

# --- the report ------------------------------------------------------------------------------

# col FILE N: median of column N over the rounds in FILE.
col() {
	awk -v n="$2" '{ print $n }' "$1" | sort -g | awk '
		{ a[NR] = $1 }
		END { if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}
# total FILE N: sum of column N.
total() { awk -v n="$2" '{ s += $n } END { printf "%d\n", s }' "$1"; }
# dur MICROSECONDS: 850us, 1.23ms, 2.05s.
dur() {
	awk -v v="$1" 'BEGIN {
		a = v < 0 ? -v : v; s = v < 0 ? "-" : ""
		if (a < 1000) printf "%s%.0fus", s, a
		else if (a < 1e6) printf "%s%.2fms", s, a / 1e3
		else printf "%s%.2fs", s, a / 1e6 }'
}
share() { # NON2XX REQUESTS
	awk -v n="$1" -v r="$2" 'BEGIN { if (n == 0) print "0"; else printf "%.2f%%\n", 100 * n / r }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f\n", a / b; else print "-" }'; }
# per A B [FORMAT]: A/B, "-" when B is 0; "<0.001" for a small non-zero ratio in the default format.
per() {
	awk -v a="$1" -v b="$2" -v f="${3:-}" 'BEGIN {
		if (b <= 0) print "-"
		else if (f != "") printf f "\n", a / b
		else if (a > 0 && a / b < 0.001) print "<0.001"
		else printf "%.3f\n", a / b }'
}

warnings=()
row_format='%-22s %10s %10s %6s %17s %17s %9s %8s %21s\n'
cpu_format='%-22s %18s %6s %15s %10s\n'
# us_per TICKS COUNT: CPU microseconds per unit.
us_per() { awk -v t="$1" -v n="$2" -v h="$clk_tck" 'BEGIN { if (n > 0) printf "%.1f\n", t * 1e6 / h / n; else print "-" }'; }
cpu_row() { # SCENARIO LABEL: Caddy CPU per request, Redis CPU per decision, decisions per call
	local p=$work/$1.plain m=$work/$1.module preq mreq pcpu mcpu
	preq=$(total "$p" 2)
	mreq=$(total "$m" 2)
	pcpu=$(us_per "$(total "$p" 7)" "$preq")
	mcpu=$(us_per "$(total "$m" 7)" "$mreq")
	# shellcheck disable=SC2059 # cpu_format is the table's format
	printf "$cpu_format" "$2" "$pcpu / $mcpu" "$(ratio "$mcpu" "$pcpu")" \
		"$(us_per "$(total "$m" 10)" "$mreq")" "$(per "$mreq" "$(total "$m" 8)" %.1f)"
}
table_row() { # SCENARIO LABEL
	local s=$1 label=$2 p=$work/$1.plain m=$work/$1.module
	local prps mrps calls usec cpr
	prps=$(col "$p" 1)
	mrps=$(col "$m" 1)
	calls=$(total "$m" 8)
	usec=$(total "$m" 9)
	cpr=$(per "$calls" "$(total "$m" 2)")
	# shellcheck disable=SC2059 # row_format is the table's format
	printf "$row_format" "$label" \
		"$(printf '%.0f' "$prps")" "$(printf '%.0f' "$mrps")" "$(ratio "$mrps" "$prps")" \
		"$(dur "$(col "$p" 3)")/$(dur "$(col "$p" 4)")" "$(dur "$(col "$m" 3)")/$(dur "$(col "$m" 4)")" \
		"$cpr" "$(per "$usec" "$calls" %.2f)" \
		"$(share "$(total "$p" 5)" "$(total "$p" 2)") / $(share "$(total "$m" 5)" "$(total "$m" 2)")"
	# what to check
	local pnon mnon mreq errs
	pnon=$(total "$p" 5)
	mnon=$(total "$m" 5)
	mreq=$(total "$m" 2)
	errs=$(($(total "$p" 6) + $(total "$m" 6)))
	[ "$pnon" -eq 0 ] || warnings+=("$s: plain Caddy answered $pnon non-2xx responses")
	if [ "$s" = flood ]; then
		awk -v n="$mnon" -v r="$mreq" 'BEGIN { exit !(n >= 0.99 * r) }' ||
			warnings+=("$s: only $mnon of $mreq module responses were non-2xx (want nearly all)")
	elif [ "$mnon" -ne 0 ]; then
		warnings+=("$s: the module answered $mnon non-2xx responses of $mreq (want 0); its Caddy log: $(keep_log "$s")")
	fi
	[ "$errs" -eq 0 ] || warnings+=("$s: wrk reported $errs socket errors (connect/read/write/timeout)")
	if [ "$s" = status ] || [ "$s" = charge ]; then
		awk -v c="$cpr" 'BEGIN { exit !(c > 0 && c <= 2.01) }' ||
			warnings+=("$s: $cpr script calls per request, expected at most 2 (a decision and a settlement)")
	elif [ "$s" != flood ]; then
		awk -v c="$cpr" 'BEGIN { exit !(c > 0 && c <= 1.01) }' ||
			warnings+=("$s: $cpr script calls per request, expected at most 1 (batches share calls)")
	fi
}

rounds_line() { # SCENARIO: per-round rps and ratio, to judge the noise
	awk 'NR == FNR { p[FNR] = $1; next }
		{ printf "%s%.0f/%.0f=%.2f", (FNR > 1 ? "  " : ""), p[FNR], $1, $1 / p[FNR] }
		END { print "" }' "$work/$1.plain" "$work/$1.module"
}

cpu=$(awk -F': *' '/^model name/ { print $2; exit }' /proc/cpuinfo)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then commit+=" + uncommitted changes"; fi

echo
echo "rate_limit_redis vs plain Caddy $plain_version, medians of $rounds alternating rounds of $duration"
echo "(wrk --latency -t$threads -c$connections; latency row -t1 -c1; ratio = module/plain)"
echo
# shellcheck disable=SC2059 # row_format is the table's format
printf "$row_format" scenario "plain rps" "module rps" ratio "plain p50/p99" "module p50/p99" calls/req us/call "non-2xx plain/module"
table_row allowed "1 allowed, 10k clients"
table_row flood "2 deny flood, 1 client"
table_row multizone "3 allowed, 3 zones"
table_row status "5 count_status, 10k"
table_row charge "7 charge gzip JSON"
echo
echo "CPU from /proc/PID/stat (utime + stime) over all rounds:"
# shellcheck disable=SC2059 # cpu_format is the table's format
printf "$cpu_format" scenario "Caddy us/req p/m" ratio "Redis us/dec" "dec/call"
cpu_row allowed "1 allowed, 10k clients"
cpu_row flood "2 deny flood, 1 client"
cpu_row multizone "3 allowed, 3 zones"
cpu_row status "5 count_status, 10k"
cpu_row charge "7 charge gzip JSON"
cpu_row latency "4 latency, c=1"
echo
lp50=$(col "$work/latency.plain" 3)
lp99=$(col "$work/latency.plain" 4)
mp50=$(col "$work/latency.module" 3)
mp99=$(col "$work/latency.module" 4)
echo "4 latency at concurrency 1 (allowed path, wrk -t1 -c1):"
echo "    plain  p50 $(dur "$lp50")  p99 $(dur "$lp99")   ($(printf '%.0f' "$(col "$work/latency.plain" 1)") rps)"
echo "    module p50 $(dur "$mp50")  p99 $(dur "$mp99")   ($(printf '%.0f' "$(col "$work/latency.module" 1)") rps," \
	"$(per "$(total "$work/latency.module" 8)" "$(total "$work/latency.module" 2)") script calls/req)"
echo "    added  p50 $(dur "$(awk -v a="$mp50" -v b="$lp50" 'BEGIN { print a - b }')")" \
	" p99 $(dur "$(awk -v a="$mp99" -v b="$lp99" 'BEGIN { print a - b }')")"
fp50=$(sort -n "$work/floor" | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] * 1000 }')
echo "    floor  p50 ${fp50}us: one decision by EVALSHA straight to Redis (redis-benchmark -c 1," \
	"between the rounds); the module adds $(awk -v a="$mp50" -v b="$lp50" -v f="$fp50" 'BEGIN { printf "%.0f", a - b - f }')us beyond it"
echo
echo "script usec_per_call (Redis-side time of one call, cmdstat_evalsha over the module's rounds):" \
	"allowed $(per "$(total "$work/allowed.module" 9)" "$(total "$work/allowed.module" 8)" %.2f)us," \
	"3 zones $(per "$(total "$work/multizone.module" 9)" "$(total "$work/multizone.module" 8)" %.2f)us"
echo "script calls / requests, all module rounds:" \
	"allowed $(total "$work/allowed.module" 8)/$(total "$work/allowed.module" 2)," \
	"deny flood $(total "$work/flood.module" 8)/$(total "$work/flood.module" 2)," \
	"3 zones $(total "$work/multizone.module" 8)/$(total "$work/multizone.module" 2)"
echo "6 plans: placeholder numbers (a map's outputs) vs the same zone with literals, same map:" \
	"ratio $(ratio "$(col "$work/plans.module" 1)" "$(col "$work/plans.plain" 1)")," \
	"Caddy CPU us/request literals / placeholders $(us_per "$(total "$work/plans.plain" 7)" "$(total "$work/plans.plain" 2)")" \
	"/ $(us_per "$(total "$work/plans.module" 7)" "$(total "$work/plans.module" 2)")"
echo "rounds, plain/module rps = ratio:"
echo "    allowed    $(rounds_line allowed)"
echo "    deny flood $(rounds_line flood)"
echo "    3 zones    $(rounds_line multizone)"
echo "    status     $(rounds_line status)"
echo "    latency    $(rounds_line latency)"
echo "    plans      $(rounds_line plans) (literals/placeholders)"
echo "    charge     $(rounds_line charge) (plain proxy/charging proxy)"
echo
pinned_report
echo
alloc_report
echo
if [ "${#warnings[@]}" -gt 0 ]; then
	echo "CHECK:"
	printf '    %s\n' "${warnings[@]}"
else
	echo "checks: allowed paths 0 non-2xx, deny flood >= 99% non-2xx, at most 1 script call per allowed request, no socket errors"
fi
echo
echo "machine: $(nproc) CPUs, ${cpu:-unknown CPU}, Linux $(uname -r); wrk, Caddy and Redis share them"
echo "load average (1/5/15 min) before: $load_before, after: $load_after (other work on the machine adds noise)"
echo "versions: $(redis-server --version | awk '{ print $1, $2, $3 }'), $(wrk --version 2>&1 | awk 'NR == 1 { print $1, $2 }'), module at $commit"
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "command: BENCH_ROUNDS=$rounds BENCH_DURATION=$duration BENCH_WARMUP=$warmup BENCH_THREADS=$threads BENCH_CONNECTIONS=$connections make bench${ANCHOR_SRC:+ ANCHOR_SRC=$ANCHOR_SRC}"
