"""Server-Sent Events: how every event the api streams is written, and the response that sends them.

Every SSE byte the api writes is framed here: `frame` (one event; `id:` is the token index a
client resumes after with Last-Event-ID), `KEEPALIVE` (a comment, sent on the hub's tick: clients
ignore it, proxies and idle timeouts see traffic) and `DONE` (the OpenAI endpoints' last event).
Each protocol writes through its `SseDialect` (whether events are named by their type, what a
quiet stream sends, what ends a stream): OPENAI, RESPONSES, ANTHROPIC, NATIVE.

Ours rather than sse-starlette's because it costs the replica less per event, measured with
benchmarks/relay.py (interleaved runs, medians; docs/benchmarks.md "SSE: this module or
sse-starlette"): with sse-starlette 3.7 (frames and response) the replica spent 52 µs of CPU per
relayed event against 39 µs (+32 %); offered more than a replica relays here (--rate 30), it
relayed 5 % fewer events/s with p50 126 ms against 49 ms and p99 3.3 s against 0.27 s. Its
response alone, carrying these frames, still cost +21 %: it opens a cancel scope around every
send (its send timeout) and a shutdown-watching task per stream, and patches uvicorn's exit
handler at import.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from api.core.stream_slots import StreamSlot


def frame(data: str, event: str | None = None, event_id: int | None = None) -> str:
    """One event; `data` must be one line (JSON is). `event_id` is what a client resumes from (Last-Event-ID)."""
    head = "" if event_id is None else f"id: {event_id}\n"
    if event is not None:
        head += f"event: {event}\n"
    return f"{head}data: {data}\n\n"


def json_frame(data: object, event: str | None = None, event_id: int | None = None) -> str:
    """One event whose data is `data` as JSON (non-ASCII text as it is)."""
    return frame(json.dumps(data, ensure_ascii=False), event, event_id)


KEEPALIVE = ": keepalive\n\n"
DONE = frame("[DONE]")


@dataclass(frozen=True)
class SseDialect:
    """How one protocol writes its events."""

    named: bool  # each event's `event:` line is its data's "type" (or the name given)
    keepalive: str  # what a quiet stream sends on the hub's tick
    last: str | None = None  # the stream's last event, if the protocol has one

    def event(self, data: object, name: str | None = None, event_id: int | None = None) -> str:
        """One event whose data is `data` as JSON."""
        if name is None and self.named and isinstance(data, dict):
            name = data.get("type")
        return json_frame(data, name, event_id)


# OpenAI's chat and completion chunks: unnamed, ended by [DONE].
OPENAI = SseDialect(named=False, keepalive=KEEPALIVE, last=DONE)
# The Responses API's events, named by their type (the sequence number is in each, no `id:`).
RESPONSES = SseDialect(named=True, keepalive=KEEPALIVE)
# Anthropic's Messages events, named by their type; a quiet stream pings.
ANTHROPIC = SseDialect(named=True, keepalive=json_frame({"type": "ping"}, "ping"))
# streamq's own: token (with `id:`, the index to resume after), status and final events; the
# seed tutorial's unnamed token events.
NATIVE = SseDialect(named=False, keepalive=KEEPALIVE)


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStreamResponse(Response):
    """Streams `events` in the tenant's stream slot (api/core/stream_slots.py), freed when the stream
    ends or its client leaves; if the client disconnects first, awaits `on_disconnect` (shielded)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], slot: StreamSlot,
                 on_disconnect: Callable[[], Awaitable[None]] | None = None, headers: dict[str, str] | None = None):
        # Not Response.__init__: it would render an empty body and send Content-Length: 0.
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})
        self.events = events
        self.slot = slot
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        metrics = getattr(scope["app"].state, "metrics", None)
        if metrics is not None:
            metrics.open_streams.inc()

        async def stream(cancel: anyio.CancelScope) -> None:
            nonlocal disconnected
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client went away while we wrote
                disconnected = True
            cancel.cancel()

        async def watch(cancel: anyio.CancelScope) -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            cancel.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(stream, group.cancel_scope)
                group.start_soon(watch, group.cancel_scope)
        finally:
            if metrics is not None:
                metrics.open_streams.dec()
            with anyio.CancelScope(shield=True):
                await self.slot.release()
                await self.events.aclose()
                if disconnected and self.on_disconnect is not None:
                    await self.on_disconnect()
