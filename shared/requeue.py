"""Putting a dead worker's request back in its lane, or ending it, in two steps of one slot each.

The record, token log and channel share the request's slot (`{id}`); the lane stream lives in
its model's slot, and the dead-letter stream in another. A Redis Cluster runs a script on one
slot only, so the requeue is two scripts, each idempotent, with one guarantee between them:
two schedulers, or one that dies half-way, never queue a request twice nor count an attempt
twice.

1. The record step decides the outcome and writes it to the record with the entry it came
   from (`requeued_from`, `requeue_outcome`). Run again for that entry (a second scheduler,
   or a retry after a death), it changes nothing and answers the outcome written the first
   time; for an entry older than the one recorded (ids grow within a lane) it answers
   `stale`: that entry was dealt with before.
2. The lane step XACKs the entry; only the first acker (XACK returns 1) queues the payload
   again, and adds a dead request to the dead-letter stream.

Between the steps the entry stays pending on the reclaimer, which has no heartbeat: if the
scheduler dies there, the next round claims the entry again and runs both steps, the first of
which then does nothing.
"""
from __future__ import annotations

from pydantic import ValidationError
from redis.asyncio import Redis

from shared import redis_keys, scripts
from shared.messages import FinalEvent, FinishReason, RequestPayload, RequestStatus, Usage, encode_event, now
from shared.request_record import RecordField

class Requeue:
    """Puts reclaimed entries back in their lane, or ends their requests (module docstring)."""

    def __init__(self, redis: Redis, prefix: str, max_attempts: int):
        self.redis, self.prefix, self.max_attempts = redis, prefix, max_attempts
        self._decide = scripts.register(redis, "requeue_decide")
        self._release = scripts.register(redis, "requeue_release")

    async def __call__(self, stream: str, entry_id: str, fields: dict) -> str:
        """The outcome for one entry the reclaimer holds: requeued, dead, cancelled, ended,
        malformed, or gone (another reclaimer acked it first)."""
        try:
            payload = RequestPayload.model_validate_json(fields.get("payload", ""))
        except ValidationError:
            await self.redis.xack(stream, redis_keys.WORKER_GROUP, entry_id)
            return "malformed"
        outcome, _ = await self.decide(entry_id, payload)
        return await self.release(stream, entry_id, outcome, payload)

    async def decide(self, entry_id: str, payload: RequestPayload) -> tuple[str, bool]:
        """The record step: the outcome, and whether this call decided it (False: an earlier
        call for this entry did, or the entry is older than the one the record was requeued from)."""
        rid = payload.id
        attempts = int(await self.redis.hget(redis_keys.request_record(self.prefix, rid), RecordField.ATTEMPTS) or 0)
        delivered = await self.redis.xlen(redis_keys.token_log(self.prefix, rid))
        usage = Usage(prompt_tokens=payload.num_prompt_tokens, completion_tokens=delivered)
        failed = FinalEvent(status=RequestStatus.FAILED, finish_reason=FinishReason.ERROR, usage=usage,
                            error=f"the request took down its worker {attempts + 1} times")
        cancelled = FinalEvent(status=RequestStatus.CANCELLED, finish_reason=FinishReason.CANCELLED, usage=usage)
        outcome, first = await self._decide(
            keys=[redis_keys.request_record(self.prefix, rid), redis_keys.token_log(self.prefix, rid),
                  redis_keys.request_channel(self.prefix, rid)],
            args=[entry_id, self.max_attempts, encode_event(failed), encode_event(cancelled), now(),
                  redis_keys.RESULT_TTL_S])
        return outcome, bool(first)

    async def release(self, stream: str, entry_id: str, outcome: str, payload: RequestPayload) -> str:
        """The lane step: ack the entry; the first acker carries out `outcome` on the lane side.
        Returns `outcome`, or `gone` if another call acked the entry first."""
        won = await self._release(keys=[stream], args=[redis_keys.WORKER_GROUP, entry_id, outcome,
                                                       payload.model_dump_json()])
        if not won:
            return "gone"
        if outcome == "dead":  # after the ack, so only its winner adds it (a death here loses this line only)
            attempts = await self.redis.hget(redis_keys.request_record(self.prefix, payload.id), RecordField.ATTEMPTS)
            await self.redis.xadd(redis_keys.dead_letter_stream(self.prefix),
                                  {"id": payload.id, "payload": payload.model_dump_json(),
                                   "reason": f"its worker died {attempts} times"})
        return outcome
