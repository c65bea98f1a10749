"""OpenAI's Responses API: /v1/responses, durable on any replica.

A response is one queued request and a stored record (api/openai/responses/store.py). In the foreground the
call waits for it (or streams it); with `background: true` it answers at once, queued, and the
worker runs it whoever listens. Any replica answers a retrieve, a cancel, a delete, or a stream
resumed `starting_after` a sequence number, from Redis: a stream survives a replica's kill, a
worker's (its continuation carries the same token log) and a Redis restart (the relay waits).

A stored foreground stream whose client drops goes on, to be resumed; with `store: false`
nothing is kept, and a dropped stream is cancelled.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
from typing import Annotated, Any, Literal
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Header, Query

from api.core.auth import AdmittedDep, TenantDep
from api.core.deps import ModelsDep, ReplicaDep, SettingsDep, StoreDep
from api.core.errors import ApiError
from api.core.json_body import StrictJSONRoute
from api.core.openapi import errors, json_answer, json_or_stream
from api.openai.answers import OpenAIError
from api.openai.files import file_store, owned_content
from api.openai.responses.answers import (RESPONSE_EVENTS, RESPONSE_EVENTS_EXAMPLE, InputItemList, ResponseDeleted,
                                          ResponseObject)
from api.core.relay import Relay
from api.openai.responses.events import ResponseEvents
from api.openai.responses.record import ResponseRecord, now_s, whole_seconds, with_ids
from api.openai.responses.store import ResponseStore
from api.openai.responses.schemas import ImagePart, ResponseCreate
from api.core.sse import RESPONSES, EventStreamResponse
from shared import ids
from shared.files import FileStore
from shared.messages import FinalEvent, TokenEvent

router = APIRouter(tags=["responses"], route_class=StrictJSONRoute,
                   responses=errors(OpenAIError, "OpenAI's error body."))
PATHS = ("/v1/responses",)
CANCEL_WAIT_S = 30.0  # a cancel answers once the worker has stopped (within a step), or after this


def _responses(replica: ReplicaDep) -> ResponseStore:
    return ResponseStore(replica.store, replica.settings.responses_retention_s)


ResponsesDep = Annotated[ResponseStore, Depends(_responses)]


async def _found(responses: ResponseStore, tenant: str, response_id: str) -> ResponseRecord:
    record = await responses.get(tenant, response_id)
    if record is None:  # another tenant's response is not found either
        raise ApiError(404, f"Response with id {response_id!r} not found.", param="response_id")
    return record


async def _context(responses: ResponseStore, tenant: str, body: ResponseCreate) -> list:
    """The stored conversation a `previous_response_id` continues: its context and its output."""
    if body.previous_response_id is None:
        return []
    previous = await responses.get(tenant, body.previous_response_id)
    if previous is None:
        raise ApiError(404, f"Previous response with id {body.previous_response_id!r} not found.",
                       param="previous_response_id")
    events, _ = await responses.snapshot(previous)
    if events.live:
        raise ApiError(400, f"previous response {previous.id!r} is still {events.status}; continue it once it "
                            "has finished", param="previous_response_id")
    return previous.context + events.output_items()


async def _with_files(files: FileStore, tenant: str, items: list) -> list:
    """The items with each `input_image` that names an uploaded image (`file_id`) holding its bytes
    as a data URL, read now from the tenant's files (404 on `input` for no such file of its own);
    the items stored keep the file_id."""
    out = []
    for item in items:
        parts = getattr(item, "content", None)
        if isinstance(parts, list) and any(isinstance(p, ImagePart) and p.file_id for p in parts):
            read = []
            for part in parts:
                if isinstance(part, ImagePart) and part.file_id:
                    data = await owned_content(files, tenant, part.file_id, param="input")
                    part = part.model_copy(update={"image_url": f"data:;base64,{base64.b64encode(data).decode()}"})
                read.append(part)
            item = item.model_copy(update={"content": read})
        out.append(item)
    return out


@router.post("/v1/responses", responses=json_or_stream(
    ResponseObject, "The response (finished; queued with `background: true`).", RESPONSE_EVENTS,
    RESPONSE_EVENTS_EXAMPLE))
async def create_response(body: ResponseCreate, served: ModelsDep, tenant: AdmittedDep, responses: ResponsesDep,
                          replica: ReplicaDep, store: StoreDep, settings: SettingsDep):
    generation = await served.get(body.model)
    response_id = ids.response_id()
    items = with_ids(response_id, body.input_items())
    context = await _context(responses, tenant, body) + items
    try:
        chat = body.chat_request(await _with_files(file_store(store, settings), tenant, context))
    except ValueError as exc:
        raise ApiError(400, str(exc), param="input") from exc
    try:
        prompt = chat.as_prompt(generation.tool_format)
    except ApiError as exc:  # the chat's messages are this body's input
        exc.param = "input" if exc.param == "messages" else exc.param
        raise
    if prompt.constraint_param == "response_format":  # as this API spells it
        prompt.constraint_param = "text"
    prompt.images_param = "input"
    payloads = await generation.payloads(prompt, tenant)
    payload = payloads[0]
    record = ResponseRecord(
        id=response_id, tenant=tenant, request_id=payload.id, model=generation.model_name, created_at=now_s(),
        echo={**body.echo(), "service_tier": payload.service_tier}, input_items=items, context=context,
        tools=prompt.tool_format.name if prompt.tool_format is not None else "none",
        prompt_tokens=len(payload.prompt_token_ids),
        reasoning=prompt.reasoning.key if prompt.reasoning is not None else "none")
    # A stream's slot, before anything is stored or queued: a 429 leaves nothing behind.
    async with replica.streams.opening(tenant) if body.stream else contextlib.nullcontext() as slot:
        await responses.create(record)  # before the request is queued: a retrieve right after finds it
        try:
            await generation.submit(payloads, tenant=tenant)
        except ApiError:
            await responses.delete(record)
            raise
    if body.stream:
        async def forget() -> None:  # store: false keeps nothing, and a dropped stream is not resumed
            await _discard(responses, replica.relay, record)
        return EventStreamResponse(_stream(responses, replica.relay, record, -1, keep=body.store), slot,
                                   on_disconnect=None if body.store else forget)
    if body.background:
        events = ResponseEvents(record)
        return events.response()
    async for event in replica.relay.events(record.request_id):
        if isinstance(event, FinalEvent):
            break
    events, _ = await responses.snapshot(record)
    await (responses.keep(record) if body.store else responses.delete(record))
    return events.response()


async def _stream(responses: ResponseStore, relay: Relay, record: ResponseRecord, after: int,
                  keep: bool = True) -> AsyncIterator[str]:
    """The response's events after sequence number `after`, as SSE, live to the end. Made from the
    request's events in order, from the start, so every replica numbers them the same.

    No `id:` lines (the number is in each event, as OpenAI sends it): the openai client keeps the
    last id and reads the keepalive comment after it as an event with no data."""
    events = ResponseEvents(record)

    def frames(batch: list[dict[str, Any]]) -> str:
        return "".join(RESPONSES.event(e) for e in batch if e["sequence_number"] > after)

    if head := frames(events.start()):
        yield head
    async for event in relay.events(record.request_id):
        if event is None:
            yield RESPONSES.keepalive
        elif isinstance(event, TokenEvent):
            if chunk := frames(events.token(event)):
                yield chunk
        elif isinstance(event, FinalEvent):
            request = await responses.store.record(record.request_id)
            if chunk := frames(events.final(event, whole_seconds(request.finished_at if request else None))):
                yield chunk
    await (responses.keep(record) if keep else responses.delete(record))


@router.get("/v1/responses/{response_id}", responses=json_or_stream(
    ResponseObject, "The response as it stands.", RESPONSE_EVENTS, RESPONSE_EVENTS_EXAMPLE))
async def retrieve_response(response_id: str, tenant: TenantDep, responses: ResponsesDep, replica: ReplicaDep,
                            stream: bool = False, starting_after: int | None = Query(None),
                            include_obfuscation: bool | None = None,
                            include: list[str] | None = Query(None, alias="include[]"),
                            last_event_id: str | None = Header(None)):
    """The response as it stands; with stream=true its events after `starting_after` (or the
    Last-Event-ID header), then live: on a response still running, the events after a number
    not reached yet come as they are made."""
    if include:
        raise ApiError(400, f"include values {include} are not produced by this server", param="include")
    record = await _found(responses, tenant, response_id)
    events, past = await responses.snapshot(record)
    finished = not events.live
    if not finished and await responses.store.record(record.request_id) is None:
        # Its request's record and token log are gone (expired or deleted): it would stay queued, a stream open, for ever.
        raise ApiError(404, f"Response with id {response_id!r} not found.", param="response_id")
    if not stream:
        if finished:
            await responses.keep(record)
        return events.response()
    after = _starting_after(starting_after, last_event_id)
    if after is not None and finished and after > past[-1]["sequence_number"]:
        raise ApiError(400, f"starting_after is {after}, past the response's last event "
                            f"({past[-1]['sequence_number']})", param="starting_after")
    return EventStreamResponse(_stream(responses, replica.relay, record, -1 if after is None else after),
                               await replica.streams.take(tenant))


def _starting_after(starting_after: int | None, last_event_id: str | None) -> int | None:
    if starting_after is None and last_event_id is not None:
        if not last_event_id.strip().isdigit():
            raise ApiError(400, f"Last-Event-ID {last_event_id!r} is not a sequence number", param="Last-Event-ID")
        starting_after = int(last_event_id)
    if starting_after is not None and starting_after < 0:
        raise ApiError(400, f"starting_after is {starting_after}; it must be 0 or more", param="starting_after")
    return starting_after


@router.post("/v1/responses/{response_id}/cancel",
             responses=json_answer(ResponseObject, "The response as it stands after the cancel."))
async def cancel_response(response_id: str, tenant: TenantDep, responses: ResponsesDep, replica: ReplicaDep):
    """Stops a background response (a queued one at once, a running one within a step) and
    answers it as it then stands; a finished one is answered as it is."""
    record = await _found(responses, tenant, response_id)
    if not record.echo.get("background"):
        raise ApiError(400, "only a background response can be cancelled", param="response_id")
    events, _ = await responses.snapshot(record)
    if events.live:
        await _cancel(responses, replica.relay, record)
        events, _ = await responses.snapshot(record)
    return events.response()


async def _cancel(responses: ResponseStore, relay: Relay, record: ResponseRecord) -> bool:
    """Cancel the response's request and wait for its end (a running one ends within a step);
    False if it had not ended after CANCEL_WAIT_S."""
    await responses.store.cancel(record.request_id, record.prompt_tokens)
    try:
        async with asyncio.timeout(CANCEL_WAIT_S):
            async for event in relay.events(record.request_id):
                if isinstance(event, FinalEvent):
                    return True
    except TimeoutError:
        pass
    return False


async def _discard(responses: ResponseStore, relay: Relay, record: ResponseRecord) -> None:
    """The response removed, a running one cancelled first. It is deleted once its request has
    ended, so the worker's last write cannot bring its token log back."""
    events, _ = await responses.snapshot(record)
    if events.live:
        await _cancel(responses, relay, record)
    await responses.delete(record)


@router.delete("/v1/responses/{response_id}", responses=json_answer(ResponseDeleted, "Deleted."))
async def delete_response(response_id: str, tenant: TenantDep, responses: ResponsesDep, replica: ReplicaDep):
    """Removes a stored response (a running one is cancelled first)."""
    record = await _found(responses, tenant, response_id)
    await _discard(responses, replica.relay, record)
    return {"id": record.id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items",
            responses=json_answer(InputItemList, "A page of the response's input items."))
async def input_items(response_id: str, tenant: TenantDep, responses: ResponsesDep,
                      limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
                      after: str | None = None, include: list[str] | None = Query(None, alias="include[]")):
    """This response's input items (not those of the turns it continues), newest first by default."""
    if include:
        raise ApiError(400, f"include values {include} are not produced by this server", param="include")
    record = await _found(responses, tenant, response_id)
    items = [i.model_dump(exclude_none=True) for i in record.input_items]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise ApiError(400, f"after: no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
