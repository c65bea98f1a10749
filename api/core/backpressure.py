"""Backpressure: past `max_queued_requests` waiting requests, new ones get 503 with a
Retry-After computed from how fast the workers are draining the queue.

The backlog is the consumer group's lag (entries no worker has taken yet) summed over the
model's lanes, read in Redis by the same script that queues the requests
(`RequestStore.enqueue`): check and enqueue are one step, so replicas submitting at once
never pass the limit together. Each submit and a sampler once a second note the groups'
`entries-read`; the drain rate is its growth over the last few seconds. The sampler also
hands the backlog to the replica's `streamq:num_requests_queued` gauge, which the workers'
autoscaler reads (deploy/k8s/keda).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable

from redis.exceptions import RedisError

from api.core.errors import ApiError
from shared.messages import RequestPayload
from shared.queue import RequestQueue
from shared.store import RequestStore

log = logging.getLogger(__name__)

WINDOW_S = 10.0  # drain rate measured over this much recent history
MAX_RETRY_AFTER_S = 60


class Backpressure:
    def __init__(self, queue: RequestQueue, limit: int, on_backlog: Callable[[int], None] | None = None):
        self.queue = queue
        self.limit = limit
        self.on_backlog = on_backlog  # told each sample's backlog (the api's queued-requests gauge)
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, entries read by workers)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._sample_forever())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def backlog(self) -> tuple[int, int]:
        """(requests waiting for a worker, requests ever read by a worker)."""
        return await self.queue.backlog()

    def drain_rate(self) -> float:
        """Requests per second the workers took over the recent window (0 if unknown)."""
        if len(self._samples) < 2:
            return 0.0
        (t0, r0), (t1, r1) = self._samples[0], self._samples[-1]
        return (r1 - r0) / (t1 - t0) if t1 > t0 else 0.0

    async def enqueue(self, store: RequestStore, payloads: list[RequestPayload]) -> None:
        """Queue the requests, all or none; 503 if they would push the backlog past the limit."""
        enqueued = await store.enqueue(payloads, max_waiting=self.limit)
        self._note(enqueued.taken)
        if enqueued.queued:
            return
        waiting, rate = enqueued.waiting, self.drain_rate()
        excess = waiting + len(payloads) - self.limit
        retry = MAX_RETRY_AFTER_S if rate <= 0 else min(MAX_RETRY_AFTER_S, max(1, math.ceil(excess / rate)))
        raise ApiError(503, f"the server is busy: {waiting} requests are waiting for a worker (limit {self.limit}); "
                            f"at the measured drain rate of {rate:.2f} requests/s, retry in {retry} s",
                       code="overloaded", headers={"Retry-After": str(retry)})

    def _note(self, read: int) -> None:
        now = time.monotonic()
        self._samples.append((now, read))
        while self._samples and now - self._samples[0][0] > WINDOW_S:
            self._samples.popleft()

    async def sample(self) -> None:
        """Read the backlog now: note the drain and hand the backlog to the gauge (also called by
        /metrics before it renders, so a scrape never shows a backlog up to a second old)."""
        waiting, taken = await self.backlog()
        self._note(taken)
        if self.on_backlog is not None:
            self.on_backlog(waiting)

    async def _sample_forever(self) -> None:
        while True:
            try:
                await self.sample()
            except RedisError as exc:
                log.warning("backpressure sampler: %s", exc)
            await asyncio.sleep(1.0)
