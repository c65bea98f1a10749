"""Offline batches, in the shape of OpenAI's Batch API: many requests in one call, run by the
scheduler at a lower priority than interactive traffic, inside the tenant's limits and the
batch's completion window, with progress and results to fetch.

The requests come from a file of the Files API (`input_file_id`, JSON lines as OpenAI's) or inline
(`requests`, each `{"custom_id", "body"}` with an optional `method`/`url`). The results are the
output and error files once the batch ended (`output_file_id`, `error_file_id`), and, as one list
at any time, `GET /v1/batches/{id}/results` (JSON lines, the shape of OpenAI's output file).
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError, model_validator

from api.core.auth import TenantDep
from api.core.deps import ArqDep, GenerationDep, SettingsDep, StoreDep
from api.core.errors import ApiError
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_answer
from api.openai.answers import Batch, BatchResultLine, OpenAIError
from api.openai.files import file_store, owned
from api.openai.schemas import ChatCompletionRequest, CompletionRequest
from shared import ids, redis_keys
from shared.batch_record import DEFAULT_WINDOW, WINDOW_PATTERN, BatchEntry, BatchRecord

router = APIRouter(tags=["batches"], route_class=StrictJSONRoute, responses=errors(OpenAIError, "OpenAI's error body."))

MAX_BATCH_REQUESTS = 10_000


class BatchItem(BaseModel):
    custom_id: str = Field(min_length=1, max_length=256)
    method: Literal["POST"] = "POST"
    url: str | None = None
    body: dict[str, Any]


class BatchRequest(BaseModel):
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    input_file_id: str | None = Field(None, max_length=64, description="A file of /v1/files (purpose batch): "
                                                                       "one request per line, as OpenAI's.")
    requests: list[BatchItem] | None = Field(None, min_length=1, max_length=MAX_BATCH_REQUESTS,
                                             description="The requests inline, instead of a file.")
    completion_window: str = Field(DEFAULT_WINDOW, pattern=WINDOW_PATTERN,
                                   description="1h to 24h: what is unfinished then fails with batch_expired.")
    metadata: dict[str, str] | None = Field(None, max_length=16)

    @model_validator(mode="after")
    def _one_source(self) -> BatchRequest:
        if (self.input_file_id is None) == (self.requests is None):
            raise ValueError("give the requests either as input_file_id or inline as requests, one of the two")
        return self


async def _file_items(body: BatchRequest, files, tenant: str) -> list[BatchItem]:
    """The requests of the batch's input file, one per line, each for the batch's endpoint."""
    stored = await owned(files, tenant, body.input_file_id, param="input_file_id")
    content = await files.content(tenant, body.input_file_id)
    if content is None:  # expired between the two reads
        raise ApiError(404, f"no file {body.input_file_id!r}", param="input_file_id", code="not_found")
    if stored.purpose != "batch":
        raise ApiError(400, f"file {body.input_file_id!r} is a {stored.purpose} file, not a batch's input "
                            "(purpose batch)", param="input_file_id")
    items = []
    for number, line in enumerate(content.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = BatchItem.model_validate(json.loads(line))
        except (ValueError, ValidationError) as exc:
            raise ApiError(400, f"input file line {number}: not a batch request ({str(exc).splitlines()[0]})",
                           param="input_file_id") from exc
        if item.url != body.endpoint:
            raise ApiError(400, f"input file line {number}: url {item.url!r} is not the batch's endpoint "
                                f"{body.endpoint!r}", param="input_file_id")
        items.append(item)
        if len(items) > MAX_BATCH_REQUESTS:
            raise ApiError(400, f"the input file has more than {MAX_BATCH_REQUESTS} requests", param="input_file_id")
    if not items:
        raise ApiError(400, "the input file has no requests", param="input_file_id")
    return items


class JSONLines(JSONResponse):
    """Lines that are each JSON already, one per line (application/jsonl)."""

    media_type = "application/jsonl"

    def render(self, content: list[str]) -> bytes:
        return "".join(f"{line}\n" for line in content).encode("utf-8")


async def _payloads(endpoint: str, item: BatchItem, generation, tenant: str) -> list:
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
    if isinstance(body, CompletionRequest) and len(body.prompts()) != 1:
        raise ApiError(400, f"request {item.custom_id!r}: a batch request takes one prompt", param="requests")
    if isinstance(body, CompletionRequest) and (body.echo or body.prompt_logprobs is not None):
        raise ApiError(400, f"request {item.custom_id!r}: echo and prompt_logprobs run online only, not in a batch",
                       param="requests")
    try:
        prompt = body.as_prompt(generation.tool_format) if isinstance(body, ChatCompletionRequest) \
            else body.as_prompt()
        payloads = await generation.payloads(prompt, tenant)
    except ApiError as exc:
        raise ApiError(exc.status, f"request {item.custom_id!r}: {exc.message}", param="requests") from exc
    for payload in payloads:  # a batch waits its turn: it must not expire in the queue meanwhile
        payload.expires_at = None
        payload.service_tier = "flex"  # and yields to online requests, every tenant's, in the workers
    return payloads


@router.post("/v1/batches", responses=json_answer(Batch, "The batch, handed to the scheduler."))
async def create_batch(body: BatchRequest, generation: GenerationDep, store: StoreDep, arq: ArqDep,
                       tenant: TenantDep, settings: SettingsDep):
    """Check every request now (a bad one fails the call with 400), then hand the batch to the scheduler."""
    requests = body.requests if body.input_file_id is None else \
        await _file_items(body, file_store(store, settings), tenant)
    if len({i.custom_id for i in requests}) != len(requests):
        raise ApiError(400, "custom_id must be unique within a batch", param="requests")
    items = []
    for item in requests:
        payloads = await _payloads(body.endpoint, item, generation, tenant)
        payloads[0].tenant = tenant
        items.append(BatchEntry(custom_id=item.custom_id, endpoint=body.endpoint, payload=payloads[0]).encode())
    batch_id = ids.batch_id()
    record = BatchRecord.created(body.endpoint, tenant, int(time.time()), len(items), body.metadata,
                                 window=body.completion_window, input_file_id=body.input_file_id or "")
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
    key = redis_keys.batch_record(store.prefix, batch_id)
    # Another spelling of an id is no batch's: not looked up.
    record = BatchRecord.of(await store.redis.hgetall(key)) if ids.is_batch_id(batch_id) else None
    if record is None or record.tenant != tenant:
        raise ApiError(404, f"no batch {batch_id!r}", code="not_found")

    def stamp(at: float | None) -> int | None:
        return int(at) if at else None
    return {"id": batch_id, "object": "batch", "endpoint": record.endpoint, "status": record.status.value,
            "input_file_id": record.input_file_id or None, "completion_window": record.completion_window,
            "created_at": stamp(record.created_at), "in_progress_at": stamp(record.started_at),
            "expires_at": record.deadline, "completed_at": stamp(record.completed_at),
            "expired_at": stamp(record.expired_at), "output_file_id": record.output_file_id or None,
            "error_file_id": record.error_file_id or None, "errors": None,
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
