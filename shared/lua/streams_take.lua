-- A slot for one more open stream of a tenant, if it holds fewer than the cap (api/core/stream_slots.py
-- StreamSlots.take): lapsed leases (a dead replica's streams) are dropped first.
-- KEYS[1]: the tenant's open-streams sorted set (member: a slot id; score: the ms its lease ends).
-- ARGV[1]: the new slot's id.
-- ARGV[2]: the cap (most open streams).
-- ARGV[3]: the lease, in ms.
-- Returns 1 when the slot is taken, 0 when the tenant is at its cap.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
-- The set goes when its last lease ends (whatever lease each replica gives).
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], last[2])
return 1
