-- refund.lua: give back what one admitting decide.lua call charged, when the request it was part
-- of was denied elsewhere. Used only on Redis Cluster, where the zones of one request can live in
-- different hash slots and so be decided by one decide.lua call per slot: when one slot's call
-- denies, the calls that admitted are refunded, so that the request is charged nowhere.
--
-- KEYS and ARGV are those of the decide.lua call being refunded, except ARGV[1]:
-- KEYS[i]  the state key of zone i.
-- ARGV[1]  now, in µs since the Unix epoch, or "" to read the Redis server clock (TIME).
-- ARGV[2]  the nonce of the decide.lua call being refunded.
-- Then 4 arguments per zone i, starting at ARGV[3 + 4*(i-1)]: algorithm ("tb" or "sw"), quota,
-- rate (tb: tokens/s; sw: window µs) and cost, as given to that call.
--
-- A token bucket gets its cost back, refilled to now and capped at its capacity: the result is
-- exactly the bucket as it would be had the charge never happened. A sliding window loses the
-- entries the call added ("<nonce>:1" .. "<nonce>:<cost>"); entries already expired are gone
-- anyway. A key that no longer exists is left alone (an expired bucket is full). Other requests
-- decided between the charge and the refund saw the charge: a refund never admits too much, but
-- may briefly deny too much.
--
-- Reply: the number of zones refunded (keys that still existed).

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
end
local nonce = ARGV[2]
local refunded = 0

for i = 1, #KEYS do
  local key = KEYS[i]
  local base = 3 + 4 * (i - 1)
  local algo = ARGV[base]
  local quota = tonumber(ARGV[base + 1])
  local rate = tonumber(ARGV[base + 2])
  local cost = tonumber(ARGV[base + 3])

  if algo == 'tb' then
    local v = redis.call('HMGET', key, 't', 'ts')
    local tokens, ts = tonumber(v[1]), tonumber(v[2])
    if tokens ~= nil and ts ~= nil then
      if now > ts then
        tokens = tokens + (now - ts) * rate / 1000000
        ts = now
      end
      tokens = math.min(quota, tokens + cost)
      redis.call('HSET', key, 't', string.format('%.17g', tokens), 'ts', string.format('%d', ts))
      redis.call('PEXPIRE', key, math.max(1, math.ceil((quota - tokens) / rate * 1000)))
      refunded = refunded + 1
    end
  else
    local members, removed = {}, 0
    for j = 1, cost do
      members[#members + 1] = nonce .. ':' .. j
      if #members >= 1000 or j == cost then
        removed = removed + redis.call('ZREM', key, unpack(members))
        members = {}
      end
    end
    if removed > 0 then refunded = refunded + 1 end
  end
end

return refunded
