-- Library: ending a request in a script, the one way store_cancel, store_end_queued and
-- requeue_decide do it. (The worker ends the requests it ran in its publish pipeline,
-- worker/service/publisher.py, with their text and the ack.)
-- uses: names
--   (the record's field, status and finish-reason tables F, S, R, and the token log's EVENT_FIELD)
-- KEYS, ARGV: none of its own; the including script passes its keys and values to the function.
-- Returns: nothing; it defines one local function.
--   finish(record, log, channel, status, reason, finished_at, event, ttl, error): the record's
--     status, finish reason, end time and error (or none: false), the final event on its token
--     log and channel, and both keys set to expire after `ttl`.

local function finish(record, log, channel, status, reason, finished_at, event, ttl, error)
  redis.call('HSET', record, F.status, status, F.finish_reason, reason, F.finished_at, finished_at)
  if error then redis.call('HSET', record, F.error, error) end
  redis.call('XADD', log, '*', EVENT_FIELD, event)
  redis.call('SPUBLISH', channel, event)
  redis.call('EXPIRE', record, ttl)
  redis.call('EXPIRE', log, ttl)
end
