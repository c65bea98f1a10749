"""arq on a Redis Cluster: a plain client on the master of the one slot that holds arq's keys.

arq 0.28 pins redis<6 and talks to one node through a plain client, and its MULTI/WATCH
transactions span a job's keys, the queue and its abort set. So every arq key lives in one
slot (shared/redis_keys.py, ARQ_TAG), and arq is given that slot's master as if it were a
single Redis. The master changes on a failover (the old one's connections drop) or a
resharding (it answers MOVED): the scheduler then starts a fresh arq worker on the new master
(scheduler/main.py), and the api's enqueue finds it and tries once more (ArqPool).

On one Redis (redis://, rediss://, unix://) none of this applies: arq runs as it always did.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.jobs import Job
from redis.asyncio import Redis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from shared.redis_client import REDIS_DOWN, ClusterUrl, arq_settings, parse_cluster_url

log = logging.getLogger(__name__)

# The answers of a cluster node about a slot it does not serve (now): a plain client sees them
# as ResponseError, alone or inside a pipeline's error ("... caused error: MOVED 6503 host:port").
_NOT_HERE = re.compile(r"(^|error: )(MOVED|ASK|CLUSTERDOWN|TRYAGAIN) ")
RESOLVE_TIMEOUT_S = 2.0  # a node that does not answer CLUSTER SLOTS within this is skipped


def slot_lost(exc: BaseException) -> bool:
    """Whether `exc` says the node arq talks to no longer serves arq's slot: its connection
    dropped (a failover) or it answered MOVED, ASK, CLUSTERDOWN or TRYAGAIN."""
    return isinstance(exc, REDIS_DOWN) or (isinstance(exc, ResponseError) and bool(_NOT_HERE.search(str(exc))))


class ArqSlot:
    """Finds the master that serves `key`'s slot now, asking the nodes the cluster last listed
    and then the URL's seeds (any of which may be the master that just died)."""

    def __init__(self, url: ClusterUrl, key: str):
        self.url, self.key, self.slot = url, key, key_slot(key.encode())
        self._known: list[tuple[str, int]] = []

    async def master(self) -> tuple[str, int]:
        """(host, port) of the slot's master; ConnectionError if no node answers with one."""
        error: Exception = RedisConnectionError(f"no node of {self.url.nodes} answered")
        for host, port in dict.fromkeys([*self._known, *self.url.nodes]):
            client = Redis.from_url(self.url.node_url(host, port), decode_responses=True,
                                    socket_connect_timeout=RESOLVE_TIMEOUT_S, socket_timeout=RESOLVE_TIMEOUT_S)
            try:
                ranges = await client.execute_command("CLUSTER", "SLOTS")
            except (*REDIS_DOWN, OSError, ResponseError) as exc:
                error = exc
                continue
            finally:
                await client.aclose()
            self._known = [(node[0] or host, int(node[1])) for _, _, *nodes in ranges for node in nodes]
            for start, end, master, *_ in ranges:
                if int(start) <= self.slot <= int(end):
                    return master[0] or host, int(master[1])  # "" or "?": the node we asked
            error = RedisConnectionError(f"no master serves slot {self.slot} now (a failover under way)")
        raise RedisConnectionError(f"cannot find the master of slot {self.slot}: {error}") from error

    async def pool(self, queue_name: str) -> ArqRedis:
        """An arq pool on the slot's master, checked to serve the slot (a node's view of the
        cluster can lag a failover); ConnectionError if it does not, so callers back off and
        ask again."""
        host, port = await self.master()
        settings = arq_settings(self.url.node_url(host, port))
        settings.conn_retries = 0  # a dead master: ask the cluster again, not the same node 5 times
        pool = await create_pool(settings, default_queue_name=queue_name)
        try:
            await pool.exists(queue_name)
        except (*REDIS_DOWN, ResponseError) as exc:
            await _close_quietly(pool)
            if not slot_lost(exc):
                raise
            raise RedisConnectionError(f"{host}:{port} does not serve slot {self.slot} ({exc})") from exc
        log.info("arq's slot %d is served by %s:%d", self.slot, host, port)
        return pool


class ArqPool:
    """The api's arq pool on a cluster: enqueues on the master of arq's slot, found at the first
    enqueue and again, for one more try, when that master is lost (a failover). A job with an
    id (a batch's) is enqueued at most once across the two tries: arq skips an id it has."""

    def __init__(self, slot: ArqSlot, queue_name: str):
        self._slot, self._queue_name = slot, queue_name
        self._pool: ArqRedis | None = None
        self._lock = asyncio.Lock()

    async def enqueue_job(self, function: str, *args: Any, **kwargs: Any) -> Job | None:
        for attempt in (1, 2):
            try:
                async with self._lock:
                    if self._pool is None:
                        self._pool = await self._slot.pool(self._queue_name)
                    pool = self._pool
                return await pool.enqueue_job(function, *args, **kwargs)
            except (*REDIS_DOWN, ResponseError) as exc:
                if not slot_lost(exc):
                    raise
                await self._drop()
                if attempt == 2:
                    raise RedisConnectionError(f"arq's slot has no reachable master ({exc})") from exc
                log.warning("arq's slot moved (%s); enqueuing on its new master", exc)
        raise AssertionError("unreachable")

    async def _drop(self) -> None:
        async with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            await _close_quietly(pool)

    async def aclose(self) -> None:
        await self._drop()


async def _close_quietly(pool: ArqRedis) -> None:
    with contextlib.suppress(*REDIS_DOWN, OSError):
        await pool.aclose()


async def arq_pool(url: str, queue_name: str) -> ArqRedis | ArqPool:
    """The api's arq pool: arq's own on one Redis, as ever; one that follows the slot of
    `queue_name` on a cluster (connected at its first enqueue, so a cluster mid-failover does
    not stop the api from starting)."""
    cluster = parse_cluster_url(url)
    if cluster is None:
        return await create_pool(arq_settings(url))
    return ArqPool(ArqSlot(cluster, queue_name), queue_name)


def redis_settings(url: str) -> RedisSettings | None:
    """arq's settings for a single Redis; None on a cluster, where the scheduler hands its arq
    worker a pool on the slot's master instead (scheduler/main.py)."""
    return None if parse_cluster_url(url) else arq_settings(url)
