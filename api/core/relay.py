"""A request's events, each exactly once and in order: first from its token log, then live.

It subscribes to the request's channel BEFORE reading the log, and drops every token whose
index it has already passed, so a client resuming from any index on any replica gets
exactly the events after it. A gap in the live messages (a dropped pub/sub connection) is
filled from the log. While Redis restarts, the stream waits for it (up to hub.OUTAGE_S).
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from api.core.hub import OUTAGE_S, RESYNC, TICK, PubSubHub
from api.core.tracing import RelaySpan
from shared import redis_keys
from shared.messages import FinalEvent, StatusEvent, TokenEvent, decode_event
from shared.redis_client import until_redis_answers
from shared.store import RequestStore

log = logging.getLogger(__name__)

Event = TokenEvent | StatusEvent | FinalEvent


class Relay:
    def __init__(self, store: RequestStore, hub: PubSubHub):
        self.store = store
        self.hub = hub

    async def events(self, request_id: str, after: int = -1) -> AsyncIterator[Event | None]:
        """Events after token index `after`, ending with the final one; None means "still alive"."""
        channel = redis_keys.request_channel(self.store.prefix, request_id)
        span = RelaySpan(request_id)
        try:
            async with self.hub.subscribe(channel) as queue:
                cursor = _Cursor(self.store, request_id, after)
                for event in await cursor.catch_up():
                    span.saw(event)
                    yield event
                    if isinstance(event, FinalEvent):
                        return
                while True:
                    data = await queue.get()
                    if data == TICK:
                        yield None
                        continue
                    events = await cursor.catch_up() if data == RESYNC else await cursor.accept(decode_event(data))
                    for event in events:
                        span.saw(event)
                        yield event
                        if isinstance(event, FinalEvent):
                            return
        finally:
            span.end()


class _Cursor:
    """Tracks the last token index delivered and the last log entry read."""

    def __init__(self, store: RequestStore, request_id: str, after: int):
        self.store = store
        self.request_id = request_id
        self.last = after
        self.entry = "-"

    async def catch_up(self) -> list[Event]:
        out: list[Event] = []
        entries = await until_redis_answers(
            "catch-up", lambda: self.store.events(self.request_id, self.entry), log, OUTAGE_S)
        for entry_id, data in entries:
            self.entry = entry_id
            out += self._fresh(decode_event(data))
        return out

    async def accept(self, event: Event) -> list[Event]:
        missed = (isinstance(event, TokenEvent) and event.index > self.last + 1) or (
            isinstance(event, FinalEvent) and event.usage.completion_tokens - 1 > self.last)
        if missed:
            out = await self.catch_up()
            if any(isinstance(e, FinalEvent) for e in out):
                return out
            return out + self._fresh(event)
        return self._fresh(event)

    def _fresh(self, event: Event) -> list[Event]:
        if isinstance(event, TokenEvent):
            if event.index <= self.last:
                return []
            self.last = event.index
        return [event]
