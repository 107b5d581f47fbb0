#!/usr/bin/env bash
# `make run`: bin/caddy with Caddyfile.example against the Redis at 127.0.0.1:6379, starting a
# throwaway redis-server there (no persistence, stopped on exit) when none answers. Once Caddy
# is up it prints the curl commands that show the limit at work.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-redis.sh
redis_pid=""
caddy_pid=""
cleanup() {
	if [ -n "$caddy_pid" ]; then kill "$caddy_pid" 2>/dev/null || true; wait "$caddy_pid" 2>/dev/null || true; fi
	if [ -n "$redis_pid" ]; then kill "$redis_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
	echo "using the Redis already answering on 127.0.0.1:6379"
else
	echo "starting a throwaway redis-server on 127.0.0.1:6379 (no persistence; stopped when Caddy stops)"
	redis-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no --loglevel warning >/dev/null &
	redis_pid=$!
	for _ in $(seq 50); do
		redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break
		sleep 0.1
	done
fi

bin/caddy run --config Caddyfile.example --adapter caddyfile &
caddy_pid=$!
# Up when the admin endpoint answers: asking the site would take a token.
for _ in $(seq 100); do
	kill -0 "$caddy_pid" 2>/dev/null || { wait "$caddy_pid" || exit $?; exit 1; }
	if command -v curl >/dev/null 2>&1; then
		curl -s -o /dev/null localhost:2019/config/ && break
	else
		redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && sleep 1 && break
	fi
	sleep 0.1
done

cat <<'MSG'

Caddy is up on http://localhost:8080 (Caddyfile.example: zone api, a burst of 5 then one request
every 10s per API key or IP; zone ip, a burst of 40 then one every 2s per IP whatever its keys;
zone login, 3 per minute per IP on /login and /login/*). In another terminal:

  # allowed: 200 with X-RateLimit-Limit/-Remaining/-Reset, RateLimit-Policy and RateLimit
  curl -i localhost:8080/

  # limited: the burst, then 429 with Retry-After (the JSON body is handle_errors')
  for i in $(seq 7); do curl -s -o /dev/null -w '%{http_code} ' localhost:8080/; done; echo
  curl -i localhost:8080/

  # just the rate limit headers
  curl -s -D - -o /dev/null localhost:8080/ | grep -iE '^(x-)?ratelimit|^retry-after'

  # another client (its API key) has its own bucket; /login allows 3 per minute per IP
  curl -i localhost:8080/ -H 'X-API-Key: alice'
  for i in $(seq 4); do curl -s -o /dev/null -w '%{http_code} ' localhost:8080/login -H 'X-API-Key: bob'; done; echo

  # the decisions counted, by zone and result (Caddy's admin endpoint)
  curl -s localhost:2019/metrics | grep '^caddy_rate_limit_redis_decisions_total'

Press Ctrl-C to stop.

MSG
wait "$caddy_pid"
