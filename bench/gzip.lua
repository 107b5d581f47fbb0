-- wrk script for scenario 7 of scripts/bench.sh (charge openai_usage in front of a gzip-answering
-- JSON upstream): bench/allowed.lua's 10,000 clients (a random X-Client per request), each
-- request a GET of /chat.json accepting gzip, as the OpenAI SDKs do. The same script drives plain
-- Caddy and the module's Caddy.
local clients = 10000
local threads = 0

function setup(thread)
	threads = threads + 1
	thread:set("thread_index", threads)
end

function init(args)
	math.randomseed(os.time() * 1000 + (thread_index or 0))
	wrk.path = "/chat.json"
	wrk.headers["Accept-Encoding"] = "gzip"
end

function request()
	wrk.headers["X-Client"] = tostring(math.random(clients))
	return wrk.format()
end
