#!/usr/bin/env bash
# Traffic for the compose demo (docs/compose.md): one pass of nine requests about every second,
# all from one address, until Ctrl-C (or PASSES passes). Each line's comment says what it gets
# from deploy/Caddyfile; together they make each alert that docs/compose.md lists turn pending
# at once and fire once its `for:` has passed. It prints each answer's status, a pass a line.
#
#   deploy/traffic.sh                         # the stack's site, http://localhost:8080
#   deploy/traffic.sh http://127.0.0.1:9000   # another address
set -u
site=${1:-http://localhost:8080}
passes=${PASSES:-0} # 0: until stopped
get() { curl -s -o /dev/null -w '%{http_code} ' "$@"; }
pass=0
while [ "$passes" = 0 ] || [ "$pass" -lt "$passes" ]; do
	pass=$((pass + 1))
	get "$site/"                                  # zone api, keyed by IP: 5 burst, then 1 per 10s: mostly 429 (RateLimitZoneDenyingMany, api)
	get "$site/"                                  # the same again
	get "$site/login"                             # zone login: 401, 3 failures a minute per IP, then 429 (RateLimitZoneDenyingMany, login); the 3rd crosses near_limit (RateLimitZoneNearLimit, login)
	get -u demo:demo "$site/login"                # 200, its charge given back; 429 while 3 failures count in the minute
	get -H "X-API-Key: llm" "$site/v1/chat"       # zone tokens: 200, 100 reserved, 40 charged (X-Tokens-Used) of 1000, 100/s
	get "$site/v1/chat"                           # zone tokens: 403, no API key (RateLimitZoneKeyEmpty, tokens)
	get -H "X-API-Key: llm" "$site/llm/v1/chat/completions" # zone llm: 200, no usage reported: charged missing (RateLimitChargeMissing, llm)
	get -H "X-API-Key: s$RANDOM" "$site/search"   # zone search, dry_run: 10 a minute per IP, then 200 counted dry_run_denied (RateLimitDryRunWouldDeny, search)
	get -H "X-API-Key: k$RANDOM" "$site/"         # a new API key each time: zone api never limits it; zone ip would past 100 + 10/s per IP (a pass is 9)
	echo
	sleep 1
done
