#!/usr/bin/env bash
# What decide.lua costs Redis, by the number of token bucket decisions in one call: a throwaway
# redis-server on a free loopback port, the script loaded, and for n in NS (default 1 4 8 16 32)
# `redis-benchmark -c 4` sending 200,000/n calls of n decisions of fresh keys. Per n it prints
# Redis's CPU time (utime + stime from /proc/PID/stat) per call and per decision, and the script's
# own time per decision (INFO commandstats, cmdstat_evalsha usec). Noisy on a shared machine:
# compare two scripts by running them in turn, several times (docs/performance.md).
#   scripts/script-cost.sh [SCRIPT]   (default lua/decide.lua; e.g. an older version to compare)
# A script whose zones take 4 arguments (no flags argument: before the layout of
# internal/limiter/call.go gave each zone one) is run with ZONE_ARGS=4.
set -euo pipefail
script=${1:-lua/decide.lua}
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
sha=$(redis-cli -p "$port" script load "$(cat "$script")")
hz=$(getconf CLK_TCK)
printf "%-4s %12s %14s %14s\n" n "CPU us/call" "CPU us/dec" "script us/dec"
for n in ${NS:-1 4 8 16 32}; do
	keys=() args=()
	for i in $(seq "$n"); do
		keys+=("cost:{__rand_int__}$i:z:tb")
		args+=("" 0 1 tb 1000000000 1000000000 1) # nonce, hold, zones, algorithm, capacity, rate, cost
		if [ "${ZONE_ARGS:-5}" = 5 ]; then args+=(""); fi # flags: none
	done
	calls=$((200000 / n))
	redis-cli -p "$port" config resetstat >/dev/null
	t0=$(awk '{ print $14 + $15 }' "/proc/$pid/stat")
	redis-benchmark -p "$port" -c 4 -n "$calls" -r 1000000 -q evalsha "$sha" "$n" "${keys[@]}" "" "${args[@]}" >/dev/null
	t1=$(awk '{ print $14 + $15 }' "/proc/$pid/stat")
	usec=$(redis-cli -p "$port" info commandstats | tr -d '\r' | awk -F'[:,=]' '$1 == "cmdstat_evalsha" { print $5 }')
	awk -v n="$n" -v c="$calls" -v t=$((t1 - t0)) -v hz="$hz" -v us="$usec" \
		'BEGIN { cpu = t / hz * 1e6 / c; printf "%-4d %12.1f %14.2f %14.2f\n", n, cpu, cpu / n, us / c / n }'
done
