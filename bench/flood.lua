-- wrk script for the deny flood (scenario 2 of scripts/bench.sh): one client, "X-Client: flood" on
-- every request. Against bench/flood.Caddyfile (capacity 1, refill 1 per hour) the first request
-- passes and nearly every other one is answered 429; plain Caddy answers 200 (the baseline).
wrk.headers["X-Client"] = "flood"
