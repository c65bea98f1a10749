"""A model's request queue: one Redis stream per lane, a lane being a tenant and a priority
(and, for a request only one backend may run, that backend: `@vllm/0:acme`; for a request that
one worker should run, as it holds the KV blocks of its prompt's prefix, that worker's affinity
lane: `^worker-1/0:acme`, or `@vllm/^worker-1/0:acme`).

The api writes each request to its lane's stream (with the record, in one script); workers
take their share of all lanes in one script (worker/service/intake.py) and the batcher chooses between
them (worker/engine/fair_queue.py). A new lane rings a doorbell stream so waiting workers start
reading it at once. Everything that looks at the backlog (backpressure, the scheduler) goes
over all lanes through this class.
"""
from __future__ import annotations

from collections.abc import Iterable

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import redis_keys, scripts, service_tier
from shared.messages import RequestPayload

ANONYMOUS = "-"  # the lane's tenant part when auth is off

def lane_of(payload: RequestPayload) -> str:
    """`<priority>:<tenant>` (`p` or `f` before the priority for a `priority` or `flex` service tier), after `^<worker>/` when a worker holds the request's prefix, after
    `@<backend>/` when the request needs one backend; the priority before the tenant, so a tenant
    name may contain ':' (backend and worker names have no '/')."""
    lane = f"{service_tier.lane_mark(payload.service_tier)}{payload.priority}:{payload.tenant or ANONYMOUS}"
    if payload.affinity:
        lane = f"^{payload.affinity}/{lane}"
    return f"@{payload.backend}/{lane}" if payload.backend else lane


def affinity_of(lane: str) -> str | None:
    """The worker whose affinity lane this is (None: an unmarked lane, any worker's)."""
    if lane.startswith("@"):
        lane = lane.partition("/")[2]
    return lane[1:].partition("/")[0] if lane.startswith("^") else None


def served_by(lane: str, backend: str) -> bool:
    """Whether a worker of `backend` reads this lane: untargeted lanes, and its own."""
    return not lane.startswith("@") or lane.startswith(f"@{backend}/")


class RequestQueue:
    def __init__(self, redis: Redis, prefix: str, model: str):
        self.redis = redis
        self.prefix = prefix
        self.model = model
        self.lanes_key = redis_keys.request_lanes(prefix, model)
        self.doorbell = redis_keys.lane_doorbell(prefix, model)
        self.stream_prefix = redis_keys.request_stream(prefix, model, "")  # a lane's stream is this and the lane
        self._backlog = scripts.register(redis, "queue_backlog")

    def stream_of(self, payload: RequestPayload) -> str:
        return self.lane_stream(lane_of(payload))

    def lane_stream(self, lane: str) -> str:
        return redis_keys.request_stream(self.prefix, self.model, lane)

    async def streams(self, backend: str | None = None) -> list[str]:
        """Every lane's stream (only those a worker of `backend` reads, when given), in a stable order."""
        return self.lane_streams(await self.redis.smembers(self.lanes_key), backend)

    def lane_streams(self, lanes: Iterable[str], backend: str | None = None) -> list[str]:
        """The streams of these lanes (only those a worker of `backend` reads, when given), sorted."""
        return sorted(redis_keys.request_stream(self.prefix, self.model, lane)
                      for lane in lanes if backend is None or served_by(lane, backend))

    async def ensure_groups(self) -> None:
        """The workers' group on every lane (the api creates it with each new lane; this repairs
        a Redis that lost them). The doorbell has none: every worker reads all of it."""
        for stream in await self.streams():
            try:
                await self.redis.xgroup_create(stream, redis_keys.WORKER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def worker_group(self, stream: str) -> dict | None:
        """The workers' group on `stream` as XINFO GROUPS gives it (name, last-delivered-id,
        pending, ...); None where the stream or the group does not exist."""
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError:  # no such stream (yet)
            return None
        return next((g for g in groups if g["name"] == redis_keys.WORKER_GROUP), None)

    async def backlog(self) -> tuple[int, int]:
        """(requests no worker has taken yet, requests ever taken), summed over the lanes."""
        waiting, taken = await self._backlog(keys=[self.lanes_key],
                                             args=[self.stream_prefix, redis_keys.WORKER_GROUP])
        return int(waiting), int(taken)


async def queued_models(redis: Redis, prefix: str) -> set[str]:
    """Every model that has a request queue (a lanes set): the api's first request for a model
    makes one, and it stays while anything of it is queued or pending, whether or not a worker
    of that model is alive."""
    return {redis_keys.model_of_lanes(prefix, key)
            async for key in redis.scan_iter(match=redis_keys.request_lanes_pattern(prefix), count=1000, _type="set")}
