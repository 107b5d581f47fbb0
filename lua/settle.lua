#!lua
-- settle.lua: settle what one decide.lua call with holds took: on Redis Cluster, where the zones
-- of one request can live in different hash slots and so be decided by one decide.lua call per
-- slot, when every slot admitted each is committed, and when one denied (or failed) those that
-- admitted are released, so that the request is charged nowhere; and after the response, for
-- zones that charge what the response reports (mode "amount").
--
-- A token bucket's charge was taken as a hold, "h:<nonce>" (see decide.lua), which no refill
-- drains. Commit moves it into u (used) at now; release deletes it. Either is exact: the bucket
-- becomes what it would be had the request been charged at commit, or never. Only the bucket
-- the call charged is touched: a bucket that expired or was reset (deleted) and recreated since
-- holds no such field, and is left alone; so is one whose hold a later call already committed
-- for being older than decide.lua's HOLD_MAX (but see "L" below). Running the same settle twice
-- changes nothing more, but for "L".
-- A sliding window's entries ("<nonce>:1" .. "<nonce>:<cost>") are kept on commit and removed on
-- release; entries already expired, or gone with their key, are gone anyway.
--
-- A fixed window's or sliding window counter's charge is in its count already, and decide.lua
-- recorded it (its record and generation keys are given, see decide.lua): the record is deleted
-- and the count of the window the charge went into is given the difference: 0 on commit, -cost
-- on release, amount - cost with "amount" (a count may so go above the limit: debt, or down to
-- 0, never below), while that window is still the current one (once it has ended, nothing:
-- reply 2) and the count is of the record's generation (after an admin reset, which deleted the
-- generation with the state, nothing: reply 0). No record, no change: settled already (so a
-- settle sent twice applies once), or older than its hold time. So a release or settlement
-- changes a count only while its charge is in it.
--
-- A concurrency zone's slot ("<nonce>" in its sorted set, see decide.lua) is given back on
-- release and with "amount", whatever the amount (a slot is held while its request runs, then
-- freed); a commit keeps it. See cc_settle below.
--
-- KEYS and ARGV are those of one decision of the decide.lua call being settled, except that the
-- mode stands in place of the hold, n is left out (n is told by the number of arguments) and
-- each zone's flags are left out (internal/limiter/call.go settleArgs):
-- KEYS     the state key of each zone i, then the record and generation keys, as decide.lua
--          took them, and the controller's hash of each adaptive concurrency zone, in zone order.
-- ARGV[1]  now, in µs since the Unix epoch, or "" to read the Redis server clock (TIME).
-- ARGV[2]  the nonce of the decide.lua call being settled.
-- ARGV[3]  "commit", "release" or "amount".
-- Then 4 arguments per zone i, starting at ARGV[4 + 4*(i-1)]: algorithm ("tb", "sw", "fw", "sc",
-- "cc" or "ac"), quota, rate (tb: tokens/s, followed by ",<max_wait>" when shaping; sw, sc: window µs;
-- fw: the window bounds, or one number: a window of that many µs, the windows aligned to the
-- epoch) and cost, as given to that call; for a zone with overrides, the quota and rate in force
-- when it was decided (decide.lua's reply: the client's override's, fw's window given as one
-- number; internal/limiter/override.go settleZone), so that it settles as it was reserved.
-- With "amount", then one more argument per zone i, at ARGV[4 + 4n + (i-1)] for n zones: what to
-- charge zone i, an integer, followed by "L" when the response outlived the zone's hold time (so
-- its hold may have been committed already), and for an adaptive concurrency zone by
-- ";<latency µs>,<failed 0|1>,<age µs>" when the response gave a latency sample (see Adaptive
-- concurrency). A token bucket commits that many tokens in place of
-- its hold (0 releases it; more than the bucket has left puts it in debt: u above capacity, which
-- later requests wait out, up to one capacity: u + h is never taken above 2 × capacity, so the
-- key's TTL is at most two windows); with "L" and no hold found, the hold was committed as its
-- cost (or the bucket was reset or has expired), and the difference, amount - cost, is added to
-- u all the same (given back when negative): what a response is charged never depends on how
-- long it took. Run twice, that difference would be applied twice: the caller settles once. A
-- sliding window keeps its entries, unless it is 0: then they are removed; a window counter is
-- charged it in place of its cost.
--
-- Reply: an array, per zone in order, 1 when it was settled now (its hold, window entries or
-- record were found; a token bucket's "L" amount, always), 2 when its record was found but the
-- window it was charged in has ended (nothing to settle), else 0 (also when its record was found
-- but the state was reset since).

local EPSILON, HOLD_MAX = 1e-9, 5000000 -- HOLD_MAX: decide.lua's
local MAX_US = 9007199254740992 -- decide.lua's: the longest TTL, in ms; also the largest count

-- A TTL in ms, as the integer string PEXPIRE takes (at least 1, at most MAX_US).
local function ms(x)
  return string.format('%d', math.min(math.max(1, math.ceil(x)), MAX_US))
end

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local nonce = ARGV[2]
local mode = ARGV[3]
local commit = mode == 'commit'
local settled = {}
local n = (#ARGV - 3) / 4 -- zones
if mode == 'amount' then n = (#ARGV - 3) / 5 end
local r = n + 1 -- the next record key

-- The start (µs) of a window counter's window holding now: fw: of the three windows of the
-- bounds "b0,b1,b2,b3"; sc, and fw given one number (an override's window): of the windows of
-- `window` µs aligned to the epoch. nil when now is outside the fixed window's bounds.
local function window_at(algo, arg)
  if algo == 'sc' or not string.find(arg, ',', 1, true) then
    local window = tonumber(arg)
    return now - now % window
  end
  local b = {}
  for x in string.gmatch(arg, '%d+') do b[#b + 1] = tonumber(x) end
  for j = 1, 3 do
    if now >= b[j] and now < b[j + 1] then return b[j] end
  end
  return nil
end

-- Adds delta to the count of a window counter (state key key) if it holds the window that
-- starts at start, never taking it below 0; true when it does.
local function add(key, algo, start, delta)
  if algo == 'fw' then
    local mark = start % 1000000 == 0 and string.format('%d', start / 1000000) or string.format('%.6f', start / 1000000)
    local m, c = string.match(redis.call('GET', key) or '', '^([%d.]+):(%d+)$')
    if m ~= mark then return false end
    if delta ~= 0 then
      c = math.min(math.max(0, tonumber(c) + delta), MAX_US)
      redis.call('SET', key, m .. ':' .. string.format('%d', c), 'KEEPTTL')
    end
    return true
  end
  local v = redis.call('HMGET', key, 's', 'c')
  if tonumber(v[1]) ~= start or not tonumber(v[2]) then return false end
  if delta ~= 0 then
    redis.call('HSET', key, 'c', string.format('%d', math.min(math.max(0, tonumber(v[2]) + delta), MAX_US)))
  end
  return true
end

-- Concurrency: cc_settle gives back (ZREM) the slot of the decision, unless commit; 1 when it
-- was found (or kept), else 0 (freed already, past its deadline and removed, or reset).
local function cc_settle(key)
  if mode == 'commit' then return 1 end
  return redis.call('ZREM', key, nonce)
end
-- End of concurrency

-- Adaptive concurrency ---------------------------------------------------------------------------
-- An adaptive concurrency zone's slot is a concurrency slot (cc_settle); its controller is the
-- hash ctl, `<state key>:ctl` (given after the zone's state key's records, in zone order), which
-- learns the zone's limit from the latency samples its settlements carry (internal/limiter/
-- adaptive.go states the controller, Envoy's gradient controller, and its sources):
--   e   the limit in force, slots (what decide.lua and queue.lua admit against)
--   l   the learnt limit (a float, min limit to the ceiling); m the minimum latency (µs), the mean
--       of the last probe's samples; r the last window's mean latency (µs)
--   ws  the window's start (µs); n, s its successful samples and their sum (µs); f its failed
--       samples; p the peak of slots taken at its settlements
--   pu  while a probe runs, its start (µs): e is then the min limit, and the samples of requests
--       admitted after pu (their age says when) count to pn and ps; nx when the next probe is due
-- A sample is "<latency µs>,<failed 0|1>,<age µs>". The first starts a probe (the minimum
-- latency is not known yet). A probe ends once pn reaches the probe's samples: m = ps / pn, e
-- back to the learnt limit, and a window starts. Else the first sample at least update µs after
-- the window's start ends the window, before it joins the next: gradient = clamp(m × (1 +
-- buffer) / (s / n), 0.5, 2) (1 without a successful sample), l = clamp(l × gradient, at most
-- l × 0.9 with a failure, at most l when the peak was under l / 2, min limit, ceiling), e =
-- floor(l); a probe starts when due. The hash lives a day after its last sample.
local CTL_TTL = '86400000'
-- d is x rounded down, as the integer string Redis stores (a Lua number would be sent as %.14g).
local function d(x) return string.format('%d', math.floor(x)) end
local function adapt(ctl, key, ceiling, controller, sample)
  local rtt, failed, age = string.match(sample, '^(%d+),([01]),(%d+)$')
  if not rtt then return end
  rtt, failed, age = tonumber(rtt), failed == '1', tonumber(age)
  local c = {}
  for x in string.gmatch(controller, '%d+') do c[#c + 1] = tonumber(x) end
  local minl, buffer, update, every, want = c[1], c[2] / 1000000, c[3], c[4], c[5]
  local v = redis.call('HMGET', ctl, 'l', 'm', 'ws', 'n', 's', 'f', 'p', 'pu', 'pn', 'ps', 'nx')
  local l = tonumber(v[1])
  local f
  if not l then
    redis.call('HSET', ctl, 'l', d(minl), 'e', d(minl), 'ws', d(now), 'n', 0, 's', 0, 'f', 0, 'p', 0, 'pu', d(now), 'pn', 0, 'ps', 0)
    redis.call('PEXPIRE', ctl, CTL_TTL)
    return
  end
  l = math.min(l, ceiling)
  local m, pu = tonumber(v[2]), tonumber(v[8])
  if pu then
    local pn, ps = tonumber(v[9]) or 0, tonumber(v[10]) or 0
    if now - age >= pu and not failed then pn, ps = pn + 1, ps + rtt end
    if pn >= want then
      m = ps / pn + 0.5
      redis.call('HDEL', ctl, 'pu', 'pn', 'ps')
      f = { 'm', d(m), 'e', d(math.max(minl, math.floor(l))), 'nx', d(now + every), 'ws', d(now), 'n', 0, 's', 0, 'f', 0, 'p', 0 }
    else
      f = { 'pn', d(pn), 'ps', d(ps), 'e', d(minl) }
    end
  else
    local n, s, fails, peak = tonumber(v[4]) or 0, tonumber(v[5]) or 0, tonumber(v[6]) or 0, tonumber(v[7]) or 0
    local ws = tonumber(v[3]) or now
    f = {}
    if now - age >= ws then -- admitted within the window: a sample of the limit in force
      if failed then fails = fails + 1 else n, s = n + 1, s + rtt end
      peak = math.max(peak, redis.call('ZCOUNT', key, '(' .. string.format('%d', now), '+inf')) -- this slot's too
    end
    if now - ws >= update and n + fails >= math.max(1, math.floor(l / 2)) then -- the window ends
      local new = l
      if n > 0 and m then
        local r = s / n
        new = l * math.min(2, math.max(0.5, m * (1 + buffer) / r))
        f = { 'r', d(r + 0.5) }
      end
      if fails > 0 then new = math.min(new, l * 0.9) end
      if new > l and peak * 2 < l then new = l end
      l = math.min(math.max(new, minl), ceiling)
      f[#f + 1], f[#f + 2], f[#f + 3], f[#f + 4] = 'l', string.format('%.17g', l), 'e', d(l)
      n, s, fails, peak, ws = 0, 0, 0, 0, now
      if now >= (tonumber(v[11]) or 0) then
        f[#f + 1], f[#f + 2], f[#f + 3], f[#f + 4], f[#f + 5], f[#f + 6], f[#f + 7], f[#f + 8] =
          'pu', d(now), 'pn', 0, 'ps', 0, 'e', d(minl)
      end
    end
    local w = { 'ws', d(ws), 'n', d(n), 's', d(s), 'f', d(fails), 'p', d(peak) }
    for j = 1, #w do f[#f + 1] = w[j] end
  end
  redis.call('HSET', ctl, unpack(f))
  redis.call('PEXPIRE', ctl, CTL_TTL)
end
-- End of adaptive concurrency

for i = 1, n do
  local key = KEYS[i]
  local base = 4 + 4 * (i - 1)
  local algo = ARGV[base]
  local quota = tonumber(ARGV[base + 1])
  local rate = tonumber(string.match(ARGV[base + 2], '^[^,]*')) -- tb: "<rate>[,<max_wait>]"
  local amount, late, sample
  if mode == 'amount' then
    local arg = ARGV[4 + 4 * n + (i - 1)]
    local a, l = string.match(arg, '^(%d+)(L?)')
    amount, late = tonumber(a), l == 'L'
    sample = string.match(arg, ';(.*)$')
    commit = amount > 0
  end
  settled[i] = 0

  if algo == 'cc' then
    settled[i] = cc_settle(key)
  elseif algo == 'ac' then
    local ctl
    if KEYS[r] == key .. ':ctl' then ctl, r = KEYS[r], r + 1 end
    if ctl and sample then adapt(ctl, key, quota, ARGV[base + 2], sample) end
    settled[i] = cc_settle(key)
  elseif algo == 'tb' then
    local v = redis.call('HMGET', key, 'u', 'ts', 'h', 'h:' .. nonce)
    local c = v[4] and tonumber(string.match(v[4], '^(%d+)@'))
    local diff -- what to add to u
    if c then
      if mode == 'amount' then diff = amount elseif commit then diff = c else diff = 0 end
    elseif late then
      -- The hold is gone: committed as its cost by a decide.lua call that found it past its
      -- time (or the bucket was reset, or has expired since): the amount owed is the same.
      diff = amount - tonumber(ARGV[base + 3])
      if not v[1] and diff <= 0 then diff = nil end -- no bucket, nothing owed
      settled[i] = 1
    end
    if diff then
      local held = math.max(0, (tonumber(v[3]) or 0) - (c or 0))
      local used, ts = tonumber(v[1]) or 0, tonumber(v[2]) or now
      if now > ts then
        used = math.max(0, used - (now - ts) * rate / 1000000)
        ts = now
      end
      local before = used
      used = math.max(0, used + diff)
      if mode == 'amount' and diff > 0 and used + held > 2 * quota then
        -- A charge's debt is at most one capacity (u + h <= 2 × quota): the key's TTL at most
        -- two windows. (A commit's is a shaping hold's, bounded by its max_wait.)
        used = math.max(before, 2 * quota - held)
      end
      if c then redis.call('HDEL', key, 'h:' .. nonce) end
      local fields = { 'u', string.format('%.17g', used), 'ts', string.format('%d', ts),
        't', '+' .. string.format('%.17g', quota - used - held) }
      if held > EPSILON then
        fields[#fields + 1] = 'h'
        fields[#fields + 1] = string.format('%d', held)
      else
        redis.call('HDEL', key, 'h')
      end
      redis.call('HSET', key, unpack(fields))
      if held > EPSILON then
        -- decide.lua's tb_ttl: u and the other holds drained after the last of them counts as
        -- charged (at least decide.lua's HOLD_MAX), and a second.
        local hwait = HOLD_MAX
        local all = redis.call('HGETALL', key)
        for j = 1, #all, 2 do
          local at = string.sub(all[j], 1, 2) == 'h:' and tonumber(string.match(all[j + 1], '^%d+@(%d+)$'))
          if at then hwait = math.max(hwait, at + HOLD_MAX - now) end
        end
        redis.call('PEXPIRE', key, ms(math.ceil((used + held) / rate * 1000) + math.ceil(hwait / 1000) + 1000))
      else
        redis.call('PEXPIRE', key, ms(used / rate * 1000))
      end
      settled[i] = 1
    end
  elseif algo == 'fw' or algo == 'sc' then
    if KEYS[r] == key .. ':' .. nonce then
      local rec = redis.call('GET', KEYS[r])
      if rec then
        redis.call('DEL', KEYS[r])
        local start = window_at(algo, ARGV[base + 2])
        local at, c, gen = string.match(rec, '^(%d+):(%d+):(.+)$')
        if not at or gen ~= redis.call('GET', KEYS[r + 1]) then
          settled[i] = 0 -- the state was reset since: the charge is no longer in the count
        elseif tonumber(at) ~= start then
          settled[i] = 2 -- its window has ended
        else
          local delta = 0
          if mode == 'amount' then delta = amount - tonumber(c) elseif not commit then delta = -tonumber(c) end
          if add(key, algo, start, delta) then settled[i] = 1 end
        end
      end
      r = r + 2
    elseif commit then
      settled[i] = 1 -- nothing recorded: nothing to commit
    end
  elseif not commit then
    local cost = tonumber(ARGV[base + 3])
    local members, removed = {}, 0
    for j = 1, cost do
      members[#members + 1] = nonce .. ':' .. j
      if #members >= 1000 or j == cost then
        removed = removed + redis.call('ZREM', key, unpack(members))
        members = {}
      end
    end
    if removed > 0 then settled[i] = 1 end
  else
    settled[i] = 1
  end
end

return settled
