-- Admission and queueing in one step, all requests or none (shared/store.py RequestStore.enqueue).
-- The records are written before, by enqueue(). A lane seen for the first time gets the workers'
-- group (before its first entry) and rings the doorbell.
-- uses: backlog
-- KEYS[1]: the model's lanes set.
-- KEYS[2]: the model's new-lane doorbell stream.
-- KEYS[3..]: each request's lane stream (all in the model's queue slot).
-- ARGV[1]: the workers' consumer group.
-- ARGV[2]: the most requests that may wait (-1: no limit).
-- ARGV[3]: the lane streams' key prefix.
-- ARGV[4..]: for each request, its lane, then its payload (JSON).
-- Returns {0, waiting, taken} past the limit (nothing queued), else {1, waiting before them, taken}:
-- the model's backlog before this submit (queue_backlog).

local waiting, taken = backlog(KEYS[1], ARGV[3], ARGV[1])
local n = #KEYS - 2
if tonumber(ARGV[2]) >= 0 and waiting + n > tonumber(ARGV[2]) then return {0, waiting, taken} end
for i = 1, n do
  local stream, lane, payload = KEYS[2 + i], ARGV[2 + 2 * i], ARGV[3 + 2 * i]
  if redis.call('SADD', KEYS[1], lane) == 1 then
    pcall(redis.call, 'XGROUP', 'CREATE', stream, ARGV[1], '0', 'MKSTREAM')
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', '1000', '*', 'lane', lane)
  end
  redis.call('XADD', stream, '*', 'payload', payload)
end
return {1, waiting, taken}
