"""The native api: submit, poll (with long-poll), stream (SSE, resumable) and cancel."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, status
from fastapi.responses import JSONResponse

from api.core.auth import AdmittedDep, TenantDep
from api.core.generation import Prompt
from api.core.deps import (
    HubDep,
    ModelsDep,
    RelayDep,
    SettingsDep,
    StoreDep,
    StreamsDep,
)
from api.core.hub import TICK
from api.core.json_body import StrictJSONRoute
from api.core.relay import Event, Relay
from api.core.openapi import Detail, event_stream, json_answer, stream_answer
from api.native.answers import REQUEST_EVENTS, REQUEST_EVENTS_EXAMPLE, Cancelled, RequestState, Submitted
from api.native.schemas import SubmitRequest
from api.core.sse import NATIVE, EventStreamResponse, frame
from shared import ids
from shared import redis_keys
from shared.messages import RequestStatus, StatusEvent, TokenEvent
from shared.request_record import RequestRecord
from shared.store import RequestStore

router = APIRouter(prefix="/v1/requests", tags=["requests"], route_class=StrictJSONRoute,
                   responses={404: {"model": Detail, "description": "No such request (or another tenant's)."}})


def _links(request_id: str) -> dict[str, str]:
    base = f"/v1/requests/{request_id}"
    return {"self": base, "events": f"{base}/events", "cancel": base}


@router.post("", status_code=status.HTTP_202_ACCEPTED, responses={
    **json_answer(Submitted, "Queued: its id and links.", status.HTTP_202_ACCEPTED),
    200: {"description": "With `stream: true`: its events.",
          "content": event_stream(REQUEST_EVENTS, REQUEST_EVENTS_EXAMPLE)}})
async def submit(body: SubmitRequest, served: ModelsDep, relay: RelayDep, tenant: AdmittedDep, streams: StreamsDep):
    """Queue a request. Answers 202 once it is in Redis; with `stream: true`, streams it instead."""
    generation = await served.get(body.model)
    messages = [m.model_dump() for m in body.messages] if body.messages is not None else None
    [payload] = await generation.payloads(Prompt(None, [body.sampling()], messages=messages, text=body.prompt,
                                                 priority=body.priority, backend=body.backend,
                                                 service_tier=body.service_tier), tenant)
    # A stream's slot, before its request is queued: a 429 leaves nothing behind.
    async with streams.opening(tenant) if body.stream else contextlib.nullcontext() as slot:
        await generation.submit([payload], tenant=tenant)
    if body.stream:
        return EventStreamResponse(_sse(relay, payload.id, -1), slot,
                                   on_disconnect=lambda: generation.cancel([payload]),
                                   headers={"X-Request-Id": payload.id})
    return JSONResponse(
        status_code=status.HTTP_202_ACCEPTED,
        headers={"Location": f"/v1/requests/{payload.id}"},
        content={"id": payload.id, "status": RequestStatus.QUEUED.value, "model": generation.model_name,
                 "prompt_tokens": len(payload.prompt_token_ids), "max_tokens": payload.params.max_tokens,
                 "links": _links(payload.id)},
    )


async def _record(store: RequestStore, request_id: str, tenant: str) -> RequestRecord:
    """The request's record, if it exists and belongs to `tenant`; 404 alike otherwise (an id in
    another spelling than ids.request_id's is no request's)."""
    record = await store.record(request_id) if ids.is_request_id(request_id) else None
    if record is None or record.tenant != tenant:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no request {request_id!r}")
    return record


async def snapshot(store: RequestStore, request_id: str, record: RequestRecord | None) -> dict[str, Any]:
    if record is None:  # it expired (or was deleted) since it was first read
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no request {request_id!r}")
    tokens = await store.output(request_id)
    created, started, first = record.created_at, record.started_at, record.first_token_at
    finished, scheduled = record.finished_at, record.scheduled_at
    return {
        "id": request_id,
        "status": record.status.value,
        "model": record.model,
        "text": "".join(t.text for t in tokens),
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": len(tokens),
        "finish_reason": record.finish_reason.value if record.finish_reason else None,
        "error": record.error,
        "worker": record.worker,
        "timings": {
            "created_at": created,
            "queue_s": started - created if started and created else None,  # until a worker claimed it
            # until its first step (the worker may hold a claimed request until a slot frees)
            "scheduled_s": scheduled - created if scheduled and created else None,
            "ttft_s": first - created if first and created else None,
            "total_s": finished - created if finished and created else None,
        },
        "links": _links(request_id),
    }


@router.get("/{request_id}", responses=json_answer(RequestState, "The request as it stands."))
async def poll(request_id: str, store: StoreDep, hub: HubDep, settings: SettingsDep, tenant: TenantDep,
               wait: Annotated[float, Query(ge=0, description="Seconds to wait for a change (long-poll).")] = 0):
    """Status, text so far, token counts, finish reason and timings.

    With `?wait=N`, answers when something changes after the call arrived (a new status, new
    tokens, the end), or after N seconds with the state unchanged.
    """
    if wait > settings.max_wait_s:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY,
                            f"wait={wait} is more than the server's limit of {settings.max_wait_s} s")
    before = await snapshot(store, request_id, await _record(store, request_id, tenant))
    if not wait or RequestStatus(before["status"]).finished:
        return before
    async with hub.subscribe(redis_keys.request_channel(store.prefix, request_id)) as queue:
        # Read again after subscribing, so a change in between is not waited for.
        now = await snapshot(store, request_id, await store.record(request_id))
        if (now["status"], now["completion_tokens"]) != (before["status"], before["completion_tokens"]):
            return now
        try:
            async with asyncio.timeout(wait):
                while await queue.get() == TICK:  # keepalive ticks are no change
                    pass
        except TimeoutError:
            return now
    return await snapshot(store, request_id, await store.record(request_id))


def _format(event: Event | None) -> str:
    if event is None:
        return NATIVE.keepalive
    if isinstance(event, TokenEvent):
        if event.logprob is None:  # the hot path: one per token per stream, so no model_dump
            data = (f'{{"index": {event.index}, "token_id": {event.token_id}, '
                    f'"text": {json.dumps(event.text, ensure_ascii=False)}}}')
            return frame(data, "token", event.index)
        return NATIVE.event(event.model_dump(exclude={"type"}, exclude_none=True), "token", event.index)
    if isinstance(event, StatusEvent):
        return NATIVE.event(event.model_dump(mode="json", exclude={"type"}), "status")
    # A pooling request's values are in its final event only where it has them (embeddings, rerank).
    return NATIVE.event(event.model_dump(mode="json", exclude={"type"} if event.pooled else {"type", "pooled"}), "final")


async def _sse(relay: Relay, request_id: str, after: int):
    async for event in relay.events(request_id, after):
        yield _format(event)


@router.get("/{request_id}/events", response_class=EventStreamResponse, status_code=status.HTTP_200_OK,
            responses=stream_answer(REQUEST_EVENTS, REQUEST_EVENTS_EXAMPLE))
async def events(request_id: str, store: StoreDep, relay: RelayDep, tenant: TenantDep, streams: StreamsDep,
                 last_event_id: Annotated[int | None, Header(ge=-1)] = None):
    """SSE: one `token` event per token (`id:` is its index), then one `final` event.

    Send `Last-Event-ID` to resume after that index. Leaving this stream does not cancel
    the request (it was submitted to run detached).
    """
    await _record(store, request_id, tenant)
    return EventStreamResponse(_sse(relay, request_id, -1 if last_event_id is None else last_event_id),
                               await streams.take(tenant))


@router.delete("/{request_id}", responses={
    **json_answer(Cancelled, "Cancelled, or being cancelled."),
    409: {"model": Detail, "description": "The request has already ended."}})
async def cancel(request_id: str, store: StoreDep, tenant: TenantDep):
    """Cancel a queued or running request; a running one stops within one step."""
    record = await _record(store, request_id, tenant)
    before = await store.cancel(request_id, record.prompt_tokens)
    if before is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no request {request_id!r}")
    if before.finished:
        raise HTTPException(status.HTTP_409_CONFLICT, f"request {request_id} already ended: {before.value}")
    return {"id": request_id, "status": RequestStatus.CANCELLED.value if before == RequestStatus.QUEUED else "cancelling"}
