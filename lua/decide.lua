#!lua
-- decide.lua: admit or deny a batch of requests, each against every zone that applies to it,
-- each all-or-nothing, in order: one script call (one EVALSHA) for all the decisions that share a
-- round trip, so that Redis pays the call's overhead once for the batch. Each algorithm's state
-- and rule are stated with its functions below (tb_, sw_, fw_, sc_, cc_).
--
-- The shebang declares no flags: the script may write, and without `allow-oom` Redis refuses the
-- whole call with an OOM error when it is over `maxmemory`, before anything runs. Nothing is
-- written before every zone of a decision has decided, and nothing at all when a zone denies
-- except a longer TTL (see decide).
--
-- KEYS     the keys of every decision, in order: a decision of n zones takes the state keys of
--          its zones (`<prefix>{<client key>}:<zone>:<tb|sw|fw|sc|cc|ac>`), then the record key
--          (`<state key>:<nonce>`) and the generation key (`<state key>:gen`) of each of its
--          fixed window and sliding window counter zones whose charge is to be recorded for
--          settlement, in zone order (a record key is told from the next decision's state key by
--          its name), then the keys its zones' flags name (override and block keys, each at the
--          index within the decision its flag gives); so a decision takes n keys or more.
-- ARGV[1]  now, in µs since the Unix epoch, or "" to read the Redis server clock (TIME); one
--          time for the whole batch.
-- Then per decision, in order:
--   nonce    unique to the decision (across instances and calls): sliding window members are
--            "<nonce>:<n>" for n = 1..cost, holds are "h:<nonce>", records "<state key>:<nonce>",
--            concurrency slots "<nonce>", so settle.lua can find exactly what the decision added;
--            "" for a decision that adds none of them (no sliding window zone, hold "0")
--   hold     "1": take token bucket charges as holds (see settle.lua); "0": charge them; or one
--            number per zone, comma-separated: µs that zone's token bucket charge is held at
--            most before it counts as charged (0: charge it now), or that a window counter's
--            record or a concurrency slot lives
--   n        the number of zones
--   and 5 arguments per zone (read by read_decision):
--   algorithm  "tb" (token bucket), "sw" (sliding window log), "fw" (fixed window), "sc"
--              (sliding window counter), "cc" (concurrency) or "ac" (adaptive concurrency)
--   quota      tb: capacity (tokens); sw, fw, sc: limit (requests per window); cc: limit (slots);
--              ac: the ceiling of its learnt limit (slots)
--   rate       tb: refill rate (tokens/s, float > 0), or "<rate>,<max_wait>" to shape: the
--              longest the request may be held (µs, integer > 0); sw, sc: window (µs, integer > 0);
--              fw: "b0,b1,b2,b3" (µs): the windows [b0,b1), [b1,b2), [b2,b3) around the
--              instance's clock, of which the one holding now is used; cc: "0" (unused); ac: its
--              controller, "<min limit>,<buffer ppm>,<update µs>,<probe every µs>,<probe samples>"
--              (settle.lua reads it)
--   cost       tokens or window slots this request takes (integer >= 1); tb, fw: or "<cost>,<ask>"
--              to ask for a lease's grant of about ask units (see lease_grant)
--   flags      "" or, in this order: "s" (a shadow zone), "u" (a cost "<cost>,<ask>" is granted
--              all the zone holds up to ask: see lease_grant), "o<k>:<max_cost>" (overrides, the
--              override key the decision's key k; see "Shadow zones and overrides"),
--              "b<block>,<block_max>:<k>" (a block, µs, the block key the decision's key k; see
--              Penalty box), "q<k>" (a concurrency or token bucket zone's queue: the
--              decision's key k is its waiters' sorted set, see queue.lua), "t<k>:<entries>,<ttl>"
--              (a top: the decision's keys k and k + 1 are its denied and used sorted sets, k + 2
--              and k + 3 their errors, see Top), "n<ppm>" (a near limit: see Near limit), "a<k>"
--              (an adaptive concurrency zone: the decision's key k is its controller's hash), then
--              "|<id>" (a claim: waiter id holds a reserved slot or tokens, see queue.lua),
--              always last
--
-- Reply: an array of integers, per decision in order: allowed, then per zone i: allowed_i,
-- remaining_i, retry_after_i, reset_i, next_i, then granted_i when the zone's cost asks for a
-- lease, then block_i when the zone has a block, then quota_i, window_i and max_cost_i when the
-- zone has overrides (see "Shadow zones and overrides"), then near_i when the zone has a near
-- limit, then limit_i, min_rtt_i and rtt_i when it is an adaptive concurrency zone. A decision of
-- n zones, k of which ask for a lease, b have a block, v have overrides, m a near limit and c are
-- adaptive, so gives 1 + 5n + k + b + 3v + m + 3c integers:
--   allowed        1 if every zone admits the request (and all were charged), else 0; a shadow
--                  zone's denial does not count
--   allowed_i      1 if zone i alone would admit the request, else 0
--   remaining_i    whole units (tokens, slots) left: after this request (and its grant) if zone i
--                  alone admits it, else as they are now
--   retry_after_i  when zone i alone admits the request: its delay, µs to hold it (0 but with a
--                  max_wait); when it denies it: µs until it would admit it (with a max_wait,
--                  holding it max_wait then), meaningless when cost > quota (it never will)
--   reset_i        µs until zone i is back to its full quota
--   next_i         µs until zone i has at least one more whole unit than remaining_i (the
--                  next token, the oldest window entry leaving, the fixed window's end, the
--                  counter's estimate falling by one); 0 when it is full; 1 when only holds
--                  deny the request (a release may come at any moment), or, for a concurrency
--                  zone, while a slot is taken
--   granted_i      the units zone i charged for the lease (see lease_grant), 0 when it denied
--   block_i        1 when a block in force refused the request, 2 when zone i denied it and its
--                  block starts now, else 0 (see Penalty box)
--   near_i         1 when zone i admits the request and its charge takes the client from below
--                  its near limit to at or past it, else 0 (see Near limit); the charge is made
--                  only when allowed is 1
--   limit_i        the limit in force of adaptive concurrency zone i (slots; see ac_algorithm)
--   min_rtt_i      its minimum latency, µs (0 before the first probe ends)
--   rtt_i          the mean latency of its last update interval, µs (0 before one)

local EPSILON = 1e-9 -- float slack, so that refill arithmetic never loses a whole token
local HOLD_MAX = 5000000 -- µs a hold may wait for settle.lua before it counts as a charge
local max, min, ceil, floor, sformat, byte = math.max, math.min, math.ceil, math.floor, string.format, string.byte
local call = redis.call -- as an upvalue: cheaper than the global on the hot path

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local NOW = sformat('%d', now) -- now as a stored time

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
  local us = ceil((want - tokens) * 1000000 / rate)
  for _ = 1, 64 do
    if us >= MAX_US or tokens + us * rate / 1000000 + EPSILON >= want then break end
    us = us + max(1, ceil(us * 2.2e-16))
  end
  if us > MAX_US then return MAX_US end
  return us
end

-- A TTL in ms, as the integer string PEXPIRE and SET PX take (at least 1, at most MAX_US).
local MS = {} -- per batch: each TTL's text, formatted once
local function ms(x)
  x = ceil(x)
  if not (x >= 1) then x = 1 elseif x > MAX_US then x = MAX_US end -- NaN: 1
  local s = MS[x]
  if not s then s = sformat('%d', x); MS[x] = s end
  return s
end

-- A float as stored (u; t with plus): '%.17g', which every script version reads back exactly;
-- a nonzero integer (the same text) by the much cheaper '%d', once per batch.
local INT, PLUS = {}, {}
local function g17(x, plus)
  if x % 1 == 0 and x ~= 0 and x > -MAX_US and x < MAX_US then
    local memo = plus and PLUS or INT
    local s = memo[x]
    if not s then s = sformat(plus and '+%d' or '%d', x); memo[x] = s end
    return s
  end
  return sformat(plus and '+%.17g' or '%.17g', x)
end

-- lease_grant is the size of a lease's grant for a zone (token bucket, fixed window) holding
-- tokens >= cost, asked with a cost "<cost>,<ask>" (ask >= cost): never more than ask, never
-- more than half of what the zone has left, never less than cost. The zone charges these units
-- instead of cost when it admits the request: a token bucket as a hold (its hold time is the
-- zone's, in the hold argument), a fixed window in its count, recorded for settlement (record
-- and generation keys given, as for a charge settled after the response). So near the limit
-- grants shrink to one request's cost, and a denial is decided on Redis's count exactly as
-- without leases. settle.lua "amount" later charges what the instance spent of the grant and
-- gives back the rest (a fixed window's, while its window lasts).
-- With upto (the zone's flag "u": a request whose use is bounded by ask, an LLM request's output
-- cap), the grant is all the zone holds up to ask, never less than cost.
local function lease_grant(tokens, cost, ask, upto)
  if upto then return max(cost, min(ask, floor(tokens + EPSILON))) end
  return max(cost, min(ask, floor(tokens / 2 + EPSILON)))
end

-- Token bucket ------------------------------------------------------------------------------------
-- State: a hash holding what the client has USED, not what it has left:
--   u   tokens used (float >= 0), drained at the refill rate in force, so that the tokens
--       available are always capacity - u under the capacity in force (a raised capacity gives
--       every client the difference at once, a lowered one takes it away at once)
--   ts  the time of u (µs)
--   t   capacity - u - held, for instances still running the previous script (which stored the
--       tokens left in t and ts). It is written with a leading '+', which the previous script
--       never writes: a t without it means the previous script wrote last, and u is stale.
--       (docs/decisions.md "Scripts" says which release drops t.)
--   h   the sum of the holds below, absent when there are none
--   h:<nonce>  a hold: "<cost>@<µs>", tokens reserved by a call with hold = 1 (Redis Cluster,
--       when a request's zones are in several hash slots) or a hold time (charge after the
--       response) until settle.lua commits it into u or releases it. A hold whose µs is more
--       than HOLD_MAX in the past is committed by whichever call finds it. A hold of its own
--       maximum m is written with µs = now + m - HOLD_MAX: the same form and the same rule, so
--       every script version and the admin API read it alike.
--   h:q:<id>  a queue's reservation for its waiter id (see queue.lua): a hold of its own
--       maximum, the queue's claim time. The claim of waiter id (flag "|<id>") takes it as its
--       request's tokens, whatever the bucket holds; never claimed, it counts as charged.
-- With a queue (flag "q<k>": priority classes and a max_wait), a request is denied while a
-- waiter with a live lease waits, and no request is held (no max_wait is sent).
-- It admits a request iff capacity - u - held >= cost, or, with a max_wait (shaping), iff it
-- would within max_wait (and cost <= capacity): the request is then charged now, u going above
-- the capacity (a debt of at most max_wait × rate), and its delay is the time until the bucket
-- would have held cost tokens. Each reservation deepens the debt, so held requests come out in
-- order, at the refill rate, whichever instance holds them. The key expires when u has drained
-- to 0 (with holds, when u and the holds would have, counted as charged once the last of them
-- is past its time, and a second; see tb_set).

-- tb_drain reads a bucket's u, ts and t (v, as HMGET returns them): the tokens used at now
-- (drained at rate since ts) and their time, now; or, when ts is after now (`clock local` with
-- skewed instances), those of ts, drained nothing. A bucket with no state has used 0 at now,
-- and a third result, true.
local function tb_drain(v, quota, rate)
  local used, ts, t = tonumber(v[1]), tonumber(v[2]), v[3]
  if t and ts and byte(t) ~= 43 then -- no '+': the previous script wrote last
    used = max(0, quota - tonumber(t)) -- t is the tokens left (of the same capacity) at ts
  end
  if used == nil or ts == nil then return 0, now, true end
  if now > ts then return max(0, used - (now - ts) * rate / 1000000), now end
  return used, ts
end

-- tb_admit decides a request of cost against a bucket holding tokens (capacity - used - held,
-- below 0 in debt) under a max_wait (0: none) and, with ask, a lease's grant asked. It returns
-- ok, the tokens to take (cost or the grant; 0 when denied) and the zone's remaining,
-- retry_after, reset and next (see the reply above).
local function tb_admit(tokens, quota, rate, cost, max_wait, ask, upto)
  local ok, taken, delay = true, cost, 0
  if tokens + EPSILON < cost then delay = wait(tokens, cost, rate) end -- 0 when it holds cost now
  if delay == 0 then
    if ask then taken = lease_grant(tokens, cost, ask, upto) end
  elseif delay > max_wait or cost > quota then
    ok, taken = false, 0
    if cost <= quota then delay = delay - max_wait end -- then admitted, and held max_wait
  end
  tokens = tokens - taken
  local whole = floor(tokens + EPSILON)
  local nxt = 0
  if whole < quota then nxt = wait(tokens, max(whole, 0) + 1, rate) end
  return ok, taken, max(0, whole), delay, wait(tokens, quota, rate), nxt
end

-- tb_ttl is the TTL (ms) a bucket's state needs: until u has drained to 0; with holds (held >
-- 0), until u and the holds would have drained had every hold counted as charged when the
-- longest of them does (hwait µs, at least HOLD_MAX), and a second: a hold that no call commits
-- is still charged until it has drained.
local function tb_ttl(used, rate, held, hwait)
  if held > 0 then
    return ceil((used + held) / rate * 1000) + ceil(max(hwait, HOLD_MAX) / 1000) + 1000
  end
  return ceil(used / rate * 1000)
end

-- tb_set writes a bucket: u (used) and ts, t for the previous script, h when holds are pending
-- (held > 0), and its TTL (tb_ttl).
local function tb_set(key, used, ts, quota, rate, held, hwait)
  if ts == now then ts = NOW else ts = sformat('%d', ts) end
  if held > 0 then
    call('HSET', key, 'u', g17(used), 'ts', ts, 't', g17(quota - used - held, true),
      'h', sformat('%d', held))
  else
    call('HSET', key, 'u', g17(used), 'ts', ts, 't', g17(quota - used - held, true))
  end
  call('PEXPIRE', key, ms(tb_ttl(used, rate, held, hwait)))
end

-- Algorithms ----------------------------------------------------------------------------------------
-- Each algorithm is a constructor, <tag>_algorithm, that returns its decide function built with
-- its other functions ("tb", "sw", "cc", "fw" and "sc"; see algorithm). Redis creates a script's
-- functions anew on each call, a closure each: decide builds an algorithm's only when a decision
-- of the call first needs it, and fast needs none. Each decide function takes (key, quota, rate, cost, ask, nonce,
-- hmax, rkey, gkey, writes, denied, upto, z): a zone's state key and arguments as the ARGV above (cost
-- split from ask, the lease's grant asked, nil: none; upto, its flag "u"; z, the zone's table of
-- read_decision: its queue and claim), its hold time (µs; nil: charged now, a
-- record or slot living HOLD_MAX), its record and generation keys when its charge is recorded
-- (window counters), the list of writes it appends its write to when it admits ({ its take
-- function, arguments }), and the list of { key, TTL (ms) its state needs } it appends to when
-- it denies; and returns ok, remaining, retry_after, reset, next and, for a lease, the units
-- granted; a token bucket also the tokens it held before the request (see Near limit).
local function tb_algorithm()
  -- tb_take makes the write of an admitting token bucket: w = { tb_take, key, used, ts, quota,
  -- rate, tokens taken, held, the holds committed, the zone's hold time (nil: charge now), hwait }.
  local function tb_take(w, nonce)
    local key, used, ts, quota, rate, cost, held, holds = w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9]
    local hmax, hwait = w[10], w[11]
    if holds and #holds > 0 then redis.call('HDEL', key, unpack(holds)) end
    if hmax then
      held = held + cost
      hwait = max(hwait, hmax)
      redis.call('HSET', key, 'h:' .. nonce, sformat('%d@%d', cost, now + hmax - HOLD_MAX))
    else
      used = used + cost
    end
    if holds and not (held > 0) then redis.call('HDEL', key, 'h') end
    tb_set(key, used, ts, quota, rate, held, hwait)
  end

  -- tb_decide decides a token bucket zone (see the state above): rate is "<rate>" or
  -- "<rate>,<max_wait>".
  local function tb_decide(key, quota, rate, cost, ask, nonce, hmax, rkey, gkey, writes, denied, upto, z)
    local max_wait = 0
    local r = tonumber(rate)
    if r == nil then -- "<rate>,<max_wait>"
      local a, w = string.match(rate, '^([^,]+),(%d+)$')
      r, max_wait = tonumber(a), tonumber(w)
    end
    rate = r
    local v = redis.call('HMGET', key, 'u', 'ts', 't', 'h')
    local used, ts, empty = tb_drain(v, quota, rate)
    local held = 0
    if not empty then held = tonumber(v[4]) or 0 end
    local holds
    local hwait = 0 -- µs until the last hold left would count as charged
    local claimed -- a claim's reservation (queue.lua's hold "h:q:<id>"): its tokens, now its own
    if held > 0 then
      -- Commit the holds that settle.lua never settled: a charge stays rather than vanish.
      holds = {}
      local all = redis.call('HGETALL', key)
      local mine = z.claim and 'h:q:' .. z.claim
      held = 0
      for j = 1, #all, 2 do
        local f = all[j]
        if string.sub(f, 1, 2) == 'h:' then
          local c, at = string.match(all[j + 1], '^(%d+)@(%d+)$')
          c, at = tonumber(c), tonumber(at)
          if c and now - at > HOLD_MAX then
            used = used + c
            holds[#holds + 1] = f
          elseif c and f == mine then
            claimed = c
            holds[#holds + 1] = f
          elseif c then
            held = held + c
            hwait = max(hwait, at + HOLD_MAX - now)
          end
        end
      end
    end
    local tokens = quota - used - held
    if claimed then
      -- The reservation admits the request: its tokens were taken for it by queue.lua.
      tokens = max(tokens + claimed, cost)
    elseif z.qkey and redis.call('ZCOUNT', z.qkey, '(' .. NOW, '+inf') > 0 then
      -- A waiter with a live lease waits (queue.lua): no request overtakes it.
      denied[#denied + 1] = { key, max(1, tb_ttl(used, rate, held, hwait)) }
      return false, max(0, floor(tokens + EPSILON)), max(wait(tokens, cost, rate), ceil(cost * 1000000 / rate)),
        wait(tokens, quota, rate), 1, 0
    end
    local ok, taken, remaining, retry, reset, nxt = tb_admit(tokens, quota, rate, cost, max_wait, ask, upto)
    if ok then
      writes[#writes + 1] = { tb_take, key, used, ts, quota, rate, taken, held, holds, hmax, hwait }
    else
      denied[#denied + 1] = { key, max(1, tb_ttl(used, rate, held, hwait)) }
      if held > 0 and cost <= quota and wait(tokens + held, cost, rate) <= max_wait or z.qkey then
        nxt = 1 -- denied by holds that settle.lua may release at any moment, or with a queue to
        -- wait in: nothing to cache
      end
    end
    return ok, remaining, retry, reset, nxt, taken, tokens
  end
  return tb_decide
end

local function sw_algorithm()
  -- Sliding window log ----------------------------------------------------------------------------
  -- State: a sorted set of admitted request units scored by time (µs), members "<nonce>:<n>". It
  -- admits a request iff (units younger than the window) + cost <= limit. The key expires when
  -- its newest entry leaves the window.

  -- sw_take adds the units of w = { sw_take, key, cost, window }, the entries that have left the
  -- window removed.
  local function sw_take(w, nonce)
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

  -- sw_decide decides a sliding window log zone of `window` µs, as tb_decide.
  local function sw_decide(key, quota, window, cost, ask, nonce, hmax, rkey, gkey, writes, denied)
    window = tonumber(window)
    local ok, remaining, retry, reset, nxt
    -- The window is (now - window, now]: entries scored at or before now - window have left it.
    local from = '(' .. sformat('%d', now - window)
    local count = redis.call('ZCOUNT', key, from, '+inf')
    local oldest = 0
    if count > 0 then
      oldest = tonumber(redis.call('ZRANGEBYSCORE', key, from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2])
    end
    if count + cost <= quota then
      ok = true
      remaining = quota - count - cost
      retry = 0
      reset = window
      if count > 0 then nxt = max(1, oldest + window - now) else nxt = window end
      writes[#writes + 1] = { sw_take, key, cost, window }
    else
      ok = false
      remaining = max(0, quota - count)
      if count > 0 then nxt = max(1, oldest + window - now) else nxt = 0 end
      -- The request fits once (count + cost - quota) of the oldest entries have left.
      local need = count + cost - quota
      if need <= count then
        local e = redis.call('ZRANGEBYSCORE', key, from, '+inf', 'WITHSCORES', 'LIMIT', need - 1, 1)
        retry = max(1, tonumber(e[2]) + window - now)
      else
        retry = window -- cost > quota: never; reported as one window
      end
      if count > 0 then
        local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
        reset = max(0, tonumber(last[2]) + window - now)
        denied[#denied + 1] = { key, max(1, ceil(reset / 1000)) }
      else
        reset = 0
      end
    end
    return ok, remaining, retry, reset, nxt
  end
  return sw_decide
end

local function cc_algorithm()
  -- Concurrency -----------------------------------------------------------------------------------
  -- State: a sorted set of the slots of the client's requests in flight: member "<nonce>" (the
  -- decision's), score its deadline (µs). A slot whose deadline is at or before now is free (its
  -- instance died, or lost Redis, without giving it back). A request is admitted iff fewer than
  -- limit slots are live; its slot's deadline is now + its hold time (the zone's hold_max).
  -- settle.lua removes the slot (ZREM) once the response is complete; refresh.lua moves the
  -- deadlines of slots still in flight on. The admission removes the slots past their deadline,
  -- so the set never holds more than limit members after a write, and the key expires a second
  -- after its last deadline. Reply: remaining the free slots (after this request when admitted);
  -- a denial's retry after 1 s (a slot comes back when a response ends, which no clock tells: the
  -- client is told to try again in a second); reset and next 1 µs while a slot is taken (a slot
  -- may come back at any moment: nothing for a deny cache to keep), 0 when none is.

  -- cc_take takes the slot of w = { cc_take, key, nonce, deadline }: the slots past their
  -- deadline go, the new one is added, and the key lives a second past the latest deadline.
  local function cc_take(w)
    local key = w[2]
    redis.call('ZREMRANGEBYSCORE', key, '-inf', sformat('%d', now))
    redis.call('ZADD', key, sformat('%d', w[4]), w[3])
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', key, ms((tonumber(last[2]) - now) / 1000 + 1000))
  end

  -- cc_claim is cc_take for a waiter's reserved slot, w = { cc_claim, key, nonce, deadline,
  -- the reservation's member }: the reservation becomes the request's slot.
  local function cc_claim(w)
    redis.call('ZREM', w[2], w[5])
    cc_take(w)
  end

  -- cc_decide decides a concurrency zone whose slot lives lease µs, as tb_decide (a denial
  -- lengthens no TTL). With a queue (z.qkey, queue.lua's waiters), a request is denied while
  -- a waiter with a live lease waits, so that no request overtakes a waiter; with a claim
  -- (z.claim, a waiter's id), the waiter's reserved slot, while it lives, admits the request.
  local function cc_decide(key, quota, rate, cost, ask, nonce, hmax, rkey, gkey, writes, _, _, z)
    local lease = hmax or HOLD_MAX
    local live = redis.call('ZCOUNT', key, '(' .. sformat('%d', now), '+inf')
    if z.claim then
      local member = 'q:' .. z.claim
      local s = tonumber(redis.call('ZSCORE', key, member))
      if s and s > now then
        writes[#writes + 1] = { cc_claim, key, nonce, now + lease, member }
        return true, max(0, quota - live), 0, 1, 1
      end
    elseif z.qkey and redis.call('ZCOUNT', z.qkey, '(' .. NOW, '+inf') > 0 then
      return false, max(0, quota - live), 1000000, 1, 1
    end
    if live + cost <= quota then
      writes[#writes + 1] = { cc_take, key, nonce, now + lease }
      return true, quota - live - cost, 0, 1, 1
    end
    local taken = 0
    if live > 0 then taken = 1 end
    return false, max(0, quota - live), 1000000, taken, taken
  end
  return cc_decide
end

local function ac_algorithm()
  -- Adaptive concurrency -------------------------------------------------------------------------
  -- A concurrency zone (its slots as cc's, decided by cc's function) whose limit in force is
  -- learnt: the field e of its controller's hash (z.akey, `<state key>:ctl`, written by
  -- settle.lua: see "Adaptive concurrency" there), at most the zone's limit (its ceiling, so that
  -- a lower limit in the configuration applies at once); the min limit (the first number of its
  -- rate argument) while the hash holds none. The zone's reply adds the limit in force, and the
  -- minimum latency (m) and the last window's latency (r), µs (0 before they are measured).
  local cc_decide = cc_algorithm()
  local function ac_decide(key, quota, rate, cost, ask, nonce, hmax, rkey, gkey, writes, denied, upto, z)
    local v = call('HMGET', z.akey, 'e', 'm', 'r')
    local limit = max(1, min(quota, tonumber(v[1]) or tonumber(string.match(rate, '^%d+'))))
    z.learnt = { limit, tonumber(v[2]) or 0, tonumber(v[3]) or 0 }
    return cc_decide(key, limit, rate, cost, ask, nonce, hmax, rkey, gkey, writes, denied, upto, z)
  end
  return ac_decide
end

-- Window counters' records ----------------------------------------------------------------------
-- A window counter's (fixed window, sliding window counter) charge settled after the response
-- (count_status, charge, a lease's grant), or released or committed by settle.lua on Redis
-- Cluster when a request's zones are in several hash slots (hold = 1, or a hold time): the
-- counters have no holds. The cost is counted at admission as any other (so concurrent requests
-- cannot overshoot), and the admission writes a record of it in a key of its own,
-- `<state key>:<nonce>` in the same hash slot: a string "<window start µs>:<cost>:<generation>"
-- that expires after the zone's hold time (hold_max; HOLD_MAX with hold = 1). The generation is
-- the count's: the value of `<state key>:gen`, which the first record of a count creates
-- (holding that record's nonce) and each record keeps alive at least as long as itself, and
-- which an admin reset deletes together with the state. settle.lua deletes the record and adds
-- the difference (what the response reports less the cost; less the whole cost to give it back)
-- to the count of the window the charge went into, while that window is the current one and the
-- count of the record's generation: once the window has ended, or the state was reset, the
-- charge is no longer in the count, and nothing is given back or charged. A settle that finds no
-- record changes nothing: settled already (a retry, a call sent twice), or older than its hold
-- time (the charge stands as taken). A count may go above the limit (debt, a response that
-- reported more than was reserved): requests are then denied until the window moves (the fixed
-- window's end; for the sliding window counter, until the estimate falls to limit - cost). Why
-- keys of their own: the fixed window's string is read by the previous script with GET and an
-- exact pattern (anything else is a count of 0, a hash is WRONGTYPE), so a record (or a
-- generation) inside it would break instances still running that script during a rolling
-- upgrade; the state keys keep their encodings, which both versions read and write alike, and a
-- client with no charge pending keeps its one small string.

-- record writes the record rec = { record key, window start, cost, hold time (nil: HOLD_MAX),
-- generation key }, creating the generation when there is none.
local function record(rec, nonce)
  local ttl = ms((rec[4] or HOLD_MAX) / 1000)
  local gen = redis.call('GET', rec[5])
  if gen then
    redis.call('PEXPIRE', rec[5], ttl, 'GT') -- lives at least as long as each of its records
  else
    gen = nonce
    redis.call('SET', rec[5], gen, 'PX', ttl)
  end
  redis.call('SET', rec[1], sformat('%d:%d:', rec[2], rec[3]) .. gen, 'PX', ttl)
end

local function fw_algorithm()
  -- Fixed window ----------------------------------------------------------------------------------
  -- State: a string "<window start>:<count>", the start in seconds since the epoch (with µs when
  -- not whole); a count of another window is a count of 0. It admits a request iff count + cost
  -- <= limit. The key lives until a second past the window's end.

  -- A fixed window's start as stored with its count: seconds since the Unix epoch, with the µs
  -- only when the window does not start on a whole second (a short value: one small string per
  -- client).
  local function window_mark(start)
    if start % 1000000 == 0 then return sformat('%d', start / 1000000) end
    return sformat('%.6f', start / 1000000)
  end

  -- fw_take writes w = { fw_take, key, mark, count, µs left in the window, rec = the record }.
  local function fw_take(w, nonce)
    -- Kept a second past the window's end, so that a clock a little behind still finds it.
    redis.call('SET', w[2], w[3] .. ':' .. sformat('%d', w[4]), 'PX', ms(w[5] / 1000 + 1000))
    if w.rec then record(w.rec, nonce) end
  end

  -- fw_decide decides a fixed window zone, as tb_decide: bounds is "b0,b1,b2,b3" (see ARGV);
  -- rkey and gkey, when given, are the keys of the charge's record (hold time hmax).
  local function fw_decide(key, quota, bounds, cost, ask, nonce, hmax, rkey, gkey, writes, _, upto)
    local b = {}
    for x in string.gmatch(bounds, '%d+') do b[#b + 1] = tonumber(x) end
    local start, stop = b[2], b[3]
    if now < b[2] then start, stop = b[1], b[2] elseif now >= b[3] then start, stop = b[3], b[4] end
    local mark = window_mark(start)
    local count = 0
    local v = redis.call('GET', key)
    if v then
      local m, c = string.match(v, '^([%d.]+):(%d+)$')
      if m == mark then count = tonumber(c) end
    end
    local left = max(1, stop - now)
    if count + cost <= quota then
      local granted = cost
      if ask then granted = lease_grant(quota - count, cost, ask, upto) end
      local rec = rkey and { rkey, start, granted, hmax, gkey }
      writes[#writes + 1] = { fw_take, key, mark, count + granted, left, rec = rec }
      return true, quota - count - granted, 0, left, left, granted
    end
    local nxt = 0
    if count > 0 then nxt = left end
    return false, max(0, quota - count), left, left, nxt, 0 -- cost > quota: never; retry: the end
  end
  return fw_decide
end

local function sc_algorithm()
  -- Sliding window counter ------------------------------------------------------------------------
  -- State: a hash { s = the current window's start (µs, windows aligned to the epoch), c = its
  -- count, p = the previous window's count }. It admits a request iff p * (share of the previous
  -- window still inside the sliding window) + c + cost <= limit. The key expires at the end of the
  -- next window, when its count no longer weighs.

  -- sc_take writes w = { sc_take, key, s, c, p, µs to keep it, rec = the record }.
  local function sc_take(w, nonce)
    redis.call('HSET', w[2], 's', sformat('%d', w[3]), 'c', sformat('%d', w[4]), 'p', sformat('%d', w[5]))
    redis.call('PEXPIRE', w[2], ms(w[6] / 1000))
    if w.rec then record(w.rec, nonce) end
  end

  -- sc_decide decides a sliding window counter zone of `window` µs, as fw_decide.
  local function sc_decide(key, quota, window, cost, ask, nonce, hmax, rkey, gkey, writes)
    window = tonumber(window)
    local ok, retry, nxt
    local start = now - now % window
    local v = redis.call('HMGET', key, 's', 'c', 'p')
    local s, cur, prev = tonumber(v[1]), 0, 0
    if s == start then
      cur, prev = tonumber(v[2]) or 0, tonumber(v[3]) or 0
    elseif s == start - window then
      prev = tonumber(v[2]) or 0
    end
    local elapsed = now - start
    local function estimate() return prev * (window - elapsed) / window + cur end
    -- µs until the estimate is at most target, if nothing more is admitted: the previous
    -- window's weight falls to 0 at the end of this window; the current count becomes the
    -- previous one then, and falls to 0 at the end of the next.
    local function when(target)
      if estimate() <= target + EPSILON then return 0 end
      if cur <= target + EPSILON then
        return max(1, ceil(window * (1 - (target - cur) / prev)) - elapsed)
      end
      return max(1, window - elapsed + ceil(window * (1 - target / cur)))
    end
    if estimate() + cost <= quota + EPSILON then
      ok = true
      retry = 0
      cur = cur + cost
      local rec = rkey and { rkey, start, cost, hmax, gkey }
      writes[#writes + 1] = { sc_take, key, start, cur, prev, 2 * window - elapsed, rec = rec }
    else
      ok = false
      if cost <= quota then retry = when(quota - cost) else retry = window end
    end
    local est = estimate()
    local remaining = max(0, floor(quota - est + EPSILON))
    if est <= EPSILON then nxt = 0 else nxt = when(max(0, quota - remaining - 1)) end
    return ok, remaining, retry, when(0), nxt
  end
  return sc_decide
end

-- algorithms are the algorithms' constructors, by tag: each builds the decide function of its
-- algorithm, with its other functions, when a decision of the call first needs it.
local algorithms = { tb = tb_algorithm, sw = sw_algorithm, cc = cc_algorithm, fw = fw_algorithm, sc = sc_algorithm,
  ac = ac_algorithm }

-- algorithm returns the decide function of the algorithm tagged tag; any tag algorithms lacks is
-- an error.
local function algorithm(tag)
  local make = algorithms[tag]
  if not make then error('decide: unknown algorithm ' .. tostring(tag)) end
  return make()
end

-- Penalty box -----------------------------------------------------------------------------------
-- A zone with a block (its flag "b<block µs>,<block_max µs>:<k>") takes a block key,
-- `<prefix>{<client key>}:<zone>:block`, in its state key's hash slot, at the decision's key k.
-- The key holds "<until>:<length>:<strikes>": when the block ends (µs), how long
-- it was (µs), and how many blocks in a row it ends (1: a first offence).
--   - Before the zone's algorithm, the block key is read: while a block is in force (until >
--     now), the zone refuses the request (its algorithm does not run: nothing read, nothing
--     charged anywhere, as for any denial), with remaining 0 and retry after, reset and next the
--     block's remaining time; its block integer is 1.
--   - When the zone's algorithm denies the request (its cost within the quota: a cost it can
--     never admit starts no block), the block starts in the same call: its block integer is 2,
--     remaining 0, retry after and next the block's length, reset at least that. The length is
--     block; with a block_max, twice the last block, at most block_max, when the key still
--     remembers one (a repeat offender), with one strike more. The key expires when the block
--     ends, or with a block_max as long after that as the block lasted: the strikes decay then.
-- A zone without a block reads and writes no block key.

-- penalty_box returns the penalty box's functions { read, length, write }, built on first
-- use, as the algorithms' are (see algorithm): a call with no block creates none of them.
local PB
local function penalty_box()
  if PB then return PB end
  -- block_read returns a block key's until, length and strikes; nil when there is none (or it
  -- cannot be read).
  local function block_read(bkey)
    local v = call('GET', bkey)
    if not v then return nil end
    local u, l, n = string.match(v, '^(%d+):(%d+):(%d+)$')
    return tonumber(u), tonumber(l), tonumber(n)
  end

  -- block_length is the length and strikes of the block a denial starts, for a zone of block spec
  -- b, the key holding the last block's end, length and strikes (nil: none): a repeat offence
  -- while that block is remembered, as long after its end as it lasted (the key's TTL says so on
  -- the Redis clock; this, on the scripts' clock too).
  local function block_length(b, bend, last, strikes)
    if b[2] > 0 and bend and last and strikes and now < bend + last then
      return max(b[1], min(2 * last, b[2])), strikes + 1
    end
    return b[1], 1
  end

  -- block_write writes the block w = { key, length, strikes, block_max } starting now.
  local function block_write(w)
    local ttl = w[2]
    if w[4] > 0 then ttl = 2 * w[2] end -- the strikes are remembered as long again
    call('SET', w[1], sformat('%d:%d:%d', now + w[2], w[2], w[3]), 'PX', ms(ttl / 1000))
  end
  PB = { read = block_read, length = block_length, write = block_write }
  return PB
end

-- Shadow zones and overrides ------------------------------------------------------------------
-- A zone's flags argument holds, in this order, any of:
--   s            a shadow zone: its denial does not deny the decision (allowed), and it is
--                charged, as any zone, only when the decision admits and it admits too
--   o<k>:<mc>    a zone with overrides: the decision's key k is the client's override key, a
--                hash of the numbers that take the place of the zone's (capacity, refill_rate, limit,
--                window in µs, max_cost; see internal/limiter/override.go); mc is the zone's
--                max_cost (0: the quota in force). The cost is the request's own, unchecked:
--                one above the max cost in force (the override's, else mc, at most the quota
--                in force) is denied as never admissible. The zone's reply has 3 more integers:
--                the quota in force (0: no override), the policy window in force (µs: a token
--                bucket's capacity / refill_rate, a window's length; 0: the zone's) and the max
--                cost in force.

-- The ranges of a zone's numbers, as internal/limiter/zone.go checks them: a quota of 1 to
-- QUOTA_MAX[algorithm], a window of 1 ms to 366 days (µs), a refill rate > 0, a max_cost of 1
-- or more; each an integer but the rate.
local QUOTA_MAX = { tb = MAX_US, sw = 1000000, fw = MAX_US, sc = MAX_US, cc = 100000 }
local WINDOW_MIN, WINDOW_MAX = 1000, 366 * 24 * 3600 * 1000000

-- in_range returns an override's quota q, rate or window r and max cost m for algorithm algo,
-- each nil when absent or outside the algorithm's range (an override written under another
-- algorithm, before a reload changed the zone's): the zone's own number then applies.
local function in_range(algo, q, r, m)
  if q and not (q >= 1 and q <= QUOTA_MAX[algo] and q % 1 == 0) then q = nil end
  if m and not (m >= 1 and m % 1 == 0) then m = nil end
  if r and algo == 'tb' then
    if not (r > 0 and r < math.huge) then r = nil end
  elseif r and not (r >= WINDOW_MIN and r <= WINDOW_MAX and r % 1 == 0) then
    r = nil
  end
  return q, r, m
end

-- override_fn returns override, built on first use (see penalty_box): only a call with a zone
-- with overrides creates it.
local OV
local function override_fn()
  if OV then return OV end
  -- override reads a zone's override (okey) and returns the zone's arguments with its numbers in
  -- force (quota, rate as the ARGV above, cost: twice the quota when above the max cost in force)
  -- and the reply's three override integers.
  local function override(algo, okey, quota, rate, cost, mc)
    local v
    if algo == 'tb' then
      v = call('HMGET', okey, 'capacity', 'refill_rate', 'max_cost')
    else
      v = call('HMGET', okey, 'limit', 'window', 'max_cost')
    end
    local q, r, m = in_range(algo, tonumber(v[1]), tonumber(v[2]), tonumber(v[3]))
    local found = q ~= nil or r ~= nil or m ~= nil
    quota = q or quota
    local window = 0 -- the policy window in force (µs); 0: the zone's
    if algo == 'tb' then
      local rt, mw = string.match(rate, '^([^,]+)(.*)$') -- "<rate>[,<max_wait>]"
      if r then rate = sformat('%.17g', r) .. mw else r = tonumber(rt) end
      window = ceil(quota / r * 1000000)
    elseif algo == 'fw' then
      if r then -- the windows around now, aligned to the epoch, as the caller's bounds are
        local s = now - now % r
        rate, window = sformat('%d,%d,%d,%d', s - r, s, s + r, s + 2 * r), r
      end
    elseif algo ~= 'cc' then
      if r then rate = sformat('%d', r) end
      window = tonumber(rate)
    end
    if m == nil then
      if mc > 0 then m = mc else m = quota end
    end
    m = min(m, quota)
    if cost > m then cost = 2 * quota end -- never admissible, as the caller sends such a cost
    if not found then return quota, rate, cost, 0, 0, m end
    return quota, rate, cost, quota, window, m
  end
  OV = override
  return OV
end

-- Top -----------------------------------------------------------------------------------------
-- A zone with the flag "t<k>:<entries>,<ttl>" counts, per client (its state key's hash tag), its
-- denials in the sorted set KEYS[k] (1 per denied request; a shadow zone's would-be denials too)
-- and the units it charged in KEYS[k + 1] (the cost, or a lease's grant). Each set keeps at most
-- entries members (Space-Saving: a new member of a full set replaces the lowest and starts from
-- its count) and expires ttl ms after its creation. The count a member started from is its error
-- (its true count is at least its count less its error), a field of the hash KEYS[k + 2] (of the
-- denials) or KEYS[k + 3] (of the units): absent when it started from 0, dropped with its place.
-- Nothing else reads them in this script.

-- top_add adds inc to the count of member m in the top set key of at most cap members, whose
-- members' errors are the hash ekey.
local function top_add(key, ekey, m, inc, cap, ttl)
  if redis.call('ZSCORE', key, m) or redis.call('ZCARD', key) < cap then
    redis.call('ZINCRBY', key, inc, m)
  else
    local low = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    redis.call('ZREM', key, low[1])
    redis.call('ZADD', key, tonumber(low[2]) + inc, m)
    redis.call('HDEL', ekey, low[1])
    redis.call('HSET', ekey, m, low[2])
    redis.call('PEXPIRE', ekey, ttl, 'NX')
  end
  redis.call('PEXPIRE', key, ttl, 'NX')
end

-- top_write counts the tops ({ zone, allowed, units }) of a decision that admitted (admitted).
local function top_write(tops, admitted)
  for _, t in ipairs(tops) do
    local z = t[1]
    local m = string.match(z.key, '{([^}]*)}')
    if not t[2] then
      top_add(z.top[1], z.top[5], m, 1, z.top[3], z.top[4])
    elseif admitted then
      top_add(z.top[2], z.top[6], m, t[3], z.top[3], z.top[4])
    end
  end
end

-- Near limit ------------------------------------------------------------------------------------
-- A zone with a near limit (its flag "n<ppm>": a fraction of the quota in force, in millionths)
-- reports in near_i whether the decision's charge crosses it: the client had used less than
-- ceil(quota × ppm / 10^6) units (at least 1) before the request and that many or more after it.
-- Used is quota - remaining, remaining in whole units as remaining_i gives them (never below 0).
-- No state is kept for it: the script is atomic, so one decision alone sees a crossing, and the
-- client crosses again only once it is back below (a bucket's refill, a window's end, a slot
-- given back). A zone without a near limit computes nothing.

-- near_crossed returns near_i of zone z (read_decision) whose algorithm returned ok, remaining,
-- granted and tokens (a token bucket's tokens before the request), under the quota and cost in
-- force: the units remaining before are the bucket's whole tokens, else remaining and what the
-- request took (its grant, or its cost; nothing for a claim, whose slot was reserved already).
local function near_crossed(z, ok, quota, cost, remaining, granted, tokens)
  if not ok then return 0 end
  local before
  if tokens then
    before = max(0, floor(tokens + EPSILON))
  elseif z.claim then
    before = remaining
  else
    before = remaining + (granted or cost)
  end
  local at = max(1, ceil(quota * z.near / 1000000))
  if quota - before < at and quota - remaining >= at then return 1 end
  return 0
end

-- Decisions -------------------------------------------------------------------------------------

-- read_decision reads the decision whose arguments start at ARGV[a] (its nonce) and whose keys
-- start at KEYS[kbase + 1]. It returns its nonce, hold and a table per zone { tag, quota, rate,
-- cost, ask, shadow, upto, key, rkey, gkey, okey, omc, block, bkey, qkey, top, claim, near }: the
-- algorithm
-- tag, the quota and cost as numbers, the rate as sent, the lease's grant asked (nil: none),
-- whether it is a shadow zone, whether its grant is all it holds up to ask, its state key, its
-- record and generation keys (when its charge is recorded), its override key and max cost
-- (overrides), its block { block µs, block_max µs } and block key, its queue's waiters' key and
-- its top { denied key, used key, entries, ttl ms, their error keys }, the waiter id it claims a
-- reserved slot for and its near limit (ppm); then the number of keys the decision takes. The only code that reads
-- a decision's ARGV and KEYS
-- besides fast.
local function read_decision(a, kbase)
  local nonce, hold, n = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  if not n then error('decide: bad zone count ' .. tostring(ARGV[a + 2])) end
  local zones = {}
  local r = kbase + n + 1 -- the next record key
  local last = n -- the last key the decision takes, relative to kbase
  for i = 1, n do
    local base = a + 3 + 5 * (i - 1)
    local z = { tag = ARGV[base], quota = tonumber(ARGV[base + 1]), rate = ARGV[base + 2],
      cost = tonumber(ARGV[base + 3]), key = KEYS[kbase + i] }
    if z.cost == nil then
      local c, k = string.match(ARGV[base + 3], '^(%d+),(%d+)$')
      z.cost, z.ask = tonumber(c), tonumber(k)
    end
    if KEYS[r] == z.key .. ':' .. nonce then -- Go sends record keys for recorded zones only
      z.rkey, z.gkey, r = KEYS[r], KEYS[r + 1], r + 2
    end
    local flags = ARGV[base + 4]
    local bar = string.find(flags, '|', 1, true)
    if bar then
      z.claim, flags = string.sub(flags, bar + 1), string.sub(flags, 1, bar - 1)
    end
    if flags ~= '' then
      z.shadow = byte(flags) == 115 -- 's'
      z.upto = string.find(flags, 'u', 1, true) ~= nil
      local k, mc = string.match(flags, 'o(%d+):(%d+)')
      if k then
        k = tonumber(k)
        z.okey, z.omc, last = KEYS[kbase + k], tonumber(mc), max(last, k)
      end
      local b, bm, bk = string.match(flags, 'b(%d+),(%d+):(%d+)')
      if b then
        bk = tonumber(bk)
        z.block, z.bkey, last = { tonumber(b), tonumber(bm) }, KEYS[kbase + bk], max(last, bk)
      end
      local qk = tonumber(string.match(flags, 'q(%d+)'))
      if qk then z.qkey, last = KEYS[kbase + qk], max(last, qk) end
      local tk, te, tt = string.match(flags, 't(%d+):(%d+),(%d+)')
      if tk then
        tk = tonumber(tk)
        z.top = { KEYS[kbase + tk], KEYS[kbase + tk + 1], tonumber(te), tt, KEYS[kbase + tk + 2], KEYS[kbase + tk + 3] }
        last = max(last, tk + 3)
      end
      z.near = tonumber(string.match(flags, 'n(%d+)'))
      local ak = tonumber(string.match(flags, 'a(%d+)'))
      if ak then z.akey, last = KEYS[kbase + ak], max(last, ak) end
    end
    zones[i] = z
  end
  return nonce, hold, zones, max(last, r - kbase - 1)
end

-- decide runs one decision of zones (read_decision) and returns its reply (see above). Each zone
-- decides first (a zone with a block reads its block key before its algorithm); when all admit,
-- each makes its write (every write sets a TTL: see each algorithm); when one denies, nothing is
-- written but the blocks it starts, and a denying zone's state that the parameters in force need
-- longer than its TTL is given that TTL (PEXPIRE GT: only ever lengthened), so that state never
-- expires early after a reload that slowed the refill or lengthened the window.
local BY_TAG = {} -- per algorithm tag, its decide function (see algorithm)
local function decide(nonce, hold, zones)
  local n = #zones
  local holdmax = {} -- per zone: µs its charge is held (its record, its slot lives); nil: now
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
  local writes = {} -- { take function, arguments... }, made in order when every zone admits
  local denied = {} -- { key, TTL (ms) its state needs }
  local blocks -- the blocks to start: { key, length, strikes, block_max }
  local tops -- the zones with a top: { zone, allowed, units }

  for i = 1, n do
    local z = zones[i]
    local algo, quota, rate, cost = z.tag, z.quota, z.rate, z.cost
    local oq, ow, om -- with overrides: the reply's override integers
    if z.okey then
      quota, rate, cost, oq, ow, om = override_fn()(algo, z.okey, quota, rate, cost, z.omc)
    end
    local bend, last, strikes -- the zone's block's end, length, strikes
    if z.bkey then bend, last, strikes = penalty_box().read(z.bkey) end
    local ok, remaining, retry, reset, nxt, granted, tokens
    local fig = 0 -- the zone's block integer
    if bend and bend > now then -- blocked: the algorithm does not run
      ok, remaining, retry, reset, nxt, fig = false, 0, bend - now, bend - now, bend - now, 1
    else
      local f = BY_TAG[algo]
      if not f then f = algorithm(algo); BY_TAG[algo] = f end
      ok, remaining, retry, reset, nxt, granted, tokens =
        f(z.key, quota, rate, cost, z.ask, nonce, holdmax[i], z.rkey, z.gkey, writes, denied, z.upto, z)
      if z.bkey and not ok and cost <= quota then
        local len, nth = PB.length(z.block, bend, last, strikes)
        blocks = blocks or {}
        blocks[#blocks + 1] = { z.bkey, len, nth, z.block[2] }
        fig, remaining, retry, reset, nxt = 2, 0, len, max(reset, len), len
      end
    end

    if not ok and not z.shadow then reply[1] = 0 end
    if z.top then
      tops = tops or {}
      tops[#tops + 1] = { z, ok, granted or cost }
    end
    reply[#reply + 1] = ok and 1 or 0
    reply[#reply + 1] = remaining
    reply[#reply + 1] = retry
    reply[#reply + 1] = reset
    reply[#reply + 1] = nxt
    if z.ask then reply[#reply + 1] = ok and granted or 0 end
    if z.bkey then reply[#reply + 1] = fig end
    if z.okey then
      reply[#reply + 1] = oq
      reply[#reply + 1] = ow
      reply[#reply + 1] = om
    end
    if z.near then reply[#reply + 1] = near_crossed(z, ok, quota, cost, remaining, granted, tokens) end
    if z.akey then
      local learnt = z.learnt or { 1, 0, 0 }
      reply[#reply + 1] = learnt[1]
      reply[#reply + 1] = learnt[2]
      reply[#reply + 1] = learnt[3]
    end
  end

  -- The denying zones' TTLs (a shadow zone's, of an admitted decision, too).
  for _, d in ipairs(denied) do
    redis.call('PEXPIRE', d[1], ms(d[2]), 'GT')
  end
  if tops then top_write(tops, reply[1] == 1) end
  if reply[1] == 0 then
    if blocks then
      for _, w in ipairs(blocks) do PB.write(w) end
    end
    return reply
  end
  for _, w in ipairs(writes) do
    w[1](w, nonce)
  end
  return reply
end

-- fast decides the common case with as little work as possible: every zone a token bucket
-- without a max_wait and without flags, charged now (hold "0"), whose state has no holds (no h).
-- It reads the decision's ARGV and KEYS itself, in read_decision's layout, building no table. It decides each
-- zone with tb_drain and tb_admit and writes it with tb_set, as decide does, so it leaves the
-- same state and appends the same reply (at out[o + 1 ..]) as decide would, and returns the new
-- length of out; or false, having written nothing, when the decision is not such a case (decide
-- then runs it). What it spares: decide's tables per decision and per write, its parsing and
-- dispatch, and the algorithms' functions (see algorithm); each argument is converted once per
-- batch.
local NUM = {} -- tonumber of the batch's arguments, each string converted once
local function num(s)
  local v = tonumber(s)
  NUM[s] = v
  return v
end
local FK, FU, FT, FQ, FR, FC = {}, {}, {}, {}, {}, {} -- per zone: key, used, ts, quota, rate, cost
local function fast(out, o, n, kbase, abase)
  for i = 1, n do
    local base = abase + 5 * (i - 1)
    local r = ARGV[base + 2]
    local rate = NUM[r] or num(r)
    if ARGV[base] ~= 'tb' or rate == nil or ARGV[base + 4] ~= '' then return false end
    FR[i] = rate
  end
  local ok = true
  for i = 1, n do
    local key = KEYS[kbase + i]
    local v = call('HMGET', key, 'u', 'ts', 't', 'h')
    if v[4] then return false end -- holds: decide commits those past their time
    local base = abase + 5 * (i - 1)
    local q, c = ARGV[base + 1], ARGV[base + 3]
    local quota, rate, cost = NUM[q] or num(q), FR[i], NUM[c] or num(c)
    local used, ts = tb_drain(v, quota, rate)
    local ok_i, _, remaining, retry, reset, nxt = tb_admit(quota - used, quota, rate, cost, 0)
    if not ok_i then ok = false end
    out[o + 5 * i - 3] = ok_i and 1 or 0
    out[o + 5 * i - 2] = remaining
    out[o + 5 * i - 1] = retry
    out[o + 5 * i] = reset
    out[o + 5 * i + 1] = nxt
    FK[i], FU[i], FT[i], FQ[i], FC[i] = key, used, ts, quota, cost
  end
  out[o + 1] = ok and 1 or 0
  for i = 1, n do
    if ok then
      tb_set(FK[i], FU[i] + FC[i], FT[i], FQ[i], FR[i], 0, 0)
    elseif out[o + 5 * i - 3] == 0 then -- the TTL tb_decide asks of a denial
      call('PEXPIRE', FK[i], ms(max(1, ceil(FU[i] / FR[i] * 1000))), 'GT')
    end
  end
  return o + 1 + 5 * n
end

-- The decisions, in order: each all-or-nothing on its own, each seeing the writes of those
-- before it.
local out, o = {}, 0
local kbase, a = 0, 2
while a <= #ARGV do
  local n = tonumber(ARGV[a + 2])
  local fo = n and ARGV[a + 1] == '0' and fast(out, o, n, kbase, a + 3)
  if fo then
    o, kbase = fo, kbase + n
  else
    local nonce, hold, zones, nkeys = read_decision(a, kbase)
    local r = decide(nonce, hold, zones)
    for j = 1, #r do out[o + j] = r[j] end
    o, kbase, n = o + #r, kbase + nkeys, #zones
  end
  a = a + 3 + 5 * n
end
return out
