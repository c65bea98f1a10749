"""The batch job: runs an offline batch's requests at a lower priority than interactive ones.

It queues a batch request only while no request is waiting for a worker (the consumer group's
lag is zero) and keeps at most `batch_concurrency` of them in flight, so interactive traffic is
served first. Results are written as they finish, so a job that is run again (its scheduler
died) skips what is done and does not queue a request twice.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from redis.asyncio import Redis

from shared import redis_keys, scripts
from shared.batch_record import (BatchEntry, BatchField, BatchResult, BatchStatus, ChatChoice, ResultBody,
                                 ResultError, ResultMessage, ResultResponse, ResultUsage, TextChoice)
from shared.messages import RequestStatus, now
from shared.queue import RequestQueue
from shared.request_record import RequestRecord
from shared.store import RequestStore

log = logging.getLogger(__name__)
POLL_S = 0.2  # a batch is offline work: checking its requests 5 times a second is plenty

def result_line(rid: str, item: BatchEntry, record: RequestRecord, text: str, model: str) -> BatchResult:
    """One line of the results, in OpenAI's batch output shape."""
    status = record.status.value
    if record.status != RequestStatus.DONE:
        return BatchResult(id=f"batch_req_{rid}", custom_id=item.custom_id, response=None,
                           error=ResultError(code=status, message=record.error or f"the request ended {status}"))
    completion = record.completion_tokens or 0
    usage = ResultUsage(prompt_tokens=record.prompt_tokens, completion_tokens=completion,
                        total_tokens=record.prompt_tokens + completion)
    reason = record.finish_reason.value if record.finish_reason else None
    created = int(record.created_at)
    if item.endpoint == "/v1/chat/completions":
        body = ResultBody(id=f"chatcmpl-{rid}", object="chat.completion", created=created, model=model, usage=usage,
                          choices=[ChatChoice(message=ResultMessage(content=text), finish_reason=reason)])
    else:
        body = ResultBody(id=f"cmpl-{rid}", object="text_completion", created=created, model=model, usage=usage,
                          choices=[TextChoice(text=text, finish_reason=reason)])
    return BatchResult(id=f"batch_req_{rid}", custom_id=item.custom_id,
                       response=ResultResponse(status_code=200, request_id=rid, body=body), error=None)


async def run_batch(redis: Redis, prefix: str, model: str, batch_id: str, concurrency: int) -> dict[str, Any]:
    store = RequestStore(redis, prefix)
    record_result = scripts.register(redis, "batch_result")
    record_key, results_key = redis_keys.batch_record(prefix, batch_id), redis_keys.batch_results(prefix, batch_id)
    queue = RequestQueue(redis, prefix, model)
    await redis.hset(record_key, mapping={BatchField.STATUS: BatchStatus.IN_PROGRESS, BatchField.STARTED_AT: now()})
    items = [BatchEntry.decode(i) for i in await redis.lrange(redis_keys.batch_items(prefix, batch_id), 0, -1)]
    finished = set(await redis.hkeys(results_key))
    todo = [i for i in items if i.custom_id not in finished]
    in_flight: dict[str, BatchEntry] = {}
    started = time.monotonic()
    while todo or in_flight:
        while todo and len(in_flight) < concurrency and (await queue.backlog())[0] == 0:
            item = todo.pop(0)
            payload = item.payload
            if await store.record(payload.id) is None:  # not queued by an earlier run of this job
                await store.submit(payload)
            in_flight[payload.id] = item
        for rid, item in list(in_flight.items()):
            record = await store.record(rid)
            if record is not None and record.status.finished:
                text = "".join(t.text for t in await store.output(rid))
                line = result_line(rid, item, record, text, model)
                await record_result(keys=[results_key, record_key], args=[
                    item.custom_id, line.encode(), BatchField.FAILED if line.error else BatchField.COMPLETED])
                del in_flight[rid]
        await asyncio.sleep(POLL_S)
    await redis.hset(record_key, mapping={BatchField.STATUS: BatchStatus.COMPLETED, BatchField.COMPLETED_AT: now()})
    for key in (record_key, results_key, redis_keys.batch_items(prefix, batch_id)):
        await redis.expire(key, redis_keys.RESULT_TTL_S)
    log.info("batch %s: %d requests in %.1f s", batch_id, len(items), time.monotonic() - started)
    return {"requests": len(items)}
