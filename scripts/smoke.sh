#!/usr/bin/env bash
# `make smoke`: runs bin/caddy with Caddyfile.example against a throwaway redis-server on a free
# port and checks with curl, as a new user would, that the limit is enforced. The demo and
# Caddy's admin endpoint are on free loopback ports of its own (SITE_ADDRESS and ADMIN_ADDRESS,
# as Caddyfile.example reads them), whatever those variables say in the caller's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-redis.sh
command -v curl >/dev/null || { echo "smoke: curl is needed" >&2; exit 1; }
caddy=${CADDY_BINARY:-bin/caddy}

work=$(mktemp -d)
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(freeport)
site=127.0.0.1:$(freeport)
admin=127.0.0.1:$(freeport)
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

fail() { echo "smoke: FAIL: $*" >&2; echo "--- caddy log"; tail -20 "$work/caddy.log"; exit 1; }
# code prints the status of a request, 000 when there was no answer (curl's exit status is not
# the script's: a refused connection is a failure the checks below name).
code() { curl -s -o /dev/null -w '%{http_code}' "$@" || true; }

REDIS_ADDR=127.0.0.1:$port SITE_ADDRESS=http://$site ADMIN_ADDRESS=$admin XDG_DATA_HOME=$work XDG_CONFIG_HOME=$work \
	"$caddy" run --config Caddyfile.example --adapter caddyfile >"$work/caddy.log" 2>&1 &
caddy_pid=$!
# Up when the admin endpoint answers: asking the site would take a token.
up=""
for _ in $(seq 100); do
	kill -0 "$caddy_pid" 2>/dev/null || fail "Caddy exited at start"
	[ "$(code "$admin/config/")" = 200 ] && { up=1; break; }
	sleep 0.1
done
[ -n "$up" ] || fail "Caddy's admin endpoint $admin did not answer within 10s"

for i in 1 2 3 4 5; do
	c=$(code $site/); [ "$c" = 200 ] || fail "request $i got $c, want 200"
done
resp=$(curl -si $site/ || true)
head -1 <<<"$resp" | grep -q ' 429' || fail "6th request not 429: $resp"
grep -qi '^Retry-After: [0-9]' <<<"$resp" || fail "429 without Retry-After: $resp"
grep -q '"error":"rate limited","zone":"api"' <<<"$resp" || fail "429 body not shaped by handle_errors: $resp"
c=$(code -H 'X-API-Key: alice' $site/); [ "$c" = 200 ] || fail "X-API-Key client got $c, want 200"
for i in 1 2 3; do
	c=$(code -H "X-API-Key: login$i" $site/login); [ "$c" = 200 ] || fail "login $i got $c"
done
c=$(code -H 'X-API-Key: login4' $site/login); [ "$c" = 429 ] || fail "4th login got $c, want 429"

# The admin API: the blocked client's state, a reset, and the client is allowed again. With no
# X-API-Key the api zone's client is its second key candidate, the IP: key 2=127.0.0.1.
state=$(curl -s "$admin/rate_limit_redis/state?zone=api&key=2%3D127.0.0.1" || true)
grep -q '"exists":true' <<<"$state" && grep -q '"remaining":0' <<<"$state" || fail "admin state: $state"
reset=$(curl -s -X DELETE "$admin/rate_limit_redis/state?zone=api&key=2%3D127.0.0.1" || true)
grep -q '"deleted":true' <<<"$reset" || fail "admin reset: $reset"
c=$(code $site/); [ "$c" = 200 ] || fail "request after the reset got $c, want 200"
# The metrics, at Caddy's admin /metrics.
metrics=$(curl -s "$admin/metrics" || true)
grep -q '^caddy_rate_limit_redis_decisions_total{result="denied",zone="api"} 1$' <<<"$metrics" ||
	fail "metrics: no denied decision of zone api: $(echo "$metrics" | grep rate_limit_redis)"
echo "smoke: ok (5 allowed then 429 with Retry-After; API keys separate; login 3/min; admin state and reset; metrics)"
