#!/usr/bin/env bash
# scripts/ab.sh: what one Caddy binary costs against another, under the same load, in alternating
# rounds, so that a change to the module can be compared with the build before it.
#
#   scripts/ab.sh <caddy A> <caddy B> [bench/<scenario>.Caddyfile] [bench/<wrk script>.lua]
#
# Defaults: bench/allowed.Caddyfile driven by bench/allowed.lua. One throwaway redis-server serves
# both sides. Each round runs wrk against A, then against B (the order alternates every round),
# with the side not measured stopped (SIGSTOP). For each run it reads utime+stime of that Caddy
# and of Redis from /proc/<pid>/stat and the script calls from INFO commandstats, and prints per
# side the median over the rounds of: requests/s, Caddy CPU µs per request, Redis CPU µs per
# request, script calls per request, and the share of non-2xx answers.
# Settings: AB_ROUNDS (default 6), AB_DURATION (wrk seconds, default 10), AB_THREADS (2),
# AB_CONNECTIONS (32).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: scripts/ab.sh <caddy A> <caddy B> [Caddyfile] [wrk lua]" >&2; exit 2; }
A=$(readlink -f "$1") B=$(readlink -f "$2")
CADDYFILE=$(readlink -f "${3:-bench/allowed.Caddyfile}") LUA=$(readlink -f "${4:-bench/allowed.lua}")
ROUNDS=${AB_ROUNDS:-6} DURATION=${AB_DURATION:-10} THREADS=${AB_THREADS:-2} CONNS=${AB_CONNECTIONS:-32}
command -v wrk >/dev/null || { echo "ab: wrk is not installed (apt-get install wrk)" >&2; exit 1; }

tmp=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	rm -rf "$tmp"
}
trap cleanup EXIT INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
script_calls() {
	redis-cli -p "$redis_port" info commandstats | tr -d '\r' |
		awk -F'[=,:]' '/^cmdstat_(evalsha|eval):/ { n += $3 } END { print n + 0 }'
}
wait_port() {
	for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done
	echo "ab: nothing listens on port $1" >&2; exit 1
}

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
	--dir "$tmp" >"$tmp/redis.log" 2>&1 &
redis_pid=$!
pids+=("$redis_pid")
wait_port "$redis_port"

declare -A port pid
for side in A B; do
	port[$side]=$(free_port)
	BENCH_PORT=${port[$side]} BENCH_REDIS_ADDR=127.0.0.1:$redis_port \
		"${!side}" run --config "$CADDYFILE" --adapter caddyfile >"$tmp/caddy-$side.log" 2>&1 &
	pid[$side]=$!
	pids+=("${pid[$side]}")
	wait_port "${port[$side]}"
done

hz=$(getconf CLK_TCK)
run_side() { # side round: appends "rps caddy_us redis_us calls non2xx" to $tmp/<side>
	local side=$1 other=A
	[ "$side" = A ] && other=B
	kill -STOP "${pid[$other]}"
	kill -CONT "${pid[$side]}"
	local c0 r0 s0 c1 r1 s1 out reqs rps non
	c0=$(cpu_ticks "${pid[$side]}") r0=$(cpu_ticks "$redis_pid") s0=$(script_calls)
	out=$(wrk -t"$THREADS" -c"$CONNS" -d"${DURATION}s" -s "$LUA" "http://127.0.0.1:${port[$side]}/")
	c1=$(cpu_ticks "${pid[$side]}") r1=$(cpu_ticks "$redis_pid") s1=$(script_calls)
	reqs=$(awk '/requests in/ { print $1 }' <<<"$out")
	rps=$(awk '/^Requests\/sec/ { print $2 }' <<<"$out")
	non=$(awk '/Non-2xx/ { print $NF }' <<<"$out")
	awk -v rps="$rps" -v reqs="$reqs" -v c="$((c1 - c0))" -v r="$((r1 - r0))" -v s="$((s1 - s0))" \
		-v non="${non:-0}" -v hz="$hz" 'BEGIN {
			printf "%.0f %.2f %.2f %.4f %.4f\n", rps, c * 1e6 / hz / reqs, r * 1e6 / hz / reqs, s / reqs, non / reqs }' \
		>>"$tmp/$side"
}

for side in A B; do kill -STOP "${pid[$side]}"; done
for side in A B; do # warm-up
	kill -CONT "${pid[$side]}"
	wrk -t"$THREADS" -c"$CONNS" -d2s -s "$LUA" "http://127.0.0.1:${port[$side]}/" >/dev/null
	kill -STOP "${pid[$side]}"
done
for round in $(seq "$ROUNDS"); do
	if [ $((round % 2)) = 1 ]; then run_side A; run_side B; else run_side B; run_side A; fi
done

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo "ab: $(basename "$CADDYFILE") with $(basename "$LUA"), $ROUNDS rounds of ${DURATION}s, wrk -t$THREADS -c$CONNS; medians"
printf '%-4s %10s %16s %16s %10s %8s\n' side req/s 'caddy us/req' 'redis us/req' calls/req non-2xx
for side in A B; do
	printf '%-4s %10s %16s %16s %10s %8s\n' "$side" \
		"$(cut -d' ' -f1 "$tmp/$side" | median)" "$(cut -d' ' -f2 "$tmp/$side" | median)" \
		"$(cut -d' ' -f3 "$tmp/$side" | median)" "$(cut -d' ' -f4 "$tmp/$side" | median)" \
		"$(cut -d' ' -f5 "$tmp/$side" | median)"
done
echo "A = $A"
echo "B = $B"
