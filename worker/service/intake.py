"""How a worker takes requests from its model's lanes when other workers share them.

Two rules make M workers split k requests that arrive together about k/M each:
- **Every idle worker hears of new work.** An idle worker waits with a plain XREAD (no
  group) on its lanes and on the new-lane doorbell, from the last ids it saw; a new entry or a
  new lane wakes every waiting worker at once, and then each claims through the group.
  (Read through the group, the doorbell woke one worker only: the others learnt of a new lane
  at their next lane refresh, after the first had taken everything.)
- **Each takes its share, decided with the read.** One script reads the free slots that the
  live workers announced, the requests waiting in the lanes, and takes this worker's part of
  a water-filling split (the emptiest workers fill first, to an equal level), then announces
  what it has left. An idle worker always takes at least one, so a stale announcement of a
  dead worker can slow a burst's spread but never leaves a request waiting with every worker idle.

With prefix affinity (shared/prefix_affinity.py), a request the api marked for a worker waits in
that worker's affinity lane. That worker takes from its affinity lanes first (up to its free
slots), then its split of the rest; the others take an entry of its affinity lanes only once
the entry has waited the bound, so a busy or dead worker's requests go elsewhere after it.
Worker names change at each start, so a dead worker's affinity lanes would stay for good: once
one is empty, with nothing pending, and its worker announces nothing, a take reports it and a
second script (shared/lua/intake_drop.lua) removes it, checking again as it does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio import Redis

from shared import redis_keys, scripts, service_tier
from shared.queue import RequestQueue, affinity_of

@dataclass
class Taken:
    """What one take() got: (lane stream, entry id, fields) in reading order, and, when it got
    nothing, each lane's last entry id, from which to wait for the next, and the ms until an
    entry of another worker's affinity lane may be taken here (None: none waits). `abandoned`:
    other workers' affinity lanes it found abandoned, for drop()."""
    entries: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    last_ids: dict[str, str] = field(default_factory=dict)
    due_in_ms: int | None = None
    abandoned: list[str] = field(default_factory=list)


class Intake:
    """One worker's reads of its model's lanes: its share of what waits, and the wait for more.

    With `affinity_wait_ms` (prefix affinity on), it takes from its own affinity lanes first,
    and from another worker's only the entries that have waited that long; without it, every
    lane is any worker's."""

    def __init__(self, redis: Redis, queue: RequestQueue, worker: str, ttl_s: float,
                 affinity_wait_ms: int | None = None):
        self.redis = redis
        self.queue = queue
        self.worker = worker
        self.ttl_ms = int(ttl_s * 1000)
        self.affinity_wait_ms = affinity_wait_ms
        self.free_key = redis_keys.worker_free_slots(queue.prefix, queue.model)
        self._take = scripts.register(redis, "intake_take")
        self._drop = scripts.register(redis, "intake_drop")

    async def lanes(self, backend: str) -> tuple[list[str], str]:
        """The lanes a worker of `backend` reads, and the doorbell's last id when they were read
        (waiting from that id, a lane added since wakes the worker)."""
        # The doorbell first: a lane added after that read rings it after the id read, so the
        # wait from it wakes. (One slot, one node: a pipeline keeps the order, on a cluster too.)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrevrange(self.queue.doorbell, count=1)
            pipe.smembers(self.queue.lanes_key)
            top, members = await pipe.execute()
        return self.queue.lane_streams(members, backend), top[0][0] if top else "0-0"

    async def doorbell(self) -> str:
        """The doorbell's last id ("0-0": none): another than the one `lanes` gave means a lane
        was added since."""
        top = await self.redis.xrevrange(self.queue.doorbell, count=1)
        return top[0][0] if top else "0-0"

    async def take(self, lanes: list[str], free: int, idle: bool) -> Taken:
        """Claim this worker's share of the requests waiting in `lanes` (with no free slot and
        nobody else free, the head of each lane), and announce the free slots left; report the
        other workers' affinity lanes that look abandoned (Taken.abandoned, for drop)."""
        kinds = [self._kind(lane) for lane in lanes]
        owners = [self._owner(lane) if kind == "o" else "" for lane, kind in zip(lanes, kinds, strict=True)]
        reply = await self._take(keys=[self.free_key, *lanes],
                                 args=[redis_keys.WORKER_GROUP, self.worker, free, int(idle), self.ttl_ms,
                                       self.affinity_wait_ms or 0, "".join(kinds),
                                       "".join(str(self.rank(lane)) for lane in lanes), *owners])
        count, abandoned = reply[0], reply[1]
        taken = Taken(entries=[(lanes[i - 1], entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
                               for i, entry_id, flat in reply[2:2 + count]],
                      abandoned=[lanes[i - 1] for i in abandoned])
        if not taken.entries:
            taken.last_ids = dict(zip(lanes, reply[-2], strict=True))
            taken.due_in_ms = None if reply[-1] < 0 else reply[-1]
        return taken

    async def drop(self, streams: list[str]) -> list[str]:
        """Remove those of these other workers' affinity lanes that are still abandoned (their
        worker reads no more, nothing in them waits or is pending) and delete their streams;
        the streams removed. A request queued there later creates its lane again. Apart from
        take(), so that each is one script, safe to repeat on its own."""
        args = [redis_keys.WORKER_GROUP]
        for stream in streams:
            args += [stream.removeprefix(self.queue.stream_prefix), self._owner(stream) or ""]
        return await self._drop(keys=[self.free_key, self.queue.lanes_key, *streams], args=args)

    def _owner(self, stream: str) -> str | None:
        """The worker whose affinity lane this is (None: any worker's)."""
        return affinity_of(stream.removeprefix(self.queue.stream_prefix))

    def rank(self, stream: str) -> int:
        """The rank of the lane's service tier (0 first)."""
        return service_tier.rank_of_lane(stream.removeprefix(self.queue.stream_prefix))

    def _kind(self, stream: str) -> str:
        """'m': this worker's affinity lane, 'o': another worker's, 'a': any worker's."""
        owner = self._owner(stream)
        if owner is None or self.affinity_wait_ms is None:
            return "a"
        return "m" if owner == self.worker else "o"

    async def wait(self, last_ids: dict[str, str], doorbell_id: str, block_ms: int) -> bool:
        """Wait until a lane gets an entry after its last id, or a lane is added after
        `doorbell_id`, or `block_ms` passes. True when a lane was added."""
        reply = await self.redis.xread({self.queue.doorbell: doorbell_id, **last_ids}, count=1, block=block_ms)
        return any(stream == self.queue.doorbell for stream, _ in reply or [])

    async def withdraw(self) -> None:
        """This worker takes nothing more: others need not leave it a share."""
        await self.redis.hdel(self.free_key, self.worker)

