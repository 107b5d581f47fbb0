-- wrk script for the allowed path (scenarios 1, 3 and 4 of scripts/bench.sh): every request
-- carries "X-Client: <id>", <id> a random number in 1..10000, so the load comes from 10,000
-- distinct clients. The same script drives plain Caddy and the module's Caddy, so the load
-- generator costs the same in both runs.
local clients = 10000
local threads = 0

-- setup runs once per wrk thread in the main Lua state: give each thread its own seed, or every
-- thread would send the same sequence of ids.
function setup(thread)
	threads = threads + 1
	thread:set("thread_index", threads)
end

function init(args)
	math.randomseed(os.time() * 1000 + (thread_index or 0))
end

function request()
	wrk.headers["X-Client"] = tostring(math.random(clients))
	return wrk.format()
end
