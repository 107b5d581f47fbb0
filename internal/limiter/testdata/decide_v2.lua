#!lua
-- decide.lua: admit or deny a batch of requests, each against every zone that applies to it,
-- each all-or-nothing, in order: one script call (one EVALSHA) for all the decisions that share a
-- round trip, so that Redis pays the call's overhead once for the batch.
--
-- The shebang declares no flags: the script may write, and without `allow-oom` Redis refuses the
-- whole call with an OOM error when it is over `maxmemory`, before anything runs. Nothing is
-- written before every zone has decided, and nothing at all when a zone denies except a longer
-- TTL (see Expiry).
--
-- Token bucket zone: a hash holding what the client has USED, not what it has left:
--   u   tokens used (float >= 0), drained at the refill rate in force, so that the tokens
--       available are always capacity - u under the capacity in force (a raised capacity gives
--       every client the difference at once, a lowered one takes it away at once)
--   ts  the time of u (µs)
--   t   capacity - u - held, for instances still running the previous script (which stored the
--       tokens left in t and ts). It is written with a leading '+', which the previous script
--       never writes: a t without it means the previous script wrote last, and u is stale.
--   h   the sum of the holds below, absent when there are none
--   h:<nonce>  a hold: "<cost>@<µs>", tokens reserved by a call with hold = 1 (Redis Cluster,
--       when a request's zones are in several hash slots) or a hold time (charge after the
--       response) until settle.lua commits it into u or releases it. A hold whose µs is more
--       than HOLD_MAX in the past is committed by whichever call finds it. A hold of its own
--       maximum m is written with µs = now + m - HOLD_MAX: the same form and the same rule, so
--       every script version and the admin API read it alike.
-- It admits a request iff capacity - u - held >= cost, or, with a max_wait (shaping), iff it
-- would within max_wait (and cost <= capacity): the request is then charged now, u going above
-- the capacity (a debt of at most max_wait × rate), and its delay is the time until the bucket
-- would have held cost tokens. Each reservation deepens the debt, so held requests come out in
-- order, at the refill rate, whichever instance holds them.
--
-- Sliding window log zone: a sorted set of admitted request units scored by time (µs), members
-- "<nonce>:<n>". It admits a request iff (units younger than the window) + cost <= limit.
--
-- Fixed window zone: a string "<window start>:<count>", the start in seconds since the epoch
-- (with µs when not whole); a count of another window is a count of 0. It admits a request iff
-- count + cost <= limit. The key lives until a second past the window's end.
--
-- Sliding window counter zone: a hash { s = the current window's start (µs, windows aligned to
-- the epoch), c = its count, p = the previous window's count }. It admits a request iff
-- p * (share of the previous window still inside the sliding window) + c + cost <= limit.
--
-- KEYS     the state keys of every zone of every decision, in order: a decision of n zones takes
--          the next n keys (`<prefix>{<client key>}:<zone>:<tb|sw|fw|sc>`).
-- ARGV[1]  now, in µs since the Unix epoch, or "" to read the Redis server clock (TIME); one
--          time for the whole batch.
-- Then per decision, in order:
--   nonce    unique to the decision (across instances and calls): sliding window members are
--            "<nonce>:<n>" for n = 1..cost, holds are "h:<nonce>", so settle.lua can find
--            exactly what the decision added
--   hold     "1": take token bucket charges as holds (see settle.lua); "0": charge them; or one
--            number per zone, comma-separated: µs that zone's token bucket charge is held at
--            most before it counts as charged (0: charge it now)
--   n        the number of zones
--   and 4 arguments per zone:
--   algorithm  "tb" (token bucket), "sw" (sliding window log), "fw" (fixed window) or "sc"
--              (sliding window counter)
--   quota      tb: capacity (tokens); sw, fw, sc: limit (requests per window)
--   rate       tb: refill rate (tokens/s, float > 0), or "<rate>,<max_wait>" to shape: the
--              longest the request may be held (µs, integer > 0); sw, sc: window (µs, integer > 0);
--              fw: "b0,b1,b2,b3" (µs): the windows [b0,b1), [b1,b2), [b2,b3) around the
--              instance's clock, of which the one holding now is used
--   cost       tokens or window slots this request takes (integer >= 1)
--
-- Reply: an array of integers, per decision in order: { allowed, then per zone i: allowed_i,
-- remaining_i, retry_after_i, reset_i, next_i } (1 + 5n integers for a decision of n zones),
-- where
--   allowed        1 if every zone admits the request (and all were charged), else 0
--   allowed_i      1 if zone i alone would admit the request, else 0
--   remaining_i    whole tokens (tb) or slots (sw) left: after this request if zone i alone
--                  admits it, else as they are now
--   retry_after_i  when zone i alone admits the request: its delay, µs to hold it (0 but with a
--                  max_wait); when it denies it: µs until it would admit it (with a max_wait,
--                  holding it max_wait then), meaningless when cost > quota (it never will)
--   reset_i        µs until zone i is back to its full quota
--   next_i         µs until zone i has at least one more whole unit than remaining_i (the
--                  next token, the oldest window entry leaving, the fixed window's end, the
--                  counter's estimate falling by one); 0 when it is full; 1 when
--                  only holds deny the request (a release may come at any moment)
--
-- Expiry: every admitting write sets a TTL (a bucket expires when u has drained to 0, a window
-- when its newest entry leaves it); a denial lengthens a TTL that the parameters in force need
-- longer (PEXPIRE GT), so that state never expires early after a reload that slowed the refill
-- or lengthened the window.

local EPSILON = 1e-9 -- float slack, so that refill arithmetic never loses a whole token
local HOLD_MAX = 5000000 -- µs a hold may wait for settle.lua before it counts as a charge

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end

-- The longest wait or TTL the script computes: 2^53 µs (285 years; a TTL in ms is at most 2^53
-- too). Larger figures come only from settings that contradict each other over one key (a
-- capacity of 2^53 drained at a tiny rate): clamped, they stay integers Redis and the reply
-- accept, never a number in exponent form.
local MAX_US = 9007199254740992

-- µs (whole, rounded up) for a bucket at `tokens` to reach `want`, never less than exact: a
-- request retried then finds tokens + EPSILON >= want. The correction steps grow with the
-- figure, so that a float too large for a 1µs step to change it still ends; at most MAX_US.
local function wait(tokens, want, rate)
  if tokens + EPSILON >= want then return 0 end
  local us = math.ceil((want - tokens) * 1000000 / rate)
  for _ = 1, 64 do
    if us >= MAX_US or tokens + us * rate / 1000000 + EPSILON >= want then break end
    us = us + math.max(1, math.ceil(us * 2.2e-16))
  end
  return math.min(us, MAX_US)
end

-- A TTL in ms, as the integer string PEXPIRE and SET PX take (at least 1, at most MAX_US).
local function ms(x)
  return string.format('%d', math.min(math.max(1, math.ceil(x)), MAX_US))
end

-- A fixed window's start as stored with its count: seconds since the Unix epoch, with the µs
-- only when the window does not start on a whole second (a short value: one small string per
-- client).
local function window_mark(start)
  if start % 1000000 == 0 then return string.format('%d', start / 1000000) end
  return string.format('%.6f', start / 1000000)
end

-- decide runs one decision: n zones, whose keys are KEYS[kbase + 1 .. kbase + n] and whose
-- arguments start at ARGV[abase]. It returns the decision's reply (see above).
local function decide(nonce, hold, n, kbase, abase)
  local holdmax = {} -- per zone: µs its token bucket charge is held at most; nil: charged now
  if hold == '1' then
    for i = 1, n do holdmax[i] = HOLD_MAX end
  elseif hold ~= '0' then
    local i = 0
    for x in string.gmatch(hold, '%d+') do
      i = i + 1
      if tonumber(x) > 0 then holdmax[i] = tonumber(x) end
    end
  end
  local reply = { 1 }
  local writes = {}
  local denied = {}

  for i = 1, n do
    local key = KEYS[kbase + i]
    local base = abase + 4 * (i - 1)
    local algo = ARGV[base]
    local quota = tonumber(ARGV[base + 1])
    local rate = tonumber(ARGV[base + 2])
    local cost = tonumber(ARGV[base + 3])
    local ok, remaining, retry, reset, nxt

    if algo == 'tb' then
      local max_wait = 0
      if rate == nil then -- "<rate>,<max_wait>"
        local r, w = string.match(ARGV[base + 2], '^([^,]+),(%d+)$')
        rate, max_wait = tonumber(r), tonumber(w)
      end
      local v = redis.call('HMGET', key, 'u', 'ts', 't', 'h')
      local used, ts, held = tonumber(v[1]), tonumber(v[2]), tonumber(v[4]) or 0
      local t = v[3]
      if t and string.sub(t, 1, 1) ~= '+' and ts then
        -- Written last by the previous script: t is the tokens left (of the same capacity) at ts.
        used = math.max(0, quota - tonumber(t))
      end
      if used == nil or ts == nil then
        used, ts, held = 0, now, 0
      elseif now > ts then
        used = math.max(0, used - (now - ts) * rate / 1000000)
        ts = now
      end
      -- now < ts only with `clock local` and skewed instances: keep ts, drain nothing.
      local holds
      local hwait = 0 -- µs until the last hold left would count as charged
      if held > 0 then
        -- Commit the holds that settle.lua never settled: a charge stays rather than vanish.
        holds = {}
        local all = redis.call('HGETALL', key)
        held = 0
        for j = 1, #all, 2 do
          local f = all[j]
          if string.sub(f, 1, 2) == 'h:' then
            local c, at = string.match(all[j + 1], '^(%d+)@(%d+)$')
            c, at = tonumber(c), tonumber(at)
            if c and now - at > HOLD_MAX then
              used = used + c
              holds[#holds + 1] = f
            elseif c then
              held = held + c
              hwait = math.max(hwait, at + HOLD_MAX - now)
            end
          end
        end
      end
      local tokens = quota - used - held
      local delay = wait(tokens, cost, rate) -- 0 when the bucket holds cost now
      if delay == 0 or (delay <= max_wait and cost <= quota) then
        ok = true
        retry = delay
        tokens = tokens - cost
        writes[#writes + 1] = { 'tb', key, used, ts, quota, rate, cost, held, holds, holdmax[i], hwait }
      else
        ok = false
        retry = delay
        if cost <= quota then retry = delay - max_wait end -- then admitted, and held max_wait
        denied[#denied + 1] = { key, math.max(1, math.ceil((used + held) / rate * 1000)) }
      end
      local whole = math.floor(tokens + EPSILON)
      remaining = math.max(0, whole)
      reset = wait(tokens, quota, rate)
      if whole >= quota then nxt = 0 else nxt = wait(tokens, math.max(whole, 0) + 1, rate) end
      if not ok and held > 0 and cost <= quota and wait(tokens + held, cost, rate) <= max_wait then
        nxt = 1 -- denied by holds that settle.lua may release at any moment: nothing to cache
      end
    elseif algo == 'sw' then
      -- The window is (now - window, now]: entries scored at or before now - window have left it.
      local from = '(' .. string.format('%d', now - rate)
      local count = redis.call('ZCOUNT', key, from, '+inf')
      local oldest = 0
      if count > 0 then
        oldest = tonumber(redis.call('ZRANGEBYSCORE', key, from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2])
      end
      if count + cost <= quota then
        ok = true
        remaining = quota - count - cost
        retry = 0
        reset = rate
        if count > 0 then nxt = math.max(1, oldest + rate - now) else nxt = rate end
        writes[#writes + 1] = { 'sw', key, cost, rate }
      else
        ok = false
        remaining = math.max(0, quota - count)
        if count > 0 then nxt = math.max(1, oldest + rate - now) else nxt = 0 end
        -- The request fits once (count + cost - quota) of the oldest entries have left.
        local need = count + cost - quota
        if need <= count then
          local e = redis.call('ZRANGEBYSCORE', key, from, '+inf', 'WITHSCORES', 'LIMIT', need - 1, 1)
          retry = math.max(1, tonumber(e[2]) + rate - now)
        else
          retry = rate -- cost > quota: never; reported as one window
        end
        if count > 0 then
          local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
          reset = math.max(0, tonumber(last[2]) + rate - now)
          denied[#denied + 1] = { key, math.max(1, math.ceil(reset / 1000)) }
        else
          reset = 0
        end
      end
    elseif algo == 'fw' then
      -- rate is "b0,b1,b2,b3": the windows [b0,b1), [b1,b2), [b2,b3) around the instance's clock.
      local b = {}
      for x in string.gmatch(ARGV[base + 2], '%d+') do b[#b + 1] = tonumber(x) end
      local start, stop = b[2], b[3]
      if now < b[2] then start, stop = b[1], b[2] elseif now >= b[3] then start, stop = b[3], b[4] end
      local mark = window_mark(start)
      local count = 0
      local v = redis.call('GET', key)
      if v then
        local m, c = string.match(v, '^([%d.]+):(%d+)$')
        if m == mark then count = tonumber(c) end
      end
      local left = math.max(1, stop - now)
      reset = left
      if count + cost <= quota then
        ok = true
        remaining = quota - count - cost
        retry = 0
        nxt = left
        writes[#writes + 1] = { 'fw', key, mark, count + cost, left }
      else
        ok = false
        remaining = math.max(0, quota - count)
        retry = left -- cost > quota: never; reported as the window's end
        if count > 0 then nxt = left else nxt = 0 end
      end
    else
      -- Sliding window counter: windows of `rate` µs aligned to the epoch; s is the current
      -- window's start, c its count, p the previous window's count.
      local start = now - now % rate
      local v = redis.call('HMGET', key, 's', 'c', 'p')
      local s, cur, prev = tonumber(v[1]), 0, 0
      if s == start then
        cur, prev = tonumber(v[2]) or 0, tonumber(v[3]) or 0
      elseif s == start - rate then
        prev = tonumber(v[2]) or 0
      end
      local elapsed = now - start
      local function estimate() return prev * (rate - elapsed) / rate + cur end
      -- µs until the estimate is at most target, if nothing more is admitted: the previous
      -- window's weight falls to 0 at the end of this window; the current count becomes the
      -- previous one then, and falls to 0 at the end of the next.
      local function when(target)
        if estimate() <= target + EPSILON then return 0 end
        if cur <= target + EPSILON then
          return math.max(1, math.ceil(rate * (1 - (target - cur) / prev)) - elapsed)
        end
        return math.max(1, rate - elapsed + math.ceil(rate * (1 - target / cur)))
      end
      if estimate() + cost <= quota + EPSILON then
        ok = true
        retry = 0
        cur = cur + cost
        writes[#writes + 1] = { 'sc', key, start, cur, prev, 2 * rate - elapsed }
      else
        ok = false
        if cost <= quota then retry = when(quota - cost) else retry = rate end
      end
      local est = estimate()
      remaining = math.max(0, math.floor(quota - est + EPSILON))
      reset = when(0)
      if est <= EPSILON then nxt = 0 else nxt = when(math.max(0, quota - remaining - 1)) end
    end

    if not ok then reply[1] = 0 end
    reply[#reply + 1] = ok and 1 or 0
    reply[#reply + 1] = remaining
    reply[#reply + 1] = retry
    reply[#reply + 1] = reset
    reply[#reply + 1] = nxt
  end

  if reply[1] == 0 then
    -- Nothing charged. A state the parameters in force need longer than its TTL must not expire
    -- early (GT: only ever lengthened; a key without a TTL keeps none).
    for _, d in ipairs(denied) do
      redis.call('PEXPIRE', d[1], ms(d[2]), 'GT')
    end
    return reply
  end

  for _, w in ipairs(writes) do
    if w[1] == 'tb' then
      local key, used, ts, quota, rate, cost, held, holds = w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9]
      local hmax, hwait = w[10], w[11]
      if holds and #holds > 0 then redis.call('HDEL', key, unpack(holds)) end
      if hmax then
        held = held + cost
        hwait = math.max(hwait, hmax)
        redis.call('HSET', key, 'h:' .. nonce, string.format('%d@%d', cost, now + hmax - HOLD_MAX))
      else
        used = used + cost
      end
      local fields = { 'u', string.format('%.17g', used), 'ts', string.format('%d', ts),
        't', '+' .. string.format('%.17g', quota - used - held) }
      if held > 0 then
        fields[#fields + 1] = 'h'
        fields[#fields + 1] = string.format('%d', held)
      elseif holds then
        redis.call('HDEL', key, 'h')
      end
      redis.call('HSET', key, unpack(fields))
      local ttl = math.ceil(used / rate * 1000)
      if held > 0 then ttl = ttl + math.ceil(math.max(hwait, HOLD_MAX) / 1000) + 1000 end
      redis.call('PEXPIRE', key, ms(ttl))
    elseif w[1] == 'fw' then
      -- Kept a second past the window's end, so that a clock a little behind still finds it.
      redis.call('SET', w[2], w[3] .. ':' .. string.format('%d', w[4]), 'PX', ms(w[5] / 1000 + 1000))
    elseif w[1] == 'sc' then
      redis.call('HSET', w[2], 's', string.format('%d', w[3]), 'c', string.format('%d', w[4]),
        'p', string.format('%d', w[5]))
      redis.call('PEXPIRE', w[2], ms(w[6] / 1000))
    else
      local key, cost, window = w[2], w[3], w[4]
      redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
      local args = {}
      for j = 1, cost do
        args[#args + 1] = now
        args[#args + 1] = nonce .. ':' .. j
        if #args >= 1000 or j == cost then
          redis.call('ZADD', key, unpack(args))
          args = {}
        end
      end
      redis.call('PEXPIRE', key, ms(window / 1000))
    end
  end

  return reply
end

-- The decisions, in order: each all-or-nothing on its own, each seeing the writes of those
-- before it.
local out = {}
local kbase, a = 0, 2
while a <= #ARGV do
  local nonce, hold, n = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  local r = decide(nonce, hold, n, kbase, a + 3)
  for j = 1, #r do out[#out + 1] = r[j] end
  kbase, a = kbase + n, a + 3 + 4 * n
end
return out
