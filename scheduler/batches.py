"""The batch job: runs an offline batch's requests at a lower priority than interactive ones, inside
its tenant's limits and its completion window.

It queues a batch request only while no request is waiting for a worker (the consumer group's
lag is zero), keeps at most `batch_concurrency` of them in flight, and charges each to its
tenant's limits as the api charges an online request (api/core/limits.py): past the tenant's
concurrency or tokens per minute the request waits, so a batch never lets a tenant do more than
it could online. Results are written as they finish, so a job that is run again (its scheduler
died) skips what is done and does not queue a request twice. At the window's end the requests
still running are cancelled and every unfinished one gets a `batch_expired` error line. When
the batch ends, its results with a response make its output file and the others its error file
(shared/files.py), under ids derived from the batch's, so a job run again rewrites the same files.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis

from api.core.errors import ApiError
from api.core.limits import Limits
from shared import redis_keys, scripts
from shared.batch_record import (EXPIRED_CODE, BatchEntry, BatchField, BatchRecord, BatchResult, BatchStatus,
                                 ChatChoice, ResultBody, ResultError, ResultMessage, ResultResponse, ResultUsage,
                                 TextChoice)
from shared.files import FileStore
from shared.messages import RequestStatus, now
from shared.queue import RequestQueue
from shared.request_record import RequestRecord
from shared.store import RequestStore

log = logging.getLogger(__name__)
POLL_S = 0.2  # a batch is offline work: checking its requests 5 times a second is plenty
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


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


def error_line(item: BatchEntry, code: str, message: str) -> BatchResult:
    return BatchResult(id=f"batch_req_{item.payload.id}", custom_id=item.custom_id, response=None,
                       error=ResultError(code=code, message=message))


def batch_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: the same on every run of its job."""
    return f"file-{uuid.uuid5(uuid.NAMESPACE_URL, f'{batch_id}/{kind}').hex}"


