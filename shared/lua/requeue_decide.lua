-- The record step of a requeue (shared/requeue.py Requeue.decide): decides what becomes of a dead
-- worker's request and writes it to the record with the entry it came from. Run again for that
-- entry it changes nothing and answers the outcome written the first time; for an entry older than
-- the one recorded (ids grow within a lane) it answers 'stale'.
-- uses: finish
-- KEYS[1]: the request's record.
-- KEYS[2]: its token log.
-- KEYS[3]: its channel (all three in one slot: the request's id).
-- ARGV[1]: the queue entry id it was reclaimed from.
-- ARGV[2]: the most attempts (workers that died running it) before it is dead.
-- ARGV[3]: the encoded final event if it fails.
-- ARGV[4]: the encoded final event if it is cancelled.
-- ARGV[5]: now (seconds since the epoch).
-- ARGV[6]: the ttl, in seconds, of the record and the token log once ended.
-- Returns {outcome, 1 if decided now / 0 if decided before for this entry}; the outcome is one of
-- requeued, dead, cancelled, ended (or no record: expired), stale.

if redis.call('EXISTS', KEYS[1]) == 0 then return {'ended', 1} end  -- expired: nothing to write
local function order(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local done = redis.call('HGET', KEYS[1], F.requeued_from)
if done then
  local ms, seq = order(ARGV[1])
  local done_ms, done_seq = order(done)
  if ms < done_ms or (ms == done_ms and seq < done_seq) then return {'stale', 0} end
  if done == ARGV[1] then return {redis.call('HGET', KEYS[1], F.requeue_outcome), 0} end
end
local status = redis.call('HGET', KEYS[1], F.status)
local outcome
if status ~= S.running and status ~= S.queued then
  outcome = 'ended'
elseif redis.call('HGET', KEYS[1], F.cancel_requested) == '1' then
  finish(KEYS[1], KEYS[2], KEYS[3], S.cancelled, R.cancelled, ARGV[5], ARGV[4], ARGV[6], false)
  outcome = 'cancelled'
else
  local attempts = redis.call('HINCRBY', KEYS[1], F.attempts, 1)
  if attempts >= tonumber(ARGV[2]) then
    finish(KEYS[1], KEYS[2], KEYS[3], S.failed, R.error, ARGV[5], ARGV[3], ARGV[6],
           'the request took down its worker ' .. attempts .. ' times; it is in the dead-letter stream')
    outcome = 'dead'
  else
    redis.call('HSET', KEYS[1], F.status, S.queued, F.worker, '')
    outcome = 'requeued'
  end
end
redis.call('HSET', KEYS[1], F.requeued_from, ARGV[1], F.requeue_outcome, outcome)
return {outcome, 1}
