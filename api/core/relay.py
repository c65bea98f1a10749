"""A request's events, each exactly once and in order: first from its token log, then live.

It subscribes to the request's channel BEFORE reading the log, and drops every token whose
index it has already passed, so a client resuming from any index on any replica gets
exactly the events after it. A gap in the live messages (a dropped pub/sub connection) is
filled from the log. While Redis restarts, the stream waits for it (up to hub.OUTAGE_S).

A stream that has seen no event for `idle_s` reads the log again and then the request's record: a
record that says the request ended gives its final event (where the log's was lost, e.g. with a
Redis master that failed over before it replicated it), and a record that is gone ends the stream
with an error; a request still queued or running is waited for. So no stream waits for ever on a
final event that will never come.
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from api.core.hub import OUTAGE_S, RESYNC, TICK, PubSubHub
from api.core.tracing import RelaySpan
from shared import redis_keys
from shared.messages import FinalEvent, FinishReason, RequestStatus, StatusEvent, TokenEvent, Usage, decode_event
from shared.redis_client import until_redis_answers
from shared.store import RequestStore

log = logging.getLogger(__name__)

Event = TokenEvent | StatusEvent | FinalEvent


# A stream's default idle deadline (ApiSettings.relay_idle_s).
IDLE_S = 30.0


class Relay:
    def __init__(self, store: RequestStore, hub: PubSubHub, idle_s: float = IDLE_S):
        self.store = store
        self.hub = hub
        self.idle_s = idle_s

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
                heard = time.monotonic()
                while True:
                    data = await queue.get()
                    if data == TICK and time.monotonic() - heard < self.idle_s:
                        yield None
                        continue
                    if data == TICK:  # quiet for idle_s: what do the log and the record say?
                        events = await cursor.catch_up() or await cursor.settled()
                        if not events:
                            yield None
                    else:
                        events = await cursor.catch_up() if data == RESYNC else \
                            await cursor.accept(decode_event(data))
                    heard = time.monotonic()
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

    async def settled(self) -> list[Event]:
        """The final event the request's record gives, where the record says it ended or is gone
        (its log holding none); nothing while it is queued or running."""
        record = await until_redis_answers("record", lambda: self.store.record(self.request_id), log, OUTAGE_S)
        if record is None:
            log.warning("request %s: its record is gone and its log has no final event; the stream ends",
                        self.request_id)
            return [FinalEvent(status=RequestStatus.FAILED, finish_reason=FinishReason.ERROR,
                               usage=Usage(prompt_tokens=0, completion_tokens=0),
                               error="the request's record is gone (expired, or lost with a Redis failover)")]
        if not record.status.finished:
            return []
        log.warning("request %s ended (%s) but its log has no final event; the stream ends with the record's",
                    self.request_id, record.status.value)
        return [FinalEvent(status=record.status, finish_reason=record.finish_reason or FinishReason.ERROR,
                           usage=Usage(prompt_tokens=record.prompt_tokens,
                                       completion_tokens=record.completion_tokens or 0,
                                       cached_tokens=min(record.reused_tokens or 0, record.prompt_tokens)),
                           error=record.error)]

    def _fresh(self, event: Event) -> list[Event]:
        if isinstance(event, TokenEvent):
            if event.index <= self.last:
                return []
            self.last = event.index
        return [event]
