-- A cancel (shared/store.py RequestStore.cancel): a queued request is cancelled here and now; a
-- running one is flagged and left to its worker; a finished one is left alone.
-- uses: finish
-- KEYS[1]: the request's record.
-- KEYS[2]: its token log.
-- KEYS[3]: its channel.
-- ARGV[1]: the encoded final event (cancelled).
-- ARGV[2]: the time of the cancel (seconds since the epoch).
-- ARGV[3]: the ttl, in seconds, of the record and the token log once ended.
-- Returns the status the request had; false (nil in Python) when it has no record.

local status = redis.call('HGET', KEYS[1], F.status)
if not status then return false end
if status == S.queued then
  finish(KEYS[1], KEYS[2], KEYS[3], S.cancelled, R.cancelled, ARGV[2], ARGV[1], ARGV[3], false)
elseif status == S.running then
  redis.call('HSET', KEYS[1], F.cancel_requested, '1')
end
return status
