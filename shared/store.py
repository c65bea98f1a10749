"""The request record and its state changes, done atomically in Redis.

The api and the worker both change a request's status; each change is a small Lua script
that checks the current status first, so a cancel and a worker's claim can never both win.
"""
from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import OutOfMemoryError

from shared import redis_keys, scripts
from shared.messages import (Cancel, FinalEvent, FinishReason, RequestPayload, RequestStatus, StatusEvent, TokenEvent,
                             Usage, decode_event, encode_event, now)
from shared.queue import RequestQueue, lane_of
from shared.redis_keys import EVENT_FIELD
from shared.request_record import RecordField, RequestRecord

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
        self._submit = scripts.register(redis, "store_submit")
        self._claim = scripts.register(redis, "store_claim")
        self._cancel = scripts.register(redis, "store_cancel")
        self._end = scripts.register(redis, "store_end_queued")

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
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key, payload in zip(records, payloads, strict=True):
                    pipe.hset(key, mapping=RequestRecord.queued(payload).fields())
                    pipe.expire(key, redis_keys.RESULT_TTL_S)
                await pipe.execute()
            queued, waiting, taken = await self._submit(
                keys=[queue.lanes_key, queue.doorbell, *[queue.stream_of(p) for p in payloads]],
                args=[redis_keys.WORKER_GROUP, -1 if max_waiting is None else max_waiting, queue.stream_prefix,
                      *[x for p in payloads for x in (lane_of(p), p.model_dump_json())]])
        except OutOfMemoryError:
            await self._delete(records)  # Redis at maxmemory still deletes: no record of a refused request stays
            raise
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
                                      payload.num_prompt_tokens)

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
        tokens = first_of_each_index([decode_event(data) for _, data in await self.events(request_id)])
        return [tokens[i] for i in sorted(tokens)]

    async def events(self, request_id: str, after_entry: str = "-") -> list[tuple[str, str]]:
        """Token-log entries (entry id, encoded event) after the given entry id."""
        start = "-" if after_entry == "-" else f"({after_entry}"
        entries = await self.redis.xrange(redis_keys.token_log(self.prefix, request_id), min=start)
        return [(entry_id, fields[EVENT_FIELD]) for entry_id, fields in entries]


def first_of_each_index(events: list) -> dict[int, TokenEvent]:
    """The token events among `events`, by index: the first logged of each (a retried publish logs
    one twice, and its readers saw the first)."""
    tokens: dict[int, TokenEvent] = {}
    for event in events:
        if isinstance(event, TokenEvent):
            tokens.setdefault(event.index, event)
    return tokens


def delivered_tokens(events: list) -> list[TokenEvent]:
    """The tokens a continuation goes on after: by index from 0, the first logged of each, up to
    the last index published or the first one missing (a token lost with a Redis crash): the model
    continues after tokens it has all of, and a client is sent no index it already has."""
    tokens = first_of_each_index(events)
    run: list[TokenEvent] = []
    while len(run) in tokens:
        run.append(tokens[len(run)])
    return run
