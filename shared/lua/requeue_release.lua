-- The lane step of a requeue (shared/requeue.py Requeue.release): acks the entry; only the first
-- acker queues the payload again (when the record step requeued it).
-- KEYS[1]: the lane stream the entry is in.
-- ARGV[1]: the workers' consumer group.
-- ARGV[2]: the entry id.
-- ARGV[3]: the outcome the record step decided (requeue_decide).
-- ARGV[4]: the request's payload (JSON).
-- Returns 1 if this call acked the entry (and queued the payload again when requeued), else 0.

if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end  -- another reclaimer was first
if ARGV[3] == 'requeued' then redis.call('XADD', KEYS[1], '*', 'payload', ARGV[4]) end
return 1
