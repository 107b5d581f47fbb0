#!/usr/bin/env bash
# `make smoke`: runs bin/caddy with Caddyfile.example against a throwaway redis-server on a free
# port and checks with curl, as a new user would, that the limit is enforced.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-redis.sh
command -v curl >/dev/null || { echo "smoke: curl is needed" >&2; exit 1; }

work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 16379)
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --loglevel warning --dir "$work" >"$work/redis.log" 2>&1 &
redis_pid=$!
caddy_pid=""
cleanup() {
	[ -n "$caddy_pid" ] && kill "$caddy_pid" 2>/dev/null && wait "$caddy_pid" 2>/dev/null
	kill "$redis_pid" 2>/dev/null || true
	rm -rf "$work"
}
trap cleanup EXIT
for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done

REDIS_ADDR=127.0.0.1:$port bin/caddy run --config Caddyfile.example --adapter caddyfile >"$work/caddy.log" 2>&1 &
caddy_pid=$!
for _ in $(seq 100); do curl -s -o /dev/null localhost:8080/ready-check-unused 2>/dev/null && break; sleep 0.1; done
redis-cli -p "$port" flushall >/dev/null # forget the readiness probe

fail() { echo "smoke: FAIL: $*" >&2; echo "--- caddy log"; tail -20 "$work/caddy.log"; exit 1; }
code() { curl -s -o /dev/null -w '%{http_code}' "$@"; }

for i in 1 2 3 4 5; do
	c=$(code localhost:8080/); [ "$c" = 200 ] || fail "request $i got $c, want 200"
done
resp=$(curl -si localhost:8080/)
echo "$resp" | head -1 | grep -q ' 429' || fail "6th request not 429: $resp"
echo "$resp" | grep -qi '^Retry-After: [0-9]' || fail "429 without Retry-After: $resp"
echo "$resp" | grep -q '"error":"rate limited","zone":"api"' || fail "429 body not shaped by handle_errors: $resp"
c=$(code -H 'X-API-Key: alice' localhost:8080/); [ "$c" = 200 ] || fail "X-API-Key client got $c, want 200"
for i in 1 2 3; do
	c=$(code -H "X-API-Key: login$i" localhost:8080/login); [ "$c" = 200 ] || fail "login $i got $c"
done
c=$(code -H 'X-API-Key: login4' localhost:8080/login); [ "$c" = 429 ] || fail "4th login got $c, want 429"

# The admin API: the blocked client's state, a reset, and the client is allowed again. With no
# X-API-Key the api zone's client is its second key candidate, the IP: key 2=127.0.0.1.
state=$(curl -s 'localhost:2019/rate_limit_redis/state?zone=api&key=2%3D127.0.0.1')
echo "$state" | grep -q '"exists":true' && echo "$state" | grep -q '"remaining":0' || fail "admin state: $state"
reset=$(curl -s -X DELETE 'localhost:2019/rate_limit_redis/state?zone=api&key=2%3D127.0.0.1')
echo "$reset" | grep -q '"deleted":true' || fail "admin reset: $reset"
c=$(code localhost:8080/); [ "$c" = 200 ] || fail "request after the reset got $c, want 200"
# The metrics, at Caddy's admin /metrics.
metrics=$(curl -s localhost:2019/metrics)
echo "$metrics" | grep -q '^caddy_rate_limit_redis_decisions_total{result="denied",zone="api"} 1$' ||
	fail "metrics: no denied decision of zone api: $(echo "$metrics" | grep rate_limit_redis)"
echo "smoke: ok (5 allowed then 429 with Retry-After; API keys separate; login 3/min; admin state and reset; metrics)"
