"""The requests of dead workers, put back: run by the scheduler's cron, and at its heartbeat by
any worker with a free slot (so a takeover waits for the heartbeat's TTL and at most one beat,
not for the next cron tick). Safe to run anywhere at once: XCLAIM's min-idle-time makes each
take atomic, and shared/requeue.py's steps let only the first acker queue the entry again."""
from __future__ import annotations

import logging

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import redis_keys
from shared.queue import RequestQueue
from shared.requeue import Requeue

log = logging.getLogger(__name__)


async def reclaim_dead_workers(redis: Redis, prefix: str, model: str, heartbeat_ttl_s: float,
                               max_attempts: int) -> dict[str, int]:
    """Put back the requests of workers whose heartbeat expired; returns counts by outcome.

    An entry is taken only if it has been pending longer than the heartbeat TTL on a consumer
    with no heartbeat (XCLAIM's min-idle-time makes the take atomic). It is queued again with
    status `queued`, and the next worker continues it after the tokens already in its log. A
    request that took down `max_attempts` workers goes to the dead-letter stream and fails.
    Every lane is looked at; a request goes back to its own lane, in the two one-slot steps of
    shared/requeue.py.
    """
    requeue = Requeue(redis, prefix, max_attempts)
    outcomes: dict[str, int] = {}
    for stream in await RequestQueue(redis, prefix, model).streams():
        for outcome, count in (await _reclaim(redis, requeue, prefix, stream, heartbeat_ttl_s)).items():
            outcomes[outcome] = outcomes.get(outcome, 0) + count
    return outcomes


async def _reclaim(redis: Redis, requeue: Requeue, prefix: str, stream: str, heartbeat_ttl_s: float
                   ) -> dict[str, int]:
    try:
        consumers = await redis.xinfo_consumers(stream, redis_keys.WORKER_GROUP)
    except ResponseError:  # no stream or group yet
        return {}
    ttl_ms = int(heartbeat_ttl_s * 1000)
    outcomes: dict[str, int] = {}
    for consumer in consumers:
        name = consumer["name"]
        if not consumer["pending"] or await redis.exists(redis_keys.worker_heartbeat(prefix, name)):
            continue
        pending = await redis.xpending_range(stream, redis_keys.WORKER_GROUP, min="-", max="+", count=1000,
                                             consumername=name)
        ids = [p["message_id"] for p in pending if p["time_since_delivered"] >= ttl_ms]
        if not ids:
            continue
        for entry_id, fields in await redis.xclaim(stream, redis_keys.WORKER_GROUP, redis_keys.RECLAIMER, ttl_ms, ids):
            outcome = await requeue(stream, entry_id, fields)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            log.warning("request entry %s of dead worker %s: %s", entry_id, name, outcome)
        # Deleting a consumer drops its pending entries: only once none is left. An entry the
        # worker read within the TTL before it died is still pending; the next round takes it.
        left = await redis.xpending_range(stream, redis_keys.WORKER_GROUP, min="-", max="+", count=1,
                                          consumername=name)
        if name != redis_keys.RECLAIMER and not left:
            await redis.xgroup_delconsumer(stream, redis_keys.WORKER_GROUP, name)
    return outcomes
