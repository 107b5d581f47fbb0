#!lua
-- queue.lua: the queue of a concurrency zone with a max_wait, where requests that found every
-- slot taken wait for one, in priority classes, in arrival order within a class, across every
-- instance (see decide.lua, "Concurrency", and internal/limiter/queue.go).
--
-- State, all in the hash slot of the zone's state key K (the slots' sorted set):
--   K:ql       a sorted set of the waiters: member the waiter's id, score its lease's end (µs).
--              An instance renews its waiters' leases every second (op refresh); a waiter whose
--              lease has ended (its instance died, or lost Redis) is dropped by the next call.
--   K:q<c>     per class c (1 the highest), a sorted set of its waiters: member the waiter's id,
--              score its arrival (µs, the Redis clock when it first entered).
--   K:qm       a hash of the share counters: n<c> the slots granted while class c had waiters,
--              s<c> those of them granted to class c; both dropped when class c has none.
-- A waiter's id is "<instance>.<n>.<c>": its instance's id (the channel it listens on is
-- ARGV[5] .. instance), a number unique on that instance, and its class.
--
-- Granting (promote): while K has fewer than limit live slots and a waiter waits, the next
-- waiter is given a reserved slot, member "q:<id>" in K with a deadline of now + claim, and its
-- id is published on its instance's channel; the instance then decides the request with the
-- claim (decide.lua takes the reservation in place of a free slot), or leaves (op leave), which
-- gives the reservation to the next waiter. A reservation never claimed frees itself at its
-- deadline. The next waiter is the earliest of the first class that is owed its share (the class
-- with the most owed, the higher class on a tie), else the earliest of the highest class with
-- waiters. Class c of share s (permille) is owed when s_c < floor(s × (n_c + 1) / 1000): so while
-- it has waiters it is granted at least floor(s × n / 1000) of every n slots granted, less one
-- per other class owed at the same grant.
--
-- KEYS[1] K, KEYS[2] K:ql, KEYS[3] K:qm, KEYS[3 + c] K:q<c> for each class c.
-- ARGV[1] now, in µs since the Unix epoch, or "" to read the Redis server clock (TIME).
-- ARGV[2] the operation: "enter", "leave", "refresh" or "promote".
-- ARGV[3] the zone's limit (slots).
-- ARGV[4] claim: µs a reserved slot waits for its waiter's decision.
-- ARGV[5] the channel prefix: a waiter's grant is published on ARGV[5] .. its instance.
-- ARGV[6] the classes' shares, permille, comma-separated, one per class ("0" for none).
-- ARGV[7] lease: µs from now to a waiter's lease's end.
-- Then, per operation:
--   enter    ARGV[8] the waiter's id, ARGV[9] its arrival (µs; "" for now). Reply: { granted
--            (1 when this waiter holds a reserved slot now), arrival (µs), waiters ahead of it
--            (of its class and higher) }.
--   leave    ARGV[8] the waiter's id. Reply: { 1 when it held a reserved slot (given to the
--            next), else 0 }.
--   refresh  ARGV[8..] the ids of an instance's waiters: their leases renewed. Reply: per id,
--            0 waiting, 1 holding a reserved slot, 2 gone (its lease ended, or it was dropped).
--   promote  nothing more. Reply: the number of slots granted.

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local NOW = string.format('%d', now)
local K, L, M = KEYS[1], KEYS[2], KEYS[3]
local limit, claim, chan = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local lease = tonumber(ARGV[7])
local shares = {}
for s in string.gmatch(ARGV[6], '%d+') do shares[#shares + 1] = tonumber(s) end
local classes = #shares

-- class_of is the class of a waiter's id (its last field), at most the number of classes.
local function class_of(id)
  local c = tonumber(string.match(id, '%.(%d+)$')) or classes
  if c < 1 or c > classes then c = classes end
  return c
end

-- keep_alive gives the queue's keys a TTL past the latest lease.
local function keep_alive()
  local ttl = string.format('%d', math.ceil(lease / 1000) + 1000)
  redis.call('PEXPIRE', L, ttl)
  redis.call('PEXPIRE', M, ttl)
  for c = 1, classes do redis.call('PEXPIRE', KEYS[3 + c], ttl) end
end

-- drop_lapsed drops the waiters whose lease has ended (at most 1000 a call).
local function drop_lapsed()
  local gone = redis.call('ZRANGEBYSCORE', L, '-inf', NOW, 'LIMIT', 0, 1000)
  for _, id in ipairs(gone) do
    redis.call('ZREM', KEYS[3 + class_of(id)], id)
    redis.call('ZREM', L, id)
  end
end

-- pick returns the class whose waiter is granted next, given the waiters per class (n), or nil.
local function pick(n, seen, served)
  local best, owed = nil, 0
  for c = 1, classes do
    if n[c] > 0 and shares[c] > 0 then
      local o = math.floor(shares[c] * (seen[c] + 1) / 1000) - served[c]
      if o > owed then best, owed = c, o end
    end
  end
  if best then return best end
  for c = 1, classes do
    if n[c] > 0 then return c end
  end
  return nil
end

-- promote grants the free slots of K to the next waiters and returns how many it granted.
local function promote()
  drop_lapsed()
  redis.call('ZREMRANGEBYSCORE', K, '-inf', NOW)
  local free = limit - redis.call('ZCARD', K)
  if free <= 0 then return 0 end
  local n, seen, served = {}, {}, {}
  local any = false
  for c = 1, classes do
    n[c] = redis.call('ZCARD', KEYS[3 + c])
    any = any or n[c] > 0
  end
  if not any then
    redis.call('DEL', M)
    return 0
  end
  local v = redis.call('HGETALL', M)
  local h = {}
  for i = 1, #v, 2 do h[v[i]] = tonumber(v[i + 1]) end
  for c = 1, classes do seen[c], served[c] = h['n' .. c] or 0, h['s' .. c] or 0 end
  local granted, deadline = 0, string.format('%d', now + claim)
  while free > 0 do
    local c = pick(n, seen, served)
    if not c then break end
    local head = redis.call('ZPOPMIN', KEYS[3 + c])
    local id = head[1]
    redis.call('ZREM', L, id)
    redis.call('ZADD', K, deadline, 'q:' .. id)
    redis.call('PUBLISH', chan .. string.match(id, '^([^.]*)'), id)
    for k = 1, classes do
      if n[k] > 0 then seen[k] = seen[k] + 1 end
    end
    served[c], n[c] = served[c] + 1, n[c] - 1
    free, granted = free - 1, granted + 1
  end
  local args = {}
  for c = 1, classes do
    if n[c] > 0 then
      args[#args + 1] = 'n' .. c
      args[#args + 1] = string.format('%d', seen[c])
      args[#args + 1] = 's' .. c
      args[#args + 1] = string.format('%d', served[c])
    else
      redis.call('HDEL', M, 'n' .. c, 's' .. c)
    end
  end
  if #args > 0 then redis.call('HSET', M, unpack(args)) end
  if granted > 0 then
    local last = redis.call('ZRANGE', K, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', K, string.format('%d', math.ceil((tonumber(last[2]) - now) / 1000) + 1000))
  end
  return granted
end

-- reserved reports whether waiter id holds a reserved slot now.
local function reserved(id)
  local s = redis.call('ZSCORE', K, 'q:' .. id)
  return s and tonumber(s) > now
end

local op = ARGV[2]
if op == 'enter' then
  local id = ARGV[8]
  local arrival = tonumber(ARGV[9]) or now
  local q = KEYS[3 + class_of(id)]
  redis.call('ZADD', q, string.format('%d', arrival), id)
  redis.call('ZADD', L, string.format('%d', now + lease), id)
  keep_alive()
  promote()
  if reserved(id) then return { 1, arrival, 0 } end
  local ahead = redis.call('ZCOUNT', q, '-inf', '(' .. string.format('%d', arrival))
  for c = 1, class_of(id) - 1 do ahead = ahead + redis.call('ZCARD', KEYS[3 + c]) end
  return { 0, arrival, ahead }
elseif op == 'leave' then
  local id = ARGV[8]
  redis.call('ZREM', KEYS[3 + class_of(id)], id)
  redis.call('ZREM', L, id)
  local had = redis.call('ZREM', K, 'q:' .. id)
  promote()
  return had
elseif op == 'refresh' then
  local lease_end = string.format('%d', now + lease)
  local out = {}
  promote()
  for i = 8, #ARGV do
    local id = ARGV[i]
    if reserved(id) then
      out[#out + 1] = 1
    elseif redis.call('ZSCORE', L, id) then
      redis.call('ZADD', L, 'XX', lease_end, id)
      out[#out + 1] = 0
    else
      out[#out + 1] = 2
    end
  end
  keep_alive()
  return out
elseif op == 'promote' then
  return promote()
end
return redis.error_reply('queue: unknown operation ' .. tostring(op))
