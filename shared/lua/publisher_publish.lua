-- One request's part of a worker's step (worker/service/publisher.py Publisher.publish): its token
-- events and, where it ended, its end, written only while the request is this worker's: running on
-- it, or put back in the queue and claimed by no one yet (its last worker goes on meanwhile, and a
-- worker that claims it continues after what is logged then). A worker that lost it (paused past
-- its heartbeat's TTL while another took it over) writes nothing, its late final event included:
-- the token log holds one continuation, and only its worker's end ends the request.
-- uses: names
-- KEYS[1]: the request's record.
-- KEYS[2]: its token log.
-- KEYS[3]: its channel (all three in one slot: the request's id).
-- ARGV[1]: the publishing worker's name.
-- ARGV[2]: n, how many token events follow.
-- ARGV[3 .. 2+n]: the encoded token events, in order.
-- ARGV[3+n]: when its first token was published, or '' (its first token is not in this step).
-- ARGV[4+n]: when its first step began, or '' (not said, or not in this step).
-- ARGV[5+n]: the encoded final event, or '' while the request goes on; after it, where given, the end:
-- ARGV[6+n .. 12+n]: its status, finish reason, completion tokens, end time, whole text, reused
--   tokens and error ('' for none), written to the record.
-- ARGV[13+n]: the ttl, in seconds, of the record and the token log once ended.
-- Returns 1 when it wrote them; 0 when the request is not this worker's (it wrote nothing).

local record = redis.call('HMGET', KEYS[1], F.status, F.worker)
local status, worker = record[1], record[2]
local mine = (status == S.running and worker == ARGV[1]) or (status == S.queued and worker == '')
if not mine then return 0 end
local n = tonumber(ARGV[2])
for i = 3, 2 + n do
  redis.call('XADD', KEYS[2], '*', EVENT_FIELD, ARGV[i])
  redis.call('SPUBLISH', KEYS[3], ARGV[i])
end
if ARGV[3 + n] ~= '' then redis.call('HSET', KEYS[1], F.first_token_at, ARGV[3 + n]) end
if ARGV[4 + n] ~= '' then redis.call('HSET', KEYS[1], F.scheduled_at, ARGV[4 + n]) end
local final = ARGV[5 + n]
if final == '' then return 1 end
local e = 5 + n
redis.call('HSET', KEYS[1], F.status, ARGV[e + 1], F.finish_reason, ARGV[e + 2], F.completion_tokens, ARGV[e + 3],
           F.finished_at, ARGV[e + 4], F.text, ARGV[e + 5], F.reused_tokens, ARGV[e + 6])
if ARGV[e + 7] ~= '' then redis.call('HSET', KEYS[1], F.error, ARGV[e + 7]) end
redis.call('XADD', KEYS[2], '*', EVENT_FIELD, final)
redis.call('SPUBLISH', KEYS[3], final)
redis.call('EXPIRE', KEYS[1], ARGV[e + 8])
redis.call('EXPIRE', KEYS[2], ARGV[e + 8])
return 1
