"""The request record and its state changes, done atomically in Redis.

The api and the worker both change a request's status; each change is a small Lua script
that checks the current status first, so a cancel and a worker's claim can never both win.
"""
from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from shared import redis_keys
from shared.messages import (Cancel, FinalEvent, FinishReason, RequestPayload, RequestStatus, StatusEvent, TokenEvent,
                             Usage, decode_event, encode_event, now)
from shared.queue import BACKLOG_LUA, RequestQueue, lane_of
from shared.request_record import LUA_NAMES, RecordField, RequestRecord

# Field of a token-log entry that holds the encoded event.
EVENT_FIELD = "e"

# Ending a request in a script, the one way the scripts here and the scheduler's requeue do it:
# the record's status, finish reason, end time and error (or none: false), the final event on
# its token log and channel, and both keys set to expire after `ttl`. (The worker ends the
# requests it ran in its publish pipeline, worker/service/publisher.py, with their text and the ack.)
# It comes after LUA_NAMES, the record's field and status names every script here uses.
FINISH_LUA = LUA_NAMES + """
local function finish(record, log, channel, status, reason, finished_at, event, ttl, error)
  redis.call('HSET', record, F.status, status, F.finish_reason, reason, F.finished_at, finished_at)
  if error then redis.call('HSET', record, F.error, error) end
  redis.call('XADD', log, '*', '%s', event)
  redis.call('SPUBLISH', channel, event)
  redis.call('EXPIRE', record, ttl)
  redis.call('EXPIRE', log, ttl)
end
""" % EVENT_FIELD

# KEYS: record. ARGV: worker, started_at. queued → running for this worker; also 1 when the
# request already runs on this same worker (a retried claim whose first answer was lost).
_CLAIM = LUA_NAMES + """
local status = redis.call('HGET', KEYS[1], F.status)
if status == S.running and redis.call('HGET', KEYS[1], F.worker) == ARGV[1] then return 1 end
if status ~= S.queued then return 0 end
redis.call('HSET', KEYS[1], F.status, S.running, F.worker, ARGV[1], F.started_at, ARGV[2])
return 1
"""

# KEYS: lanes set, doorbell, then each request's lane stream (all in the model's queue slot).
# ARGV: group, the most requests that may wait (-1: no limit), the lane streams' key prefix,
# then for each request its lane and payload.
# The backlog check and the queueing in one step, all requests or none: past the limit nothing is queued
# and {0, waiting, taken} comes back; else the requests are queued and {1, waiting before
# them, taken}. A lane seen for the first time gets the workers' group (before its first
# entry) and rings the doorbell. The records are written before, by enqueue().
_SUBMIT = BACKLOG_LUA + """
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
"""

# KEYS: record, token log, channel. ARGV: encoded final event, finished_at, ttl.
# Returns the status the request had: a queued one is cancelled here and now; a running one
# is flagged and left to its worker; a finished one is left alone.
_CANCEL = FINISH_LUA + """
local status = redis.call('HGET', KEYS[1], F.status)
if not status then return false end
if status == S.queued then
  finish(KEYS[1], KEYS[2], KEYS[3], S.cancelled, R.cancelled, ARGV[2], ARGV[1], ARGV[3], false)
elseif status == S.running then
  redis.call('HSET', KEYS[1], F.cancel_requested, '1')
end
return status
"""


# KEYS: record, token log, channel. ARGV: encoded final event, finished_at, ttl, error, status,
# finish reason. Ends a request that is still queued (expired, or failed); returns 1 if it did.
_END_QUEUED = FINISH_LUA + """
if redis.call('HGET', KEYS[1], F.status) ~= S.queued then return 0 end
finish(KEYS[1], KEYS[2], KEYS[3], ARGV[5], ARGV[6], ARGV[2], ARGV[1], ARGV[3], ARGV[4])
return 1
"""


@dataclass(frozen=True)
class Enqueued:
    """What an enqueue found: whether it queued the requests, and the model's backlog before them."""
    queued: bool
    waiting: int  # requests no worker had taken yet, over all lanes
    taken: int  # requests ever taken by a worker (its growth is the drain rate)


