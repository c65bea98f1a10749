"""Publish one step's results: every event of the step in ONE Redis pipeline."""
from __future__ import annotations

from redis.asyncio import Redis

from shared import redis_keys
from shared.messages import STATUS_OF_FINISH, FinalEvent, Usage, encode_event, now
from shared.queue import RequestQueue
from shared.redis_keys import EVENT_FIELD
from shared.request_record import RecordField
from worker.engine.sequence import StepOutput


class Publisher:
    def __init__(self, redis: Redis, queue: RequestQueue):
        self.redis = redis
        self.prefix = queue.prefix
        self.queue = queue
        self.entries: dict[str, str] = {}  # request id -> its queue entry, acked when the request ends

    def taken(self, request_id: str, entry_id: str) -> None:
        """A request the backend now runs, from this queue entry."""
        self.entries[request_id] = entry_id

    async def publish(self, outputs: list[StepOutput]) -> None:
        """Token log XADD + SPUBLISH for each new token; on finish the record, final event and XACK."""
        if not outputs:
            return
        stamp = now()
        async with self.redis.pipeline(transaction=False) as pipe:
            for out in outputs:
                rid = out.request_id
                log, channel = redis_keys.token_log(self.prefix, rid), redis_keys.request_channel(self.prefix, rid)
                if out.token is not None:
                    data = encode_event(out.token)
                    pipe.xadd(log, {EVENT_FIELD: data})
                    pipe.execute_command("SPUBLISH", channel, data)
                    if out.token.index == 0:
                        first = {RecordField.FIRST_TOKEN_AT: stamp}
                        if out.scheduled_at:  # when its first step began (a backend may not say)
                            first[RecordField.SCHEDULED_AT] = out.scheduled_at
                        pipe.hset(redis_keys.request_record(self.prefix, rid), mapping=first)
                if out.finished:
                    self._finish(pipe, out, log, channel, stamp)
            await pipe.execute()
        for out in outputs:  # only once published: a retried publish acks them again
            if out.finished:
                self.entries.pop(out.request_id, None)

    def _finish(self, pipe, out: StepOutput, log: str, channel: str, stamp: float) -> None:
        end = out.end
        record = redis_keys.request_record(self.prefix, out.request_id)
        usage = Usage(prompt_tokens=end.prompt_tokens, completion_tokens=end.completion_tokens,
                      cached_tokens=min(end.reused_tokens, end.prompt_tokens))
        status = STATUS_OF_FINISH[end.finish_reason]
        pooled = list(end.pooled) if end.pooled is not None else None
        final = encode_event(FinalEvent(status=status, finish_reason=end.finish_reason, usage=usage, error=end.error,
                                        pooled=pooled))
        fields = {RecordField.STATUS: status.value, RecordField.FINISH_REASON: end.finish_reason.value,
                  RecordField.COMPLETION_TOKENS: usage.completion_tokens, RecordField.FINISHED_AT: stamp,
                  RecordField.TEXT: end.text, RecordField.REUSED_TOKENS: end.reused_tokens}
        if end.error:
            fields[RecordField.ERROR] = end.error
        pipe.hset(record, mapping=fields)
        pipe.xadd(log, {EVENT_FIELD: final})
        pipe.execute_command("SPUBLISH", channel, final)
        pipe.xack(self.queue.lane_stream(out.lane), redis_keys.WORKER_GROUP, self.entries[out.request_id])
        pipe.expire(record, redis_keys.RESULT_TTL_S)
        pipe.expire(log, redis_keys.RESULT_TTL_S)