class BatchJob:
    """One run of a batch's job. `clock` (seconds since the epoch) decides the window's end and
    `sleep` paces the loop; a test hands its own of both."""

    def __init__(self, redis: Redis, prefix: str, model: str, batch_id: str, concurrency: int, files: FileStore,
                 limits: Limits, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep):
        self.redis, self.prefix, self.model, self.batch_id = redis, prefix, model, batch_id
        self.concurrency, self.files, self.limits, self.clock, self.sleep = concurrency, files, limits, clock, sleep
        self.store = RequestStore(redis, prefix)
        self.queue = RequestQueue(redis, prefix, model)
        self.record_key = redis_keys.batch_record(prefix, batch_id)
        self.results_key = redis_keys.batch_results(prefix, batch_id)
        self._record_result = scripts.register(redis, "batch_result")
        self.not_before = 0.0  # the tenant's limits refused a request: none is tried before this (clock)

    async def run(self) -> dict[str, Any]:
        record = BatchRecord.of(await self.redis.hgetall(self.record_key))
        if record is None or record.status.finished:  # gone, or ended by an earlier run
            return {"requests": record.total if record else 0}
        started = time.monotonic()
        await self.redis.hset(self.record_key, mapping={BatchField.STATUS: BatchStatus.IN_PROGRESS,
                                                        BatchField.STARTED_AT: record.started_at or now()})
        items = [BatchEntry.decode(i) for i in await self.redis.lrange(redis_keys.batch_items(self.prefix,
                                                                                              self.batch_id), 0, -1)]
        finished = set(await self.redis.hkeys(self.results_key))
        todo = [i for i in items if i.custom_id not in finished]
        in_flight: dict[str, BatchEntry] = {}
        while todo or in_flight:
            if self.clock() >= record.deadline:
                await self._expire(todo, in_flight)
                break
            await self._queue(record.tenant, todo, in_flight)
            await self._collect(in_flight)
            await self.sleep(POLL_S)
        status = await self._end(record, items)
        log.info("batch %s %s: %d requests in %.1f s", self.batch_id, status, len(items), time.monotonic() - started)
        return {"requests": len(items), "status": status.value}

    async def _queue(self, tenant: str, todo: list[BatchEntry], in_flight: dict[str, BatchEntry]) -> None:
        """Queue requests while the batch, the tenant's limits and the workers' backlog allow."""
        while todo and len(in_flight) < self.concurrency and self.clock() >= self.not_before \
                and (await self.queue.backlog())[0] == 0:
            item = todo[0]
            payload = item.payload
            if await self.store.record(payload.id) is None:  # not queued by an earlier run of this job
                charged = await self._charge(tenant, item)
                if charged is None:  # it can never pass: it ended with an error line
                    todo.pop(0)
                    continue
                if not charged:
                    return
                await self.store.submit(payload)
            in_flight[payload.id] = todo.pop(0)

    async def _charge(self, tenant: str, item: BatchEntry) -> bool | None:
        """Charge the request to its tenant's limits as the api would (none without a tenant: auth is
        off); False where it must wait, None where it could never pass (more tokens than the tenant's
        tokens per minute): then it ends at once with an error line."""
        if not tenant:
            return True
        payload = item.payload
        tokens = payload.cost_tokens
        try:
            payload.weight = await self.limits.charge(tenant, [payload.id], tokens)
            return True
        except ApiError as exc:
            if exc.status != 429:
                raise
            tpm = float(await self.redis.hget(redis_keys.tenant_limits(self.prefix, tenant), "tpm") or 0)
            if 0 < tpm < tokens:
                await self._write(item, error_line(item, "rate_limit_exceeded", f"the request reserves {tokens} "
                                                   f"tokens, more than the tenant's {tpm:.0f} tokens per minute"))
                return None
            self.not_before = self.clock() + float((exc.headers or {}).get("Retry-After", 1))
            return False

    async def _collect(self, in_flight: dict[str, BatchEntry]) -> None:
        for rid, item in list(in_flight.items()):
            record = await self.store.record(rid)
            if record is not None and record.status.finished:
                text = "".join(t.text for t in await self.store.output(rid))
                await self._write(item, result_line(rid, item, record, text, self.model))
                del in_flight[rid]

    async def _expire(self, todo: list[BatchEntry], in_flight: dict[str, BatchEntry]) -> None:
        """The window ended: what finished meanwhile is kept, the rest is cancelled and written batch_expired."""
        await self._collect(in_flight)
        for rid, item in in_flight.items():
            await self.store.cancel(rid, len(item.payload.prompt_token_ids))
        for item in [*in_flight.values(), *todo]:
            await self._write(item, error_line(item, EXPIRED_CODE, EXPIRED_MESSAGE))
        in_flight.clear()
        todo.clear()

    async def _write(self, item: BatchEntry, line: BatchResult) -> None:
        """The line once (a line written already stays), counted completed or failed."""
        await self._record_result(keys=[self.results_key, self.record_key], args=[
            item.custom_id, line.encode(), BatchField.FAILED if line.error else BatchField.COMPLETED])

    async def _end(self, record: BatchRecord, items: list[BatchEntry]) -> BatchStatus:
        """The output and error files, then the record's end; everything of the batch then expires.
        Expired where a line says so (also when an earlier run wrote it and died before this)."""
        results = await self.redis.hgetall(self.results_key)
        decoded = [(results[i.custom_id], BatchResult.decode(results[i.custom_id]))
                   for i in items if i.custom_id in results]
        errors = [line for line, result in decoded if result.error is not None]
        outputs = [line for line, result in decoded if result.error is None]
        expired = any(result.error is not None and result.error.code == EXPIRED_CODE for _, result in decoded)
        status = BatchStatus.EXPIRED if expired else BatchStatus.COMPLETED
        ended = now()
        fields: dict[str, Any] = {BatchField.STATUS: status, BatchField.COMPLETED_AT if status == BatchStatus.COMPLETED
                                  else BatchField.EXPIRED_AT: ended}
        for kind, chosen, field in (("output", outputs, BatchField.OUTPUT_FILE_ID),
                                    ("error", errors, BatchField.ERROR_FILE_ID)):
            if chosen:  # as OpenAI: no file for an empty kind
                stored = await self.files.create(record.tenant, f"{self.batch_id}_{kind}.jsonl", "batch_output",
                                                 "".join(f"{line}\n" for line in chosen).encode("utf-8"),
                                                 file_id=batch_file_id(self.batch_id, kind))
                fields[field] = stored.id
        await self.redis.hset(self.record_key, mapping=fields)
        for key in (self.record_key, self.results_key, redis_keys.batch_items(self.prefix, self.batch_id)):
            await self.redis.expire(key, redis_keys.RESULT_TTL_S)
        return status


async def run_batch(redis: Redis, prefix: str, model: str, batch_id: str, concurrency: int, files_ttl_s: int,
                    active_ttl_s: float) -> dict[str, Any]:
    """The scheduler's job for one batch (scheduler/main.py)."""
    job = BatchJob(redis, prefix, model, batch_id, concurrency, FileStore(redis, prefix, files_ttl_s),
                   Limits(redis, prefix, active_ttl_s))
    return await job.run()
