"""Periodic jobs. Each is safe to run twice, and by several schedulers at once."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pydantic import ValidationError
from redis.asyncio import Redis

from shared import redis_keys
from shared.messages import FINISHED, KeptResponse, RequestPayload, RequestStatus, now
from shared.queue import RequestQueue, queued_models
from shared.request_record import RecordField
from shared.store import RequestStore

log = logging.getLogger(__name__)


@dataclass
class ModelQueues:
    """The models whose queues the jobs tend: every model with a request queue (the api makes one at
    a model's first request; it outlives that model's workers), and the scheduler's own. The queues
    are found by a SCAN of the keyspace, so at most once every `rescan_s` seconds."""

    own: str
    rescan_s: float
    found: set[str] = field(default_factory=set)
    next_scan: float = 0.0

    async def models(self, redis: Redis, prefix: str) -> list[str]:
        if time.monotonic() >= self.next_scan:
            self.found = await queued_models(redis, prefix)
            self.next_scan = time.monotonic() + self.rescan_s
        return sorted(self.found | {self.own})


async def trim_request_stream(redis: Redis, prefix: str, model: str) -> int:
    """Drop request-stream entries that every worker is done with, in every lane; return how many went.

    An entry is kept while it is unread (after the group's last-delivered id) or pending (read,
    not yet acked: its request may still need reclaiming). Everything older than both goes.
    """
    queue = RequestQueue(redis, prefix, model)
    return sum([await _trim(queue, stream) for stream in await queue.streams()])


async def _trim(queue: RequestQueue, stream: str) -> int:
    redis = queue.redis
    group = await queue.worker_group(stream)
    if group is None:  # no such stream or group yet
        return 0
    floor = group["last-delivered-id"]
    pending = await redis.xpending(stream, redis_keys.WORKER_GROUP)
    if pending["pending"]:
        floor = min(floor, pending["min"], key=_entry_order)
    if floor == "0-0":
        return 0
    removed = await redis.xtrim(stream, minid=floor, approximate=False)
    if removed:
        log.info("trimmed %d finished entries from %s", removed, stream)
    return removed


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def expire_waiting(redis: Redis, prefix: str, model: str) -> int:
    """Expire queued requests that no worker has taken by their deadline; returns how many.

    Only entries not yet delivered to a worker are looked at (a worker expires what it reads
    itself). The entry stays in the stream: the worker that reads it later finds it expired.
    """
    store = RequestStore(redis, prefix)
    expired, stamp = 0, now()
    queue = RequestQueue(redis, prefix, model)
    for stream in await queue.streams():
        group = await queue.worker_group(stream)  # None: nothing read yet (or no stream: no entries)
        start = f"({group['last-delivered-id']}" if group else "-"
        for _entry_id, fields in await redis.xrange(stream, min=start, count=10_000):
            try:
                payload = RequestPayload.model_validate_json(fields.get("payload", ""))
            except ValidationError:
                continue
            if payload.expires_at is not None and stamp > payload.expires_at and await store.expire(payload):
                expired += 1
    if expired:
        log.warning("expired %d requests that waited past their queue timeout", expired)
    return expired


async def keep_responses(redis: Redis, prefix: str, batch: int = 500) -> int:
    """Stored responses kept longer than a request's result (shared/redis_keys.kept_responses):
    each one whose request has ended gets its request's record and token log kept until the
    response expires, and leaves the set; one already gone leaves it too. Returns how many were kept."""
    store, key, kept = RequestStore(redis, prefix), redis_keys.kept_responses(prefix), 0
    for member in await redis.zrange(key, 0, batch - 1):
        entry = KeptResponse.decode(member)
        left = await redis.ttl(redis_keys.response_record(prefix, entry.tenant, entry.response_id))
        if left > 0:
            status = await redis.hget(redis_keys.request_record(prefix, entry.request_id), RecordField.STATUS)
            if status is not None and RequestStatus(status) not in FINISHED:
                continue  # still queued or running: looked at again next time
            await store.keep_result(entry.request_id, left)
            kept += 1
        await redis.zrem(key, member)
    return kept
