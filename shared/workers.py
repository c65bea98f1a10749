"""The live workers, as their heartbeats describe them (model, backend, capacity, load, KV)."""
from __future__ import annotations

import json

from redis.asyncio import Redis

from shared import redis_keys


async def live_workers(redis: Redis, prefix: str) -> list[dict]:
    """Every worker whose heartbeat has not expired."""
    workers = []
    async for key in redis.scan_iter(match=redis_keys.worker_heartbeat_pattern(prefix), count=100):
        if (beat := await redis.get(key)) is not None:
            workers.append(json.loads(beat))
    return workers
