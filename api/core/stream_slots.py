"""Open SSE streams per tenant, capped over every replica.

Each open stream holds a slot: a member of its tenant's sorted set in Redis
(shared/redis_keys.tenant_streams), scored with the time its lease ends. One script
(streams_take.lua) drops lapsed leases, counts and takes at once, so replicas together never pass
the cap; past it the route answers 429 before anything is queued. The replica that holds a slot
renews its lease every third of a lease (streams_renew.lua) and frees it when the stream ends or
its client leaves (api/core/sse.py EventStreamResponse). A replica that dies renews nothing: its
slots lapse with their leases, and the set itself expires when its last lease ends, so nothing a
client sends holds a slot for ever.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from redis.asyncio import Redis

from api.core.errors import ApiError
from shared import redis_keys, scripts
from shared.redis_client import REDIS_DOWN

log = logging.getLogger(__name__)


@dataclass(eq=False)
class StreamSlot:
    """One open stream's place in its tenant's count; `owner` None: not counted (no cap)."""

    tenant: str
    id: str
    owner: StreamSlots | None = None

    async def release(self) -> None:
        """Free the slot (again: nothing); never raises: a slot Redis did not hear of lapses."""
        if self.owner is not None:
            owner, self.owner = self.owner, None
            await owner._release(self)


class StreamSlots:
    """The slots this replica holds, taken against a cap of `cap` streams per tenant (0: none)."""

    def __init__(self, redis: Redis | None, prefix: str, cap: int, lease_s: float):
        self.redis = redis
        self.prefix = prefix
        self.cap = cap
        self.lease_ms = max(1, round(lease_s * 1000))
        self._held: dict[str, set[str]] = {}  # tenant -> its slot ids held here
        self._renewer: asyncio.Task | None = None
        if cap > 0:
            self._take = scripts.register(redis, "streams_take")
            self._renew = scripts.register(redis, "streams_renew")

    async def take(self, tenant: str) -> StreamSlot:
        """A slot for one more stream of `tenant`, held (renewed) until released; 429 at the cap."""
        if self.cap <= 0:
            return StreamSlot(tenant, "")
        slot = StreamSlot(tenant, uuid.uuid4().hex, self)
        key = redis_keys.tenant_streams(self.prefix, tenant)
        if not await self._take(keys=[key], args=[slot.id, self.cap, self.lease_ms]):
            raise ApiError(429, f"tenant {tenant!r} has {self.cap} streams open, the most allowed "
                                "(max_streams_per_tenant); close one first", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        self._held.setdefault(tenant, set()).add(slot.id)
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever(), name="stream-slots-renewer")
        return slot

    @contextlib.asynccontextmanager
    async def opening(self, tenant: str) -> AsyncIterator[StreamSlot]:
        """A slot taken before a stream's request is queued, freed if the block raises; once the
        block is through, the stream's response frees it."""
        slot = await self.take(tenant)
        try:
            yield slot
        except BaseException:
            await slot.release()
            raise

    def held(self) -> int:
        """Slots held by this replica now."""
        return sum(len(ids) for ids in self._held.values())

    async def renew(self) -> int:
        """Push on the lease of every slot held here, one script call per tenant; how many were
        still held in Redis (one that lapsed while this replica stalled is not taken again)."""
        held = [(tenant, list(ids)) for tenant, ids in self._held.items()]
        counts = await asyncio.gather(*(self._renew(keys=[redis_keys.tenant_streams(self.prefix, tenant)],
                                                    args=[self.lease_ms, *ids]) for tenant, ids in held))
        return sum(counts)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                await self.renew()
            except REDIS_DOWN as exc:  # leases lapse if Redis stays away; streams go on uncounted
                log.warning("stream slots not renewed: %s", exc)
            except Exception:  # the next round tries again: a renewer that stopped would free every slot
                log.exception("stream slots not renewed")

    async def _release(self, slot: StreamSlot) -> None:
        ids = self._held.get(slot.tenant, set())
        ids.discard(slot.id)  # before Redis hears: a renewal from now on leaves it out
        if not ids:
            self._held.pop(slot.tenant, None)
        with contextlib.suppress(*REDIS_DOWN):  # not heard: it lapses with its lease
            await self.redis.zrem(redis_keys.tenant_streams(self.prefix, slot.tenant), slot.id)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
            self._renewer = None
