-- wrk script for scenario 8's lease row of scripts/bench.sh: every request carries
-- "X-Client: hot<id>", <id> a random number in 1..10, so the load comes from 10 hot clients,
-- each sending thousands of requests a second.
local clients = 10
local threads = 0

-- setup runs once per wrk thread in the main Lua state: give each thread its own seed.
function setup(thread)
	threads = threads + 1
	thread:set("thread_index", threads)
end

function init(args)
	math.randomseed(os.time() * 1000 + (thread_index or 0))
end

function request()
	wrk.headers["X-Client"] = "hot" .. tostring(math.random(clients))
	return wrk.format()
end
