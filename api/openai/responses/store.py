"""Stored responses of the Responses API, and their events made from the request's token log.

A response is one queued request (api/core/generation.py) and a record beside it: the request's
settings as the response object repeats them, its input items, the conversation it continues
(for a later `previous_response_id`), its tool format. Its status, output, usage and streaming
events are not stored: they are made from the request's record and token log, which every
replica reads (shared/store.py). `ResponseEvents` is a pure function of the token sequence, so
the events of a response are numbered the same on every replica, after any failover, and a
client resumes a stream `starting_after` any sequence number anywhere.

Keys: the record lies under its tenant (shared/redis_keys.response_record), so another tenant's
id is simply not found. It expires `retention_s` after its creation; the request's record and
token log are kept at least as long (`keep`).
"""
from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from api.openai.responses.events import ResponseEvents
from api.openai.responses.record import LIVE_STATUS, ResponseRecord, whole_seconds
from shared import ids
from shared import redis_keys
from shared.messages import FinalEvent, KeptResponse, TokenEvent, decode_event
from shared.request_record import RequestRecord
from shared.store import RequestStore


class ResponseStore:
    """Response records of one key prefix, under their tenant."""

    def __init__(self, store: RequestStore, retention_s: int):
        self.store = store
        self.redis: Redis = store.redis
        self.prefix = store.prefix
        self.retention_s = retention_s

    def _key(self, tenant: str, response_id: str) -> str:
        return redis_keys.response_record(self.prefix, tenant, response_id)

    async def create(self, record: ResponseRecord) -> None:
        """The record, expiring after the retention; kept longer than a request's result, it is
        also put where the scheduler finds it to keep the request as long (keep_responses)."""
        key = self._key(record.tenant, record.id)
        async with self.redis.pipeline(transaction=False) as pipe:  # two slots on a Redis Cluster
            pipe.hset(key, mapping=record.fields())
            pipe.expire(key, self.retention_s)
            if self.retention_s > redis_keys.RESULT_TTL_S:
                member = KeptResponse(tenant=record.tenant, response_id=record.id, request_id=record.request_id).encode()
                pipe.zadd(redis_keys.kept_responses(self.prefix), {member: record.created_at})
            await pipe.execute()

    async def get(self, tenant: str, response_id: str) -> ResponseRecord | None:
        if not ids.is_response_id(response_id):  # another spelling of an id is no response's
            return None
        fields = await self.redis.hgetall(self._key(tenant, response_id))
        return ResponseRecord.of(response_id, tenant, fields) if fields else None

    async def delete(self, record: ResponseRecord) -> None:
        """The response and its request's record and token log."""
        async with self.redis.pipeline(transaction=False) as pipe:  # three slots on a Redis Cluster
            pipe.delete(self._key(record.tenant, record.id))
            pipe.delete(redis_keys.request_record(self.prefix, record.request_id))
            pipe.delete(redis_keys.token_log(self.prefix, record.request_id))
            await pipe.execute()

    async def keep(self, record: ResponseRecord) -> None:
        """The finished request's record and token log kept as long as the response (its end
        set them to expire RESULT_TTL_S later)."""
        await self.store.keep_result(record.request_id, await self.redis.ttl(self._key(record.tenant, record.id)))

    async def logged(self, record: ResponseRecord
                     ) -> tuple[RequestRecord | None, list[TokenEvent], FinalEvent | None]:
        """The request's record (None once it is gone), its tokens by index and its final event, as
        logged so far."""
        request = await self.store.record(record.request_id)
        tokens: dict[int, TokenEvent] = {}
        final = None
        for _, data in await self.store.events(record.request_id):
            event = decode_event(data)
            if isinstance(event, TokenEvent):
                tokens.setdefault(event.index, event)
            elif isinstance(event, FinalEvent):
                final = event
                break
        return request, [tokens[i] for i in sorted(tokens)], final

    async def snapshot(self, record: ResponseRecord) -> tuple[ResponseEvents, list[dict[str, Any]]]:
        """The response as it stands, and every event it has had so far."""
        request, tokens, final = await self.logged(record)
        events = ResponseEvents(record)
        out = events.start()
        for token in tokens:
            out += events.token(token)
        if final is not None:
            out += events.final(final, whole_seconds(request.finished_at if request else None))
        elif request is not None and request.status in LIVE_STATUS:
            events.status = LIVE_STATUS[request.status]
        return events, out
