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
-- for being older than decide.lua's HOLD_MAX. Running the same settle twice changes nothing more.
-- A sliding window's entries ("<nonce>:1" .. "<nonce>:<cost>") are kept on commit and removed on
-- release; entries already expired, or gone with their key, are gone anyway. A fixed window's
-- or sliding window counter's charge is taken back from its count on release, while the window
-- it went into is still the current one.
--
-- KEYS and ARGV are those of the decide.lua call being settled, except ARGV[1] and ARGV[3]:
-- KEYS[i]  the state key of zone i.
-- ARGV[1]  now, in µs since the Unix epoch, or "" to read the Redis server clock (TIME).
-- ARGV[2]  the nonce of the decide.lua call being settled.
-- ARGV[3]  "commit", "release" or "amount".
-- Then 4 arguments per zone i, starting at ARGV[4 + 4*(i-1)]: algorithm ("tb", "sw", "fw" or
-- "sc"), quota, rate (tb: tokens/s, followed by ",<max_wait>" when shaping; sw, sc: window µs;
-- fw: the window bounds) and cost, as given to that call.
-- With "amount", then one more argument per zone i, at ARGV[4 + 4n + (i-1)] for n zones: what to
-- charge zone i. A token bucket commits that many tokens in place of its hold (0 releases it;
-- more than the bucket has left puts it in debt: u above capacity, which later requests wait
-- out); a sliding window keeps its entries, unless it is 0: then they are removed.
--
-- Reply: an array, per zone in order, 1 when it was settled now (its hold or window entries
-- were found), else 0.

local EPSILON = 1e-9
local MAX_US = 9007199254740992 -- decide.lua's: the longest TTL, in ms

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

for i = 1, #KEYS do
  local key = KEYS[i]
  local base = 4 + 4 * (i - 1)
  local algo = ARGV[base]
  local quota = tonumber(ARGV[base + 1])
  local rate = tonumber(string.match(ARGV[base + 2], '^[^,]*')) -- tb: "<rate>[,<max_wait>]"
  local amount
  if mode == 'amount' then
    amount = tonumber(ARGV[4 + 4 * #KEYS + (i - 1)])
    commit = amount > 0
  end
  settled[i] = 0

  if algo == 'tb' then
    local v = redis.call('HMGET', key, 'u', 'ts', 'h', 'h:' .. nonce)
    local c = v[4] and tonumber(string.match(v[4], '^(%d+)@'))
    local used, ts = tonumber(v[1]) or 0, tonumber(v[2]) or now
    if c then
      local held = math.max(0, (tonumber(v[3]) or 0) - c)
      if now > ts then
        used = math.max(0, used - (now - ts) * rate / 1000000)
        ts = now
      end
      if mode == 'amount' then used = used + amount elseif commit then used = used + c end
      redis.call('HDEL', key, 'h:' .. nonce)
      local fields = { 'u', string.format('%.17g', used), 'ts', string.format('%d', ts),
        't', '+' .. string.format('%.17g', quota - used - held) }
      if held > EPSILON then
        fields[#fields + 1] = 'h'
        fields[#fields + 1] = string.format('%d', held)
      else
        redis.call('HDEL', key, 'h')
      end
      redis.call('HSET', key, unpack(fields))
      local ttl = used / rate * 1000
      if held > EPSILON then
        -- decide.lua's HOLD_MAX, and a second; never shorter than other holds need (GT)
        redis.call('PEXPIRE', key, ms(ttl + 6000), 'GT')
      else
        redis.call('PEXPIRE', key, ms(ttl))
      end
      settled[i] = 1
    end
  elseif algo == 'fw' or algo == 'sc' then
    -- A counter's charge is no hold: a release takes the cost back from the window it went into,
    -- while that is still the window holding now (a window that has ended keeps it: a release
    -- never credits a window the request was not charged in).
    if not commit then
      local cost = tonumber(ARGV[base + 3])
      if algo == 'fw' then
        local b = {}
        for x in string.gmatch(ARGV[base + 2], '%d+') do b[#b + 1] = tonumber(x) end
        local start = b[2]
        if now < b[2] then start = b[1] elseif now >= b[3] then start = b[3] end
        local mark = start % 1000000 == 0 and string.format('%d', start / 1000000) or string.format('%.6f', start / 1000000)
        local m, c = string.match(redis.call('GET', key) or '', '^([%d.]+):(%d+)$')
        if m == mark then
          redis.call('SET', key, m .. ':' .. string.format('%d', math.max(0, tonumber(c) - cost)), 'KEEPTTL')
          settled[i] = 1
        end
      else
        local v = redis.call('HMGET', key, 's', 'c')
        if tonumber(v[1]) == now - now % rate and tonumber(v[2]) then
          redis.call('HSET', key, 'c', string.format('%d', math.max(0, tonumber(v[2]) - cost)))
          settled[i] = 1
        end
      end
    else
      settled[i] = 1
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
