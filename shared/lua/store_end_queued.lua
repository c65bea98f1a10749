-- Ends a request that is still queued: expired, or failed (shared/store.py RequestStore.expire and
-- fail_queued).
-- uses: finish
-- KEYS[1]: the request's record.
-- KEYS[2]: its token log.
-- KEYS[3]: its channel.
-- ARGV[1]: the encoded final event.
-- ARGV[2]: the time it ends (seconds since the epoch).
-- ARGV[3]: the ttl, in seconds, of the record and the token log.
-- ARGV[4]: the error.
-- ARGV[5]: the status it ends with.
-- ARGV[6]: the finish reason.
-- Returns 1 if it ended the request, 0 if the request was not queued.

if redis.call('HGET', KEYS[1], F.status) ~= S.queued then return 0 end
finish(KEYS[1], KEYS[2], KEYS[3], ARGV[5], ARGV[6], ARGV[2], ARGV[1], ARGV[3], ARGV[4])
return 1
