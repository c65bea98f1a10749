-- queued → running for this worker (shared/store.py RequestStore.claim).
-- uses: names
-- KEYS[1]: the request's record.
-- ARGV[1]: the claiming worker's name.
-- ARGV[2]: the time of the claim (seconds since the epoch).
-- Returns 1 when the request now runs on this worker, also when it already did (a retried claim
-- whose first answer was lost); 0 when it is no longer queued.

local status = redis.call('HGET', KEYS[1], F.status)
if status == S.running and redis.call('HGET', KEYS[1], F.worker) == ARGV[1] then return 1 end
if status ~= S.queued then return 0 end
redis.call('HSET', KEYS[1], F.status, S.running, F.worker, ARGV[1], F.started_at, ARGV[2])
return 1
