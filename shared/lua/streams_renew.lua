-- A tenant's open streams on one replica, their leases pushed on (api/core/stream_slots.py
-- StreamSlots.renew); a slot already gone (freed, or lapsed) is not brought back.
-- KEYS[1]: the tenant's open-streams sorted set (member: a slot id; score: the ms its lease ends).
-- ARGV[1]: the lease, in ms.
-- ARGV[2..]: the slot ids.
-- Returns how many of the slots were still held (and are renewed).

local t = redis.call('TIME')
local lease_end = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local held = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], lease_end, ARGV[i])
    held = held + 1
  end
end
-- The set goes when its last lease ends (whatever lease each replica gives).
if held > 0 then
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', KEYS[1], last[2])
end
return held
