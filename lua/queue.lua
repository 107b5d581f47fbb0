#!lua
-- queue.lua: the queue of a zone with a max_wait that waits in line (a concurrency zone, or a
-- token bucket with priority classes), where requests that found every slot (or the tokens they
-- cost) taken wait for one, in priority classes, in arrival order within a class, across every
-- instance (see decide.lua, "Concurrency" and "Token bucket", and internal/limiter/queue.go).
--
-- State, all in the hash slot of the zone's state key K (the slots' sorted set, or the bucket):
--   K:ql       a sorted set of the waiters: member the waiter's id, score its lease's end (µs).
--              An instance renews its waiters' leases every second (op refresh); a waiter whose
--              lease has ended (its instance died, or lost Redis) is dropped by the next call.
--   K:q<c>     per class c (1 the highest), a sorted set of its waiters: member the waiter's id,
--              score its arrival (µs, the Redis clock when it first entered).
--   K:qm       a hash of the share counters: n<c> the grants made while class c had waiters,
--              s<c> those of them made to class c; both dropped when class c has none. With
--              fair queuing, also v<c>: class c's virtual time, the tag of its last grant.
-- With fair queuing (ARGV[8] > 0), waiters are served within a class by start-time fair
-- queuing on their tenant, not in arrival order:
--   K:qv<c>    per class c, a sorted set of its waiters: member the waiter's id, score its tag.
--   K:qf<c>    per class c, a sorted set of its tenants: member the tenant, score its finish
--              tag (its last waiter's tag plus that waiter's cost, less the costs of its
--              waiters that left ungranted). A tenant whose finish tag is at or below the
--              class's virtual time is dropped: it would be tagged the same.
--   K:qt       a hash: a waiter's id, its tenant (whose finish tag a waiter that leaves
--              ungranted gives its cost back to, and for the admin API's listing).
-- A waiter entering class c of virtual time V for tenant t is tagged S = max(V, F_t) (F_t: t's
-- finish tag, V when t has none), and F_t becomes S + its cost; the next waiter of a class is
-- the one of the least tag (ties: by id), and V becomes its tag. A class whose last waiter
-- leaves starts again at V = 0 with no tenant. At most ARGV[8] tenants have a finish tag per class: a
-- tenant beyond them is tagged as the tenant "" (one lane for all of them).
-- A waiter's id is "<instance>.<n>.<c>" (a concurrency zone's) or "<instance>.<n>:<cost>.<c>"
-- (a token bucket's): its instance's id (the channel it listens on is ARGV[5] .. instance), a
-- number unique on that instance, the tokens its request costs, and its class.
--
-- Granting (promote): while the next waiter's grant fits, it is reserved for it, and its id is
-- published on its instance's channel; the instance then decides the request with the claim
-- (decide.lua takes the reservation in place of a free slot or of the bucket's tokens), or
-- leaves (op leave), which gives the reservation to the next waiter.
--   concurrency  A grant fits while K has fewer than limit live slots. The reservation is the
--                member "q:<id>" in K with a deadline of now + claim; never claimed, it frees
--                itself at its deadline.
--   token bucket A grant fits while the bucket holds the waiter's cost (decide.lua's reading:
--                capacity less used, drained at the refill rate, less held). The reservation is
--                a hold "h:q:<id>" = "<cost>@<µs>" of the bucket (decide.lua, "Token bucket"),
--                of its own maximum claim; never claimed, it counts as charged after claim, as
--                any hold past its time. The waiters are served at the refill rate: promote
--                replies the µs until the next waiter's cost is in the bucket, and each instance
--                with waiters calls promote then.
-- The next waiter is the earliest of the first class that is owed its share (the class with the
-- most owed, the higher class on a tie), else the earliest of the highest class with waiters.
-- Class c of share s (permille) is owed when s_c < floor(s × (n_c + 1) / 1000): so while it has
-- waiters it is granted at least floor(s × n / 1000) of every n grants, less one per other
-- class owed at the same grant.
--
-- KEYS[1] K, KEYS[2] K:ql, KEYS[3] K:qm, KEYS[3 + c] K:q<c> for each class c of the n classes;
-- with fair queuing, then KEYS[3 + n + c] K:qv<c>, KEYS[3 + 2n + c] K:qf<c>, KEYS[4 + 3n] K:qt.
-- Last, for an adaptive concurrency zone, K:ctl: its controller's hash (settle.lua).
-- ARGV[1] now, in µs since the Unix epoch, or "" to read the Redis server clock (TIME).
-- ARGV[2] the operation: "enter", "leave", "refresh" or "promote".
-- ARGV[3] the zone: its limit (slots), "<limit>/<min limit>" (slots) for an adaptive concurrency
--         zone (its limit in force is K:ctl's e, at most limit; min limit while it has none), or
--         "<capacity>,<refill rate>" (tokens, tokens/s) for a token bucket.
-- ARGV[4] claim: µs a reservation waits for its waiter's decision.
-- ARGV[5] the channel prefix: a waiter's grant is published on ARGV[5] .. its instance.
-- ARGV[6] the classes' shares, permille, comma-separated, one per class ("0" for none).
-- ARGV[7] lease: µs from now to a waiter's lease's end.
-- ARGV[8] fair queuing: the most tenants with a finish tag per class; 0 for arrival order.
-- Then, per operation, each reply ending with next: µs until the next waiter's grant fits (a
-- token bucket's, while a waiter waits), else 0:
--   enter    ARGV[9] the waiter's id, ARGV[10] its arrival (µs; "" for now), ARGV[11] its
--            tenant (fair queuing). Reply: { granted (1 when this waiter holds a reservation
--            now), arrival (µs), waiters ahead of it (of its class and higher), next }.
--   leave    ARGV[9] the waiter's id. Reply: { 1 when it held a reservation (given to the
--            next), else 0, next }.
--   refresh  ARGV[9..] the ids of an instance's waiters: their leases renewed. Reply: per id,
--            0 waiting, 1 holding a reservation, 2 gone (its lease ended, or it was dropped);
--            then next.
--   promote  nothing more. Reply: { the number of grants, next }.

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local NOW = string.format('%d', now)
local K, L, M = KEYS[1], KEYS[2], KEYS[3]
local claim, chan = tonumber(ARGV[4]), ARGV[5]
local limit, rate = tonumber(ARGV[3]), nil -- slots; or a token bucket's capacity and refill rate
local ceiling, minl = string.match(ARGV[3], '^(%d+)/(%d+)$')
if ceiling then -- adaptive concurrency: the limit in force is its controller's (see settle.lua)
  limit = math.max(1, math.min(tonumber(ceiling), tonumber(redis.call('HMGET', KEYS[#KEYS], 'e')[1]) or tonumber(minl)))
end
local tb = limit == nil
if tb then
  local c, r = string.match(ARGV[3], '^([^,]+),(.+)$')
  limit, rate = tonumber(c), tonumber(r)
end
local lease = tonumber(ARGV[7])
local shares = {}
for s in string.gmatch(ARGV[6], '%d+') do shares[#shares + 1] = tonumber(s) end
local classes = #shares
local EPSILON, HOLD_MAX = 1e-9, 5000000 -- decide.lua's
local tenants = tonumber(ARGV[8]) or 0
local fair = tenants > 0
local T = KEYS[4 + 3 * classes]

-- line is the key of class c's waiters in the order they are served: by tag (fair queuing),
-- else by arrival.
local function line(c)
  if fair then return KEYS[3 + classes + c] end
  return KEYS[3 + c]
end

-- class_of is the class of a waiter's id (its last field), at most the number of classes.
local function class_of(id)
  local c = tonumber(string.match(id, '%.(%d+)$')) or classes
  if c < 1 or c > classes then c = classes end
  return c
end

-- cost_of is the tokens a token bucket waiter's request costs (see its id).
local function cost_of(id)
  return tonumber(string.match(id, ':(%d+)%.%d+$')) or 1
end

-- keep_alive gives the queue's keys a TTL past the latest lease.
local function keep_alive()
  local ttl = string.format('%d', math.ceil(lease / 1000) + 1000)
  redis.call('PEXPIRE', L, ttl)
  redis.call('PEXPIRE', M, ttl)
  for c = 1, classes do redis.call('PEXPIRE', KEYS[3 + c], ttl) end
  if fair then
    for c = 1, classes do
      redis.call('PEXPIRE', KEYS[3 + classes + c], ttl)
      redis.call('PEXPIRE', KEYS[3 + 2 * classes + c], ttl)
    end
    redis.call('PEXPIRE', T, ttl)
  end
end

-- unlist takes waiter id out of the queue's sets. A waiter that leaves ungranted (gone) gives
-- its cost back to its tenant's finish tag: the tenant of a dead instance's waiters, or of
-- clients that hung up, is not tagged behind them when it waits again.
local function unlist(id, gone)
  local c = class_of(id)
  redis.call('ZREM', KEYS[3 + c], id)
  redis.call('ZREM', L, id)
  if fair then
    local Q, F = KEYS[3 + classes + c], KEYS[3 + 2 * classes + c]
    if redis.call('ZREM', Q, id) == 1 and gone then
      local t = redis.call('HMGET', T, id)[1]
      local f = t and tonumber(redis.call('ZSCORE', F, t))
      if f then redis.call('ZADD', F, string.format('%d', f - math.max(cost_of(id), 1)), t) end
    end
    redis.call('HDEL', T, id)
    if redis.call('ZCARD', Q) == 0 then -- the class starts again
      redis.call('DEL', F)
      redis.call('HDEL', M, 'v' .. c)
    end
  end
end

-- tag files waiter id, of tenant t and the given cost, in its class's fair line (see the top).
local function tag(id, t, cost)
  local c = class_of(id)
  local F = KEYS[3 + 2 * classes + c]
  local v = tonumber(redis.call('HMGET', M, 'v' .. c)[1]) or 0
  local vs = string.format('%d', v)
  redis.call('ZREMRANGEBYSCORE', F, '-inf', vs)
  local f = tonumber(redis.call('ZSCORE', F, t))
  if not f and redis.call('ZCARD', F) >= tenants then
    t = ''
    f = tonumber(redis.call('ZSCORE', F, t))
  end
  local s = math.max(v, f or v)
  redis.call('ZADD', F, string.format('%d', s + math.max(cost, 1)), t)
  redis.call('ZADD', KEYS[3 + classes + c], string.format('%d', s), id)
  redis.call('HSET', T, id, t)
end

-- drop_lapsed drops the waiters whose lease has ended (at most 1000 a call).
local function drop_lapsed()
  local gone = redis.call('ZRANGEBYSCORE', L, '-inf', NOW, 'LIMIT', 0, 1000)
  for _, id in ipairs(gone) do unlist(id, true) end
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

-- bucket reads the token bucket K as decide.lua does: its used tokens, drained at the refill
-- rate to now, and its held tokens (the sum h; a hold past its time counted as held, not yet
-- as used, which leaves the same tokens). A bucket with no state holds nothing.
local function bucket()
  local v = redis.call('HMGET', K, 'u', 'ts', 't', 'h')
  local used, ts, t = tonumber(v[1]), tonumber(v[2]), v[3]
  if t and ts and string.byte(t) ~= 43 then used = math.max(0, limit - tonumber(t)) end
  if used == nil or ts == nil then return 0, 0 end
  if now > ts then used = math.max(0, used - (now - ts) * rate / 1000000) end
  return used, tonumber(v[4]) or 0
end

-- Each kind of queue's grants, as { fits(id): whether id's grant fits now, else the µs until it
-- does (a token bucket's), reserve(id), done(): its writes once grants were made };
-- slots returns nil when no slot is free.
local function slots()
  redis.call('ZREMRANGEBYSCORE', K, '-inf', NOW)
  local free = limit - redis.call('ZCARD', K)
  if free <= 0 then return nil end
  local deadline = string.format('%d', now + claim)
  return {
    fits = function() return free > 0, 0 end,
    reserve = function(id)
      redis.call('ZADD', K, deadline, 'q:' .. id)
      free = free - 1
    end,
    done = function()
      local last = redis.call('ZRANGE', K, -1, -1, 'WITHSCORES')
      redis.call('PEXPIRE', K, string.format('%d', math.ceil((tonumber(last[2]) - now) / 1000) + 1000))
    end,
  }
end

local function tokens()
  local used, held = bucket()
  local at = string.format('%d', now + claim - HOLD_MAX) -- a hold of its own maximum, claim
  return {
    fits = function(id)
      local want = cost_of(id) - (limit - used - held)
      if want <= EPSILON then return true, 0 end
      return false, math.ceil(want * 1000000 / rate)
    end,
    reserve = function(id)
      local c = cost_of(id)
      redis.call('HSET', K, 'h:q:' .. id, string.format('%d@%s', c, at))
      held = held + c
    end,
    done = function()
      redis.call('HSET', K, 'u', string.format('%.17g', used), 'ts', NOW,
        't', '+' .. string.format('%.17g', limit - used - held), 'h', string.format('%d', held))
      -- decide.lua's tb_ttl: u and every hold drained after the last of them counts as charged
      -- (the reservations made now, after claim; at least decide.lua's HOLD_MAX), and a second.
      local hwait = math.max(claim, HOLD_MAX)
      local all = redis.call('HGETALL', K)
      for j = 1, #all, 2 do
        local at = string.sub(all[j], 1, 2) == 'h:' and tonumber(string.match(all[j + 1], '^%d+@(%d+)$'))
        if at then hwait = math.max(hwait, at + HOLD_MAX - now) end
      end
      local ttl = math.ceil((used + held) / rate * 1000) + math.ceil(hwait / 1000) + 1000
      redis.call('PEXPIRE', K, string.format('%d', ttl))
    end,
  }
end

-- share_counters reads K:qm: per class, the grants made while it waited and those made to it.
local function share_counters()
  local v = redis.call('HGETALL', M)
  local h = {}
  for i = 1, #v, 2 do h[v[i]] = tonumber(v[i + 1]) end
  local seen, served = {}, {}
  for c = 1, classes do seen[c], served[c] = h['n' .. c] or 0, h['s' .. c] or 0 end
  return seen, served
end

-- save_share_counters writes K:qm for the classes with waiters (n), and drops the others'.
local function save_share_counters(n, seen, served)
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
end

-- promote grants the next waiters while their grants fit, and returns how many it granted and
-- the µs until the next one's fits (0: none waits, or a concurrency zone's).
local function promote()
  drop_lapsed()
  local g
  if tb then g = tokens() else g = slots() end
  if not g then return 0, 0 end
  local n = {}
  local any = false
  for c = 1, classes do
    n[c] = redis.call('ZCARD', KEYS[3 + c])
    any = any or n[c] > 0
  end
  if not any then
    redis.call('DEL', M)
    return 0, 0
  end
  local seen, served = share_counters()
  local granted, next = 0, 0
  while true do
    local c = pick(n, seen, served)
    if not c then break end
    local head = redis.call('ZRANGE', line(c), 0, 0, 'WITHSCORES')
    local id = head[1]
    local ok, us = g.fits(id)
    if not ok then
      next = us
      break
    end
    g.reserve(id)
    if fair then redis.call('HSET', M, 'v' .. c, head[2]) end
    unlist(id, false)
    redis.call('PUBLISH', chan .. string.match(id, '^([^.]*)'), id)
    for k = 1, classes do
      if n[k] > 0 then seen[k] = seen[k] + 1 end
    end
    served[c], n[c] = served[c] + 1, n[c] - 1
    granted = granted + 1
  end
  if granted > 0 then
    save_share_counters(n, seen, served)
    g.done(granted)
  end
  return granted, next
end

-- reservation returns the field or member of waiter id's reservation in K and, for a token
-- bucket, its cost, when it holds one now; else nil.
local function reservation(id)
  if tb then
    local f = 'h:q:' .. id
    local c, at = string.match(redis.call('HMGET', K, f)[1] or '', '^(%d+)@(%d+)$')
    if c and now - tonumber(at) <= HOLD_MAX then return f, tonumber(c) end
    return nil
  end
  local s = redis.call('ZSCORE', K, 'q:' .. id)
  if s and tonumber(s) > now then return 'q:' .. id end
  return nil
end

-- release gives back waiter id's reservation, if it holds one, and reports whether it did.
local function release(id)
  local f, c = reservation(id)
  if not f then return 0 end
  if not tb then return redis.call('ZREM', K, f) end
  local held = (tonumber(redis.call('HMGET', K, 'h')[1]) or 0) - c
  if held > 0 then
    redis.call('HDEL', K, f)
    redis.call('HSET', K, 'h', string.format('%d', held))
  else
    redis.call('HDEL', K, f, 'h')
  end
  return 1
end

local op = ARGV[2]
if op == 'enter' then
  local id = ARGV[9]
  local arrival = tonumber(ARGV[10]) or now
  local q = KEYS[3 + class_of(id)]
  if fair then tag(id, ARGV[11] or '', cost_of(id)) end
  redis.call('ZADD', q, string.format('%d', arrival), id)
  redis.call('ZADD', L, string.format('%d', now + lease), id)
  keep_alive()
  local _, next = promote()
  if reservation(id) then return { 1, arrival, 0, next } end
  local ahead
  if fair then
    q = line(class_of(id))
    ahead = redis.call('ZCOUNT', q, '-inf', '(' .. redis.call('ZSCORE', q, id))
  else
    ahead = redis.call('ZCOUNT', q, '-inf', '(' .. string.format('%d', arrival))
  end
  for c = 1, class_of(id) - 1 do ahead = ahead + redis.call('ZCARD', KEYS[3 + c]) end
  return { 0, arrival, ahead, next }
elseif op == 'leave' then
  local id = ARGV[9]
  unlist(id, true)
  local had = release(id)
  local _, next = promote()
  return { had, next }
elseif op == 'refresh' then
  local lease_end = string.format('%d', now + lease)
  local out = {}
  local _, next = promote()
  for i = 9, #ARGV do
    local id = ARGV[i]
    if reservation(id) then
      out[#out + 1] = 1
    elseif redis.call('ZSCORE', L, id) then
      redis.call('ZADD', L, 'XX', lease_end, id)
      out[#out + 1] = 0
    else
      out[#out + 1] = 2
    end
  end
  keep_alive()
  out[#out + 1] = next
  return out
elseif op == 'promote' then
  local granted, next = promote()
  return { granted, next }
end
return redis.error_reply('queue: unknown operation ' .. tostring(op))
