#!/usr/bin/env bash
# `make run`: bin/caddy with Caddyfile.example against the Redis at 127.0.0.1:6379, starting a
# throwaway redis-server there (no persistence, stopped on exit) when none answers.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-redis.sh
redis_pid=""
if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
	echo "using the Redis already answering on 127.0.0.1:6379"
else
	echo "starting a throwaway redis-server on 127.0.0.1:6379 (no persistence; stopped when Caddy stops)"
	redis-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no --loglevel warning >/dev/null &
	redis_pid=$!
	trap 'kill $redis_pid 2>/dev/null || true' EXIT
	for _ in $(seq 50); do
		redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break
		sleep 0.1
	done
fi
cat <<'MSG'

Caddy is starting on http://localhost:8080. In another terminal:
    curl -i localhost:8080/                       # allowed: X-RateLimit-* and RateLimit headers
    for i in $(seq 7); do curl -s -o /dev/null -w '%{http_code}\n' localhost:8080/; done
                                                  # 5 burst, then 429 with Retry-After
    curl -i localhost:8080/ -H 'X-API-Key: alice' # another client, its own bucket
    curl -i localhost:8080/login                  # the login zone: 3 per minute
Press Ctrl-C to stop.

MSG
bin/caddy run --config Caddyfile.example --adapter caddyfile
