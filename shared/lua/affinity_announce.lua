-- A worker announces the prompt prefixes it took (shared/prefix_affinity.py PrefixAffinity.announce).
-- Each hash's value lists its holders, the latest first: "<expiry ms>:<worker>/..." ('/' is in no
-- worker name); the set scores each hash with its latest expiry. Also drops up to 100 prefixes
-- whose every announcement has expired, whoever made them.
-- KEYS[1]: the model's prefix holders hash.
-- KEYS[2]: the model's prefix expiry set.
-- ARGV[1]: the worker.
-- ARGV[2]: how long it holds them, in ms.
-- ARGV[3]: the most holders kept per prefix.
-- ARGV[4..]: the prefix hashes it took.
-- Returns the number of expired prefixes dropped.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, expires, most = ARGV[1], now + tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 4, #ARGV do
  local holders = {expires .. ':' .. me}
  for held in string.gmatch(redis.call('HGET', KEYS[1], ARGV[i]) or '', '[^/]+') do
    local until_ms, worker = string.match(held, '^(%d+):(.*)$')
    if worker ~= me and tonumber(until_ms) > now and #holders < most then holders[#holders + 1] = held end
  end
  redis.call('HSET', KEYS[1], ARGV[i], table.concat(holders, '/'))
  redis.call('ZADD', KEYS[2], expires, ARGV[i])
end
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 100)
if #old > 0 then
  redis.call('HDEL', KEYS[1], unpack(old))
  redis.call('ZREM', KEYS[2], unpack(old))
end
return #old
