"""A Server-Sent Events response that notices a client leaving, even while nothing is sent."""
from __future__ import annotations

import json
from typing import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


def sse_event(data: object, event: str | None = None, event_id: int | None = None) -> str:
    """One SSE event; `data` is sent as JSON on one line."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.append("data: " + (data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)))
    return "\n".join(lines) + "\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStreamResponse(Response):
    """Streams `events`; if the client disconnects first, awaits `on_disconnect` (shielded)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_disconnect: Callable[[], Awaitable[None]] | None = None,
                 headers: dict[str, str] | None = None):
        # Not Response.__init__: it would render an empty body and send Content-Length: 0.
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})
        self.events = events
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
                await self.events.aclose()
                if disconnected and self.on_disconnect is not None:
                    await self.on_disconnect()