class RequestStore:
    """Reads and writes request records for one key prefix."""

    def __init__(self, redis: Redis, prefix: str):
        self.redis = redis
        self.prefix = prefix
        self._submit = redis.register_script(_SUBMIT)
        self._claim = redis.register_script(_CLAIM)
        self._cancel = redis.register_script(_CANCEL)
        self._end = redis.register_script(_END_QUEUED)

    async def submit(self, payload: RequestPayload) -> None:
        """Write the record, then queue the request in its lane."""
        await self.enqueue([payload])

    async def enqueue(self, payloads: list[RequestPayload], max_waiting: int | None = None) -> Enqueued:
        """Queue requests of one model, all or none, unless that would leave more than
        `max_waiting` requests waiting for a worker: the check and the queueing are one script,
        so replicas submitting at once never pass the limit together.

        Each request's record lies in its own slot, the queue in the model's (Redis Cluster), so
        the records are written first, then queued; records of requests the limit refused are
        deleted. A replica that dies in between leaves records that were never queued (its
        client got no answer); they carry the result TTL from the start, so Redis drops them."""
        model = payloads[0].model
        if any(p.model != model for p in payloads):
            raise ValueError(f"one enqueue takes requests of one model; got {sorted({p.model for p in payloads})}")
        queue = RequestQueue(self.redis, self.prefix, model)
        records = [redis_keys.request_record(self.prefix, p.id) for p in payloads]
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, payload in zip(records, payloads, strict=True):
                pipe.hset(key, mapping=RequestRecord.queued(payload).fields())
                pipe.expire(key, redis_keys.RESULT_TTL_S)
            await pipe.execute()
        queued, waiting, taken = await self._submit(
            keys=[queue.lanes_key, queue.doorbell, *[queue.stream_of(p) for p in payloads]],
            args=[redis_keys.WORKER_GROUP, -1 if max_waiting is None else max_waiting, queue.stream_prefix,
                  *[x for p in payloads for x in (lane_of(p), p.model_dump_json())]])
        if not queued:
            await self._delete(records)
        return Enqueued(bool(queued), int(waiting), int(taken))

    async def _delete(self, keys: list[str]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:  # one DEL each: they lie in several slots
            for key in keys:
                pipe.delete(key)
            await pipe.execute()

    async def claim(self, request_id: str, worker: str) -> bool:
        """queued → running for this worker; False if it is no longer queued (e.g. cancelled)."""
        record = redis_keys.request_record(self.prefix, request_id)
        started = now()
        ok = await self._claim(keys=[record], args=[worker, started])
        if ok:
            event = encode_event(StatusEvent(status=RequestStatus.RUNNING, worker=worker))
            await self.redis.execute_command("SPUBLISH", redis_keys.request_channel(self.prefix, request_id), event)
        return bool(ok)

    async def cancel(self, request_id: str, prompt_tokens: int) -> RequestStatus | None:
        """Cancel a request; return the status it had (None if there is no such request)."""
        final = FinalEvent(status=RequestStatus.CANCELLED, finish_reason=FinishReason.CANCELLED,
                           usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=0))
        status = await self._cancel(
            keys=[redis_keys.request_record(self.prefix, request_id), redis_keys.token_log(self.prefix, request_id),
                  redis_keys.request_channel(self.prefix, request_id)],
            args=[encode_event(final), now(), redis_keys.RESULT_TTL_S])
        if status is None:
            return None
        if status == RequestStatus.RUNNING.value:
            await self.redis.execute_command("SPUBLISH", redis_keys.cancel_channel(self.prefix),
                                             Cancel(request_id=request_id).encode())
        return RequestStatus(status)

    async def expire(self, payload: RequestPayload) -> bool:
        """End a request that waited past its queue timeout without starting; True if it did."""
        waited = now() - payload.created_at
        error = f"the request waited {waited:.1f} s in the queue, past its timeout, and was not run"
        return await self._end_queued(payload.id, RequestStatus.EXPIRED, FinishReason.EXPIRED, error,
                                      len(payload.prompt_token_ids))

    async def fail_queued(self, request_id: str, error: str) -> bool:
        """End a queued request that no worker can run (its entry does not parse); True if it did."""
        return await self._end_queued(request_id, RequestStatus.FAILED, FinishReason.ERROR, error, 0)

    async def _end_queued(self, request_id: str, status: RequestStatus, reason: FinishReason, error: str,
                          prompt_tokens: int) -> bool:
        final = FinalEvent(status=status, finish_reason=reason, error=error,
                           usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=0))
        done = await self._end(
            keys=[redis_keys.request_record(self.prefix, request_id), redis_keys.token_log(self.prefix, request_id),
                  redis_keys.request_channel(self.prefix, request_id)],
            args=[encode_event(final), now(), redis_keys.RESULT_TTL_S, error, status.value, reason.value])
        return bool(done)

    async def keep_result(self, request_id: str, ttl_s: int) -> None:
        """A finished request's record and token log kept `ttl_s` from now, where that is longer
        than the RESULT_TTL_S its end gave them (a stored response kept longer needs them)."""
        if ttl_s > redis_keys.RESULT_TTL_S:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.expire(redis_keys.request_record(self.prefix, request_id), ttl_s)
                pipe.expire(redis_keys.token_log(self.prefix, request_id), ttl_s)
                await pipe.execute()

    async def record(self, request_id: str) -> RequestRecord | None:
        """The request's record; None if there is none (never written, or expired)."""
        return RequestRecord.of(await self.redis.hgetall(redis_keys.request_record(self.prefix, request_id)))

    async def cancel_flagged(self, request_ids: list[str]) -> list[str]:
        """Those of the requests whose record says a cancel came while they ran."""
        pipe = self.redis.pipeline(transaction=False)  # on a cluster, the records are on many nodes
        for request_id in request_ids:
            pipe.hget(redis_keys.request_record(self.prefix, request_id), RecordField.CANCEL_REQUESTED.value)
        return [rid for rid, flag in zip(request_ids, await pipe.execute()) if flag == "1"]

    async def output(self, request_id: str) -> list[TokenEvent]:
        """The request's token events so far, by index (a retried publish may log one twice)."""
        tokens: dict[int, TokenEvent] = {}
        for _, data in await self.events(request_id):
            if isinstance(event := decode_event(data), TokenEvent):
                tokens.setdefault(event.index, event)
        return [tokens[i] for i in sorted(tokens)]

    async def events(self, request_id: str, after_entry: str = "-") -> list[tuple[str, str]]:
        """Token-log entries (entry id, encoded event) after the given entry id."""
        start = "-" if after_entry == "-" else f"({after_entry}"
        entries = await self.redis.xrange(redis_keys.token_log(self.prefix, request_id), min=start)
        return [(entry_id, fields[EVENT_FIELD]) for entry_id, fields in entries]
