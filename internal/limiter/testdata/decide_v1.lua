-- decide.lua: admit or deny one request against every zone that applies to it, all-or-nothing.
--
-- A token bucket zone keeps a hash { t = tokens (float), ts = time of t (µs) }. It starts full,
-- refills continuously at the refill rate up to its capacity, and admits a request iff
-- tokens >= cost. A sliding window log zone keeps a sorted set of admitted requests scored by
-- time (µs); it admits a request iff (entries younger than the window) + cost <= limit.
-- If any zone denies, nothing is written: no zone is charged.
--
-- KEYS[i]  the state key of zone i: `<prefix>{<client key>}:<zone>:tb` (hash) or `…:sw` (sorted set).
-- ARGV[1]  now, in µs since the Unix epoch, or "" to read the Redis server clock (TIME).
-- ARGV[2]  a nonce unique to this call (across instances and calls); sliding window members
--          are "<nonce>:<n>" for n = 1..cost, so two requests in the same microsecond count
--          twice, and refund.lua can remove exactly what this call added.
-- Then 4 arguments per zone i, starting at ARGV[3 + 4*(i-1)]:
--   algorithm  "tb" (token bucket) or "sw" (sliding window log)
--   quota      tb: capacity (tokens); sw: limit (requests per window)
--   rate       tb: refill rate (tokens/s, float > 0); sw: window (µs, integer > 0)
--   cost       tokens or window slots this request takes (integer >= 1)
--
-- Reply: an array of integers: { allowed, then per zone i: allowed_i, remaining_i,
-- retry_after_i, reset_i }, where
--   allowed      1 if every zone admits the request (and all were charged), else 0
--   allowed_i    1 if zone i alone would admit the request, else 0
--   remaining_i  whole tokens (tb) or slots (sw) left: after this request if zone i alone
--                admits it, else as they are now
--   retry_after_i  µs until zone i alone would admit the request; 0 when it admits it now, and
--                meaningless when cost > quota (it never will)
--   reset_i      µs until zone i is back to its full quota
-- Every write sets a TTL: a bucket expires when it would be full again, a window when its
-- newest entry leaves it.

local EPSILON = 1e-9 -- float slack, so that refill arithmetic never loses a whole token

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local nonce = ARGV[2]

local n = #KEYS
local reply = { 1 }
local writes = {}

for i = 1, n do
  local key = KEYS[i]
  local base = 3 + 4 * (i - 1)
  local algo = ARGV[base]
  local quota = tonumber(ARGV[base + 1])
  local rate = tonumber(ARGV[base + 2])
  local cost = tonumber(ARGV[base + 3])
  local ok, remaining, retry, reset

  if algo == 'tb' then
    local v = redis.call('HMGET', key, 't', 'ts')
    local tokens, ts = tonumber(v[1]), tonumber(v[2])
    if tokens == nil or ts == nil then
      tokens, ts = quota, now
    elseif now > ts then
      tokens = math.min(quota, tokens + (now - ts) * rate / 1000000)
      ts = now
    end
    -- now < ts only with `clock local` and skewed instances: keep ts, credit no refill.
    if tokens + EPSILON >= cost then
      ok = true
      tokens = math.max(0, tokens - cost)
      retry = 0
      writes[#writes + 1] = { 'tb', key, tokens, ts, quota, rate }
    else
      ok = false
      retry = math.ceil((cost - tokens) / rate * 1000000)
    end
    remaining = math.floor(tokens + EPSILON)
    reset = math.max(0, math.ceil((quota - tokens) / rate * 1000000))
  else
    -- Entries scored at or before now - window have left the window.
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - rate)
    local count = redis.call('ZCARD', key)
    if count + cost <= quota then
      ok = true
      remaining = quota - count - cost
      retry = 0
      reset = rate
      writes[#writes + 1] = { 'sw', key, cost, rate }
    else
      ok = false
      remaining = math.max(0, quota - count)
      -- The request fits once (count + cost - quota) of the oldest entries have left.
      local need = count + cost - quota
      if need <= count then
        local e = redis.call('ZRANGE', key, need - 1, need - 1, 'WITHSCORES')
        retry = math.max(1, tonumber(e[2]) + rate - now)
      else
        retry = rate -- cost > quota: never; reported as one window
      end
      local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      if last[2] then
        reset = math.max(0, tonumber(last[2]) + rate - now)
      else
        reset = 0
      end
    end
  end

  if not ok then reply[1] = 0 end
  reply[#reply + 1] = ok and 1 or 0
  reply[#reply + 1] = remaining
  reply[#reply + 1] = retry
  reply[#reply + 1] = reset
end

if reply[1] == 1 then
  for _, w in ipairs(writes) do
    if w[1] == 'tb' then
      local tokens, ts, quota, rate = w[3], w[4], w[5], w[6]
      redis.call('HSET', w[2], 't', string.format('%.17g', tokens), 'ts', string.format('%d', ts))
      local ttl = math.max(1, math.ceil((quota - tokens) / rate * 1000))
      redis.call('PEXPIRE', w[2], ttl)
    else
      local cost, window = w[3], w[4]
      local args = {}
      for j = 1, cost do
        args[#args + 1] = now
        args[#args + 1] = nonce .. ':' .. j
        if #args >= 1000 or j == cost then
          redis.call('ZADD', w[2], unpack(args))
          args = {}
        end
      end
      redis.call('PEXPIRE', w[2], math.max(1, math.ceil(window / 1000)))
    end
  end
end

return reply
