"""The live workers, as their heartbeats describe them (shared/heartbeat.py)."""
from __future__ import annotations

import logging

from pydantic import ValidationError
from redis.asyncio import Redis

from shared import redis_keys
from shared.heartbeat import Heartbeat
from shared.messages import UnknownVersion

log = logging.getLogger(__name__)


async def live_workers(redis: Redis, prefix: str) -> list[Heartbeat]:
    """Every worker whose heartbeat has not expired. A heartbeat this process cannot read (a newer
    worker's version, or malformed) is left out, with a warning naming its key and why: that
    worker is not counted here until this process is upgraded."""
    workers = []
    async for key in redis.scan_iter(match=redis_keys.worker_heartbeat_pattern(prefix), count=100):
        if (beat := await redis.get(key)) is not None and (read := read_heartbeat(key, beat)) is not None:
            workers.append(read)
    return workers


def read_heartbeat(key: str, data: str | bytes) -> Heartbeat | None:
    """The heartbeat at `key`; None, with a warning, where it is of another version or malformed."""
    try:
        return Heartbeat.decode(data)
    except (UnknownVersion, ValidationError) as exc:
        log.warning("heartbeat %s left out: %s", key, exc)
        return None
