"""Offline batches, in the shape of OpenAI's Batch API: many requests in one call, run by the
scheduler at a lower priority than interactive traffic, with progress and results to fetch.

Difference from OpenAI: there is no Files API, so the requests come inline (`requests`, each
`{"custom_id", "body"}` with an optional `method`/`url`), and the results are fetched from
`GET /v1/batches/{id}/results` (JSON lines, the shape of OpenAI's output file).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from api.core.auth import TenantDep
from api.core.deps import ArqDep, GenerationDep, StoreDep
from api.core.errors import ApiError
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_answer
from api.openai.answers import Batch, BatchResultLine, OpenAIError
from api.openai.schemas import ChatCompletionRequest, CompletionRequest
from shared import redis_keys
from shared.batch_record import BatchEntry, BatchRecord

router = APIRouter(tags=["batches"], route_class=StrictJSONRoute, responses=errors(OpenAIError, "OpenAI's error body."))

MAX_BATCH_REQUESTS = 10_000


class BatchItem(BaseModel):
    custom_id: str = Field(min_length=1, max_length=256)
    method: Literal["POST"] = "POST"
    url: str | None = None
    body: dict[str, Any]


class BatchRequest(BaseModel):
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    requests: list[BatchItem] = Field(min_length=1, max_length=MAX_BATCH_REQUESTS)
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


class JSONLines(JSONResponse):
    """Lines that are each JSON already, one per line (application/jsonl)."""

    media_type = "application/jsonl"

    def render(self, content: list[str]) -> bytes:
        return "".join(f"{line}\n" for line in content).encode("utf-8")


async def _payloads(endpoint: str, item: BatchItem, generation) -> list:
    try:
        if endpoint == "/v1/chat/completions":
            body = ChatCompletionRequest.model_validate(item.body)
        else:
            body = CompletionRequest.model_validate(item.body)
    except ValidationError as exc:
        raise ApiError(400, f"request {item.custom_id!r}: {exc.errors()[0]['msg']} "
                            f"({'.'.join(str(p) for p in exc.errors()[0]['loc'])})", param="requests") from exc
    if body.stream or body.n != 1 or getattr(body, "best_of", None) not in (None, 1):
        raise ApiError(400, f"request {item.custom_id!r}: batch requests take n=1 and no stream", param="requests")
    try:
        prompt = body.as_prompt(generation.tool_format) if isinstance(body, ChatCompletionRequest) \
            else body.as_prompt()
        payloads = await generation.payloads(prompt)
    except ApiError as exc:
        raise ApiError(exc.status, f"request {item.custom_id!r}: {exc.message}", param="requests") from exc
    for payload in payloads:  # a batch waits its turn: it must not expire in the queue meanwhile
        payload.expires_at = None
    return payloads


@router.post("/v1/batches", responses=json_answer(Batch, "The batch, handed to the scheduler."))
async def create_batch(body: BatchRequest, generation: GenerationDep, store: StoreDep, arq: ArqDep,
                       tenant: TenantDep):
    """Check every request now (a bad one fails the call with 400), then hand the batch to the scheduler."""
    if len({i.custom_id for i in body.requests}) != len(body.requests):
        raise ApiError(400, "custom_id must be unique within a batch", param="requests")
    items = []
    for item in body.requests:
        payloads = await _payloads(body.endpoint, item, generation)
        payloads[0].tenant = tenant
        items.append(BatchEntry(custom_id=item.custom_id, endpoint=body.endpoint, payload=payloads[0]).encode())
    batch_id = f"batch_{uuid.uuid4().hex}"
    record = BatchRecord.created(body.endpoint, tenant, int(time.time()), len(items), body.metadata)
    redis = store.redis
    # The items before the record (one round trip, no MULTI: a cluster's async client has none), so
    # the batch exists only once whole.
    async with redis.pipeline(transaction=False) as pipe:
        pipe.rpush(redis_keys.batch_items(store.prefix, batch_id), *items)
        pipe.hset(redis_keys.batch_record(store.prefix, batch_id), mapping=record.fields())
        await pipe.execute()
    await arq.enqueue_job("run_batch", batch_id, _job_id=redis_keys.arq_job_id(store.prefix, batch_id),
                          _queue_name=redis_keys.arq_queue(store.prefix))
    return await _batch_object(store, batch_id, tenant)


async def _batch_object(store, batch_id: str, tenant: str) -> dict:
    record = BatchRecord.of(await store.redis.hgetall(redis_keys.batch_record(store.prefix, batch_id)))
    if record is None or record.tenant != tenant:
        raise ApiError(404, f"no batch {batch_id!r}", code="not_found")

    def stamp(at: float | None) -> int | None:
        return int(at) if at else None
    return {"id": batch_id, "object": "batch", "endpoint": record.endpoint, "status": record.status.value,
            "completion_window": "24h", "created_at": stamp(record.created_at),
            "in_progress_at": stamp(record.started_at), "completed_at": stamp(record.completed_at),
            "request_counts": {"total": record.total, "completed": record.completed, "failed": record.failed},
            "metadata": record.metadata, "results_url": f"/v1/batches/{batch_id}/results"}


@router.get("/v1/batches/{batch_id}", responses=json_answer(Batch, "The batch as it stands."))
async def get_batch(batch_id: str, store: StoreDep, tenant: TenantDep):
    return await _batch_object(store, batch_id, tenant)


@router.get("/v1/batches/{batch_id}/results", response_class=JSONLines, status_code=200,
            responses=json_answer(BatchResultLine, "One JSON line per finished request (application/jsonl)."))
async def batch_results(batch_id: str, store: StoreDep, tenant: TenantDep):
    """One JSON line per finished request, in submission order."""
    await _batch_object(store, batch_id, tenant)
    items = await store.redis.lrange(redis_keys.batch_items(store.prefix, batch_id), 0, -1)
    results = await store.redis.hgetall(redis_keys.batch_results(store.prefix, batch_id))
    lines = [results[cid] for cid in (BatchEntry.decode(i).custom_id for i in items) if cid in results]
    return JSONLines(lines)
