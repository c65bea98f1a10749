"""The batch job: runs an offline batch's requests at a lower priority than interactive ones.

It queues a batch request only while no request is waiting for a worker (the consumer group's
lag is zero) and keeps at most `batch_concurrency` of them in flight, so interactive traffic is
served first. Results are written as they finish, so a job that is run again (its scheduler
died) skips what is done and does not queue a request twice.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from redis.asyncio import Redis

from shared import redis_keys, scripts
from shared.batch_record import BatchEntry, BatchField, BatchStatus
from shared.messages import RequestStatus, now
from shared.queue import RequestQueue
from shared.request_record import RequestRecord
from shared.store import RequestStore

log = logging.getLogger(__name__)
POLL_S = 0.2  # a batch is offline work: checking its requests 5 times a second is plenty

def result_line(rid: str, item: BatchEntry, record: RequestRecord, text: str, model: str) -> tuple[dict, bool]:
    """One line of the results, in OpenAI's batch output shape; and whether it succeeded."""
    status = record.status.value
    if record.status != RequestStatus.DONE:
        return {"id": f"batch_req_{rid}", "custom_id": item.custom_id, "response": None,
                "error": {"code": status, "message": record.error or f"the request ended {status}"}}, False
    usage = {"prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens or 0}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    reason = record.finish_reason.value if record.finish_reason else None
    created = int(record.created_at)
    if item.endpoint == "/v1/chat/completions":
        body = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created,
                "model": model, "usage": usage, "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": reason}]}
    else:
        body = {"id": f"cmpl-{rid}", "object": "text_completion", "created": created,
                "model": model, "usage": usage, "choices": [
                    {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}
    return {"id": f"batch_req_{rid}", "custom_id": item.custom_id,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}, True


async def run_batch(redis: Redis, prefix: str, model: str, batch_id: str, concurrency: int) -> dict[str, Any]:
    store = RequestStore(redis, prefix)
    record_result = scripts.register(redis, "batch_result")
    record_key, results_key = redis_keys.batch_record(prefix, batch_id), redis_keys.batch_results(prefix, batch_id)
    queue = RequestQueue(redis, prefix, model)
    await redis.hset(record_key, mapping={BatchField.STATUS: BatchStatus.IN_PROGRESS, BatchField.STARTED_AT: now()})
    items = [BatchEntry.of(i) for i in await redis.lrange(redis_keys.batch_items(prefix, batch_id), 0, -1)]
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
                line, ok = result_line(rid, item, record, text, model)
                await record_result(keys=[results_key, record_key], args=[
                    item.custom_id, json.dumps(line, ensure_ascii=False), BatchField.COMPLETED if ok else BatchField.FAILED])
                del in_flight[rid]
        await asyncio.sleep(POLL_S)
    await redis.hset(record_key, mapping={BatchField.STATUS: BatchStatus.COMPLETED, BatchField.COMPLETED_AT: now()})
    for key in (record_key, results_key, redis_keys.batch_items(prefix, batch_id)):
        await redis.expire(key, redis_keys.RESULT_TTL_S)
    log.info("batch %s: %d requests in %.1f s", batch_id, len(items), time.monotonic() - started)
    return {"requests": len(items)}
