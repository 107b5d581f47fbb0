#!/usr/bin/env bash
# `make run`: bin/caddy with Caddyfile.example against the Redis at $REDIS_ADDR (default
# 127.0.0.1:6379), authenticating with $REDIS_PASSWORD (and $REDIS_USERNAME, an ACL user) when
# set. When nothing listens at a loopback REDIS_ADDR and no password is set, it starts a
# throwaway redis-server there (no persistence, stopped on exit). Any other Redis is used only
# when PING answers PONG with those credentials and it is Redis 7.0 or later, standalone and a
# primary; otherwise the script stops at once, saying why. Once Caddy is up it prints the curl
# commands that show the limit at work. SITE_ADDRESS (default :8080) and ADMIN_ADDRESS (default
# localhost:2019) move the demo and Caddy's admin endpoint, as Caddyfile.example reads them. The
# demo is plain HTTP whatever SITE_ADDRESS says: a site address with a host (localhost:8081)
# would be an HTTPS site to Caddy, so http:// is put in front of one without a scheme, and an
# https:// one is refused.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/ensure-redis.sh
caddy=${CADDY_BINARY:-bin/caddy}
addr=${REDIS_ADDR:-127.0.0.1:6379}
site=${SITE_ADDRESS:-:8080}
admin=${ADMIN_ADDRESS:-localhost:2019}
case "$site" in
http://*) ;;
*://*)
	echo "make run: SITE_ADDRESS=$site: the demo serves plain HTTP; give a host and port (localhost:8081, :8081) or an http:// address" >&2
	exit 1 ;;
*) site=http://$site ;;
esac
host=${addr%:*}
port=${addr##*:}
host=${host#[}
host=${host%]}
work=$(mktemp -d)
redis_pid=""
caddy_pid=""
cleanup() {
	if [ -n "$caddy_pid" ]; then kill "$caddy_pid" 2>/dev/null || true; wait "$caddy_pid" 2>/dev/null || true; fi
	if [ -n "$redis_pid" ]; then kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; fi
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() {
	echo "make run: the Redis at $addr cannot be used: $*" >&2
	exit 1
}

# cli runs redis-cli against addr with the credentials, for at most 5 seconds; the password
# goes through the environment (REDISCLI_AUTH), never the command line.
cli() {
	local args=(-h "$host" -p "$port")
	if [ -n "${REDIS_USERNAME:-}" ]; then args+=(--user "$REDIS_USERNAME"); fi
	if [ -n "${REDIS_PASSWORD:-}" ]; then
		REDISCLI_AUTH=$REDIS_PASSWORD timeout 5 redis-cli "${args[@]}" "$@" 2>&1
	else
		env -u REDISCLI_AUTH timeout 5 redis-cli "${args[@]}" "$@" 2>&1
	fi
}

# listening: a TCP connection to addr succeeds within 3 seconds.
listening() { timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$host" "$port" 2>/dev/null; }

if ! listening; then
	case "$host" in
	127.0.0.1 | localhost | ::1) loopback=1 ;;
	*) loopback="" ;;
	esac
	if [ -z "$loopback" ] || [ -n "${REDIS_PASSWORD:-}${REDIS_USERNAME:-}" ]; then
		fail "nothing listens there (connection refused). Start that Redis, or unset REDIS_ADDR, REDIS_PASSWORD and REDIS_USERNAME for a throwaway one on 127.0.0.1:6379"
	fi
	echo "starting a throwaway redis-server on $addr (no persistence; stopped when Caddy stops)"
	bind=$host
	[ "$bind" = localhost ] && bind=127.0.0.1
	redis-server --port "$port" --bind "$bind" --save "" --appendonly no --dir "$work" --loglevel warning >"$work/redis.log" 2>&1 &
	redis_pid=$!
	for _ in $(seq 50); do
		[ "$(cli ping)" = PONG ] && break
		kill -0 "$redis_pid" 2>/dev/null || { cat "$work/redis.log" >&2; fail "redis-server did not start"; }
		sleep 0.1
	done
fi

# PING with the credentials. redis-cli reports a failed AUTH on stderr and goes on
# unauthenticated, and exits 0 whatever the server answered: its output says what happened.
if reply=$(cli ping); then :; else
	rc=$?
	[ "$rc" = 124 ] && fail "no reply to PING within 5 seconds: is it Redis?"
fi
case "$reply" in
*"AUTH failed: WRONGPASS"*)
	fail "wrong password${REDIS_USERNAME:+ or username}: Redis refused REDIS_PASSWORD${REDIS_USERNAME:+ with REDIS_USERNAME} (WRONGPASS)" ;;
*"called without any password configured"*)
	fail "REDIS_PASSWORD is set but this Redis has no password for the default user: unset REDIS_PASSWORD, or set REDIS_USERNAME to the ACL user it is for" ;;
