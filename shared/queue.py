"""A model's request queue: one Redis stream per lane, a lane being a tenant and a priority
(and, for a request only one backend may run, that backend: `@vllm/0:acme`).

The api writes each request to its lane's stream (with the record, in one script); workers
read the heads of all lanes with one XREADGROUP and the batcher chooses between them
(worker/fair_queue.py). A new lane rings a doorbell stream so waiting workers start reading
it at once (worker/intake.py). Everything that looks at the backlog (backpressure, the scheduler) goes over all
lanes through this class.
"""
from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import keys
from shared.messages import RequestPayload

ANONYMOUS = "-"  # the lane's tenant part when auth is off


def lane_of(payload: RequestPayload) -> str:
    """`<priority>:<tenant>`, after `@<backend>/` when the request needs one backend; the
    priority before the tenant, so a tenant name may contain ':'."""
    lane = f"{payload.priority}:{payload.owner or ANONYMOUS}"
    return f"@{payload.backend}/{lane}" if payload.backend else lane


def served_by(lane: str, backend: str) -> bool:
    """Whether a worker of `backend` reads this lane: untargeted lanes, and its own."""
    return not lane.startswith("@") or lane.startswith(f"@{backend}/")


class RequestQueue:
    def __init__(self, redis: Redis, prefix: str, model: str):
        self.redis = redis
        self.prefix = prefix
        self.model = model
        self.lanes_key = keys.request_lanes(prefix, model)
        self.doorbell = keys.lane_doorbell(prefix, model)

    def stream_of(self, payload: RequestPayload) -> str:
        return keys.request_stream(self.prefix, self.model, lane_of(payload))

    async def streams(self, backend: str | None = None) -> list[str]:
        """Every lane's stream (only those a worker of `backend` reads, when given), in a stable order."""
        return sorted(keys.request_stream(self.prefix, self.model, lane)
                      for lane in await self.redis.smembers(self.lanes_key)
                      if backend is None or served_by(lane, backend))

    async def ensure_groups(self) -> None:
        """The workers' group on every lane (the api creates it with each new lane; this repairs
        a Redis that lost them). The doorbell has none: every worker reads all of it."""
        for stream in await self.streams():
            try:
                await self.redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def backlog(self) -> tuple[int, int]:
        """(requests no worker has taken yet, requests ever taken), summed over the lanes."""
        streams = await self.streams()
        if not streams:
            return 0, 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xinfo_groups(stream)
            answers = await pipe.execute(raise_on_error=False)
        waiting = taken = 0
        for stream, groups in zip(streams, answers):
            if isinstance(groups, Exception):  # no such stream (yet)
                continue
            group = next((g for g in groups if g["name"] == keys.WORKER_GROUP), None)
            if group is None:
                waiting += await self.redis.xlen(stream)
                continue
            read = group.get("entries-read") or 0
            lag = group.get("lag")
            if lag is None:  # Redis cannot tell after some deletions: count from the stream's totals
                info = await self.redis.xinfo_stream(stream)
                lag = max(0, info["entries-added"] - read)
            waiting += int(lag)
            taken += int(read)
        return waiting, taken
