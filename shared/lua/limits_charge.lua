-- A tenant's requests charged against its limits, checked and recorded at once (api/core/limits.py Limits.charge).
-- All keys are the tenant's (one hash tag, one slot).
-- KEYS[1]: the tenant's limits hash (rpm, tpm, concurrent, weight).
-- KEYS[2]: its requests-per-minute zset.
-- KEYS[3]: its tokens-per-minute zset.
-- KEYS[4]: its active-requests zset.
-- ARGV[1]: now (seconds since the epoch).
-- ARGV[2]: the request ids, space-separated.
-- ARGV[3]: the tokens they reserve: one count a request, space-separated (or one count, the first's).
-- ARGV[4]: the ended request ids, space-separated (active ones whose records say they ended).
-- ARGV[5]: the active ttl, in seconds (an active entry outliving its request this long is dropped).
-- ARGV[6]: "peek" to check only (Limits.admit: would these requests pass now?), recording nothing.
-- ARGV[7]: reservations to settle, space-separated triples "id reserved used": requests that ended,
--   whose reservation (member id:reserved) becomes what they used (member id=used), the same score.
-- Returns {0, weight} when admitted, else {the limit reached, seconds to wait}.

local limits = redis.call('HGETALL', KEYS[1])
local lim = {}
for i = 1, #limits, 2 do lim[limits[i]] = tonumber(limits[i + 1]) end
local now = tonumber(ARGV[1])
local ids = {}
for id in string.gmatch(ARGV[2], '%S+') do table.insert(ids, id) end
local costs = {}
for cost in string.gmatch(ARGV[3], '%S+') do table.insert(costs, tonumber(cost)) end
local tokens = 0
for _, cost in ipairs(costs) do tokens = tokens + cost end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - 60)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - 60)
local settle = {}
for word in string.gmatch(ARGV[7] or '', '%S+') do table.insert(settle, word) end
for i = 1, #settle - 2, 3 do
  local at = redis.call('ZSCORE', KEYS[3], settle[i] .. ':' .. settle[i + 1])
  if at then
    redis.call('ZREM', KEYS[3], settle[i] .. ':' .. settle[i + 1])
    redis.call('ZADD', KEYS[3], at, settle[i] .. '=' .. settle[i + 2])
  end
end
local function wait_oldest(key)
  local oldest = redis.call('ZRANGE', KEYS[key], 0, 0, 'WITHSCORES')
  return tostring(math.max(1, math.ceil(tonumber(oldest[2]) + 60 - now)))
end
if (lim['rpm'] or 0) > 0 and redis.call('ZCARD', KEYS[2]) + #ids > lim['rpm'] then
  return {'requests per minute', wait_oldest(2)}
end
if (lim['tpm'] or 0) > 0 then
  local used = 0
  for _, member in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
    used = used + tonumber(string.match(member, '[:=](%d+)$'))
  end
  if tokens > lim['tpm'] then return {'tokens per minute', '60'} end
  if used + tokens > lim['tpm'] then return {'tokens per minute', wait_oldest(3)} end
end
if (lim['concurrent'] or 0) > 0 then
  for id in string.gmatch(ARGV[4], '%S+') do redis.call('ZREM', KEYS[4], id) end
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  if redis.call('ZCARD', KEYS[4]) + #ids > lim['concurrent'] then return {'concurrent requests', '1'} end
end
if ARGV[6] == 'peek' then return {0, tostring(lim['weight'] or 1)} end
for i, id in ipairs(ids) do
  redis.call('ZADD', KEYS[2], now, id)
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), id)
end
for i, id in ipairs(ids) do
  if (costs[i] or 0) > 0 then redis.call('ZADD', KEYS[3], now, id .. ':' .. costs[i]) end
end
for k = 2, 4 do redis.call('EXPIRE', KEYS[k], math.max(120, tonumber(ARGV[5]))) end
return {0, tostring(lim['weight'] or 1)}