*"AUTH failed:"*)
	fail "authentication failed: ${reply%%$'\n'*}" ;;
*NOAUTH*)
	fail "a password is required (NOAUTH): set REDIS_PASSWORD (and REDIS_USERNAME for an ACL user)" ;;
*"Protocol error"* | *"Connection reset"*)
	fail "what answers there is not Redis (${reply%%$'\n'*})" ;;
PONG) ;;
*)
	fail "PING was answered with '${reply%%$'\n'*}', not PONG" ;;
esac

# HELLO (Redis 6.0 and later, allowed to every user, unlike INFO) names the version, mode and role.
hello=$(cli hello)
field() { printf '%s\n' "$hello" | awk -v k="$1" 'prev == k { print; exit } { prev = $0 }'; }
version=$(field version)
server=Redis
[ "$(field server)" = valkey ] && server=Valkey
case "$hello" in
*"unknown command"*) fail "it does not know HELLO, so it is older than Redis 6.0: the limiter's scripts need Redis 7.0 or later" ;;
esac
if [ -z "$version" ]; then
	echo "make run: warning: could not read the version of the Redis at $addr (HELLO: ${hello%%$'\n'*}); the limiter needs 7.0 or later" >&2
elif [ "${version%%.*}" -lt 7 ] 2>/dev/null; then
	fail "it is $server $version: the limiter's scripts need Redis 7.0 or later (script flags, PEXPIRE GT)"
fi
[ "$(field mode)" = cluster ] && fail "it is a Redis Cluster node: Caddyfile.example's one address is a standalone client (see docs/topologies.md for a cluster)"
[ "$(field role)" = replica ] || [ "$(field role)" = slave ] && fail "it is a read-only replica: give the primary's address"
[ -z "$redis_pid" ] && echo "using the Redis at $addr${version:+ ($server $version)}"

# Caddyfile.example leaves its username and password lines commented out (a placeholder that is
# empty is a load error): uncomment those whose variable is set.
config=Caddyfile.example
if [ -n "${REDIS_USERNAME:-}${REDIS_PASSWORD:-}" ]; then
	config=$work/Caddyfile
	sed_args=()
	[ -n "${REDIS_USERNAME:-}" ] && sed_args+=(-e 's/^\([[:space:]]*\)# *\(username {env.REDIS_USERNAME}\)$/\1\2/')
	[ -n "${REDIS_PASSWORD:-}" ] && sed_args+=(-e 's/^\([[:space:]]*\)# *\(password {env.REDIS_PASSWORD}\)$/\1\2/')
	sed "${sed_args[@]}" Caddyfile.example >"$config"
	export REDIS_USERNAME REDIS_PASSWORD
fi

REDIS_ADDR=$addr SITE_ADDRESS=$site "$caddy" run --config "$config" --adapter caddyfile &
caddy_pid=$!
# Up when the admin endpoint answers: asking the site would take a token.
for _ in $(seq 100); do
	kill -0 "$caddy_pid" 2>/dev/null || { wait "$caddy_pid" || exit $?; exit 1; }
	if command -v curl >/dev/null 2>&1; then
		curl -s -o /dev/null "$admin/config/" && break
	else
		sleep 1 && break
	fi
	sleep 0.1
done

# The address curl is given: http://:8080 is http://localhost:8080.
url=${site/#http:\/\/:/http://localhost:}
cat <<MSG

Caddy is up on $url (Caddyfile.example: zone api, a burst of 5 then one request
every 10s per API key or IP; zone ip, a burst of 40 then one every 2s per IP whatever its keys;
zone login, 3 per minute per IP on /login and /login/*). In another terminal:

  # allowed: 200 with X-RateLimit-Limit/-Remaining/-Reset, RateLimit-Policy and RateLimit
  curl -i $url/

  # limited: the burst, then 429 with Retry-After (the JSON body is handle_errors')
  for i in \$(seq 7); do curl -s -o /dev/null -w '%{http_code} ' $url/; done; echo
  curl -i $url/

  # just the rate limit headers
  curl -s -D - -o /dev/null $url/ | grep -iE '^(x-)?ratelimit|^retry-after'

  # another client (its API key) has its own bucket; /login allows 3 per minute per IP
  curl -i $url/ -H 'X-API-Key: alice'
  for i in \$(seq 4); do curl -s -o /dev/null -w '%{http_code} ' $url/login -H 'X-API-Key: bob'; done; echo

  # the decisions counted, by zone and result (Caddy's admin endpoint)
  curl -s $admin/metrics | grep '^caddy_rate_limit_redis_decisions_total'

Press Ctrl-C to stop.

MSG
wait "$caddy_pid"
