#!lua
-- refresh.lua: move on the deadlines of a client's concurrency slots still in flight (see
-- decide.lua, "Concurrency"), so that a response that lasts longer than its hold_max keeps its
-- slot. An instance sends it for its live slots well before their deadlines (Limiter.Refresh);
-- an instance that died sends none, and its slots free themselves at their deadlines.
--
-- The slots past their deadline are removed first, so that a refresh never revives a slot that
-- was already free (another request may have taken its place); a slot that is gone (given back,
-- expired, or reset by the admin API) is not added again (ZADD XX). The key then lives a second
-- past its latest deadline.
--
-- KEYS[1]  the concurrency zone's state key (one key per call: one hash slot on Redis Cluster).
-- ARGV[1]  now, in µs since the Unix epoch, or "" to read the Redis server clock (TIME).
-- ARGV[2]  the lease: µs from now to the new deadline.
-- ARGV[3..] the slots' members (the nonces of their decisions).
--
-- Reply: the number of slots whose deadline was moved on (the others are gone).

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local key = KEYS[1]
local deadline = string.format('%d', now + tonumber(ARGV[2]))

redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now))
local args = {}
for i = 3, #ARGV do
  args[#args + 1] = deadline
  args[#args + 1] = ARGV[i]
end
local moved = redis.call('ZADD', key, 'XX', 'CH', unpack(args))
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('PEXPIRE', key, string.format('%d', math.ceil((tonumber(last[2]) - now) / 1000) + 1000))
end
return moved
