"""The worker's asyncio side: the step loop, intake, heartbeats and health; a taken entry is claimed
in worker/service/claims.py, cancels are heard in worker/service/cancel_listener.py.

Between steps it takes newly queued requests (up to the engine's free slots), so a request
that arrives mid-batch joins at the next step.

The backend's step is awaited (the built-in engines compute in a thread, vLLM in its own
process), so intake, cancels and heartbeats keep running while the model computes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import redis_keys, service_tier
from shared.heartbeat import Heartbeat
from shared.lora_registry import LoraRegistry
from shared.messages import now
from shared.prefix_affinity import PrefixAffinity
from shared.prefix_scope import PrefixScope
from shared.queue import RequestQueue
from shared.reclaim import reclaim_dead_workers
from shared.redis_client import REDIS_DOWN, until_redis_answers
from shared.settings import WorkerSettings
from shared.store import RequestStore
from worker.engine.backend import Backend
from worker.engine.sequence import StepOutput
from worker.service.cancel_listener import CancelListener
from worker.service.claims import Claims
from worker.service.intake import Intake, Taken
from worker.service.metrics import Check, WorkerMetrics
from worker.service.lease import Lease
from worker.service.publisher import Publisher
from worker.service.tracing import RequestSpans

log = logging.getLogger(__name__)
T = TypeVar("T")
LANES_REFRESH_S = 1.0  # a new lane is also announced on the doorbell stream; this is the fallback
# A busy worker, which does not wait on the doorbell, looks at its last id this often: a tenant's
# new lane (its first priority request, say) is read within this, not within LANES_REFRESH_S.
DOORBELL_CHECK_S = 0.05


class WorkerService:
    def __init__(self, redis: Redis, backend: Backend, settings: WorkerSettings, model: str):
        self.redis = redis
        self.backend = backend
        self.settings = settings
        self.model = model
        self.name = settings.worker_name
        self.queue = RequestQueue(redis, settings.prefix, model)
        self.store = RequestStore(redis, settings.prefix)
        self.lease = Lease(settings.heartbeat_ttl_s)
        self.publisher = Publisher(redis, self.queue, self.name, self.lease)
        self._stopping = asyncio.Event()
        self.intake = Intake(redis, self.queue, self.name, settings.heartbeat_ttl_s,
                             settings.prefix_affinity_wait_ms if settings.prefix_affinity else None)
        # Announces the prefixes it takes, when it keeps them (a prefix cache) and affinity is on.
        self.affinity = (PrefixAffinity(redis, settings.prefix, model, settings.prefix_affinity_tokens,
                                        PrefixScope.parse(settings.shared_prefix_tenants))
                         if settings.prefix_affinity and settings.prefix_caching else None)
        self._lanes: list[str] = []  # the lane streams, refreshed every LANES_REFRESH_S or on the doorbell
        self._lanes_read_at = -math.inf
        self._doorbell_id = "0-0"  # the doorbell's last entry when the lanes were read
        self._doorbell_checked_at = -math.inf
        self._announced = -1  # the free slots this worker last told the others of
        self.metrics = WorkerMetrics()
        self._plan = backend.plan  # decided when the engine was built: read once
        self.metrics.plan.labels(**self._plan.labels()).set(1)
        if (weights := backend.weight_bytes) is not None:
            self.metrics.weight_bytes.set(weights)
        self.spans = RequestSpans(self.name)  # where tracing is on (worker/service/tracing.py)
        self.claims = Claims(redis, self.store, backend, self.publisher, self.metrics, self.spans, self.name,
                             self._held, configured=frozenset(settings.lora.paths))
        self.cancels = CancelListener(redis, settings.prefix, self.store, backend, self._held)
        self.metrics_port: int | None = None
        self._progress = time.monotonic()  # last time the loop went round: a stuck step stops it
        self._redis_away_since: float | None = None  # the loop waits for Redis: no stuck engine, however long
        self._beat_at = -math.inf  # last time a heartbeat reached Redis

    def stop(self) -> None:
        """Stop taking requests; the running batch still finishes."""
        self._stopping.set()

    def stalled(self) -> str | None:
        """Why this worker is not alive (None: it is): its loop has not gone round for engine_stall_s,
        as the heartbeat sees it before withdrawing the worker. Read from the metrics thread, so it
        also tells of an event loop that can no longer run the heartbeat."""
        if self._redis_away_since is not None:
            return None
        idle, limit = time.monotonic() - self._progress, self.settings.engine_stall_s
        if idle > limit:
            return f"the engine loop has not gone round for {idle:.0f} s (engine_stall_s={limit})"
        return None

    def unready(self) -> str | None:
        """Why this worker is not ready (None: it is): stopping, or no heartbeat has reached Redis for
        heartbeat_ttl_s, so the scheduler and the api's /readyz do not count it either."""
        if self._stopping.is_set():
            return "stopping: it takes no new requests"
        if self._beat_at == -math.inf:
            return "no heartbeat written yet"
        age = time.monotonic() - self._beat_at
        if age > self.settings.heartbeat_ttl_s:
            return f"no heartbeat written for {age:.0f} s (heartbeat_ttl_s={self.settings.heartbeat_ttl_s})"
        return None

    def probes(self) -> dict[str, Check]:
        """The health checks the metrics port answers, by path (200, or 503 with the reason)."""
        return {"/livez": self.stalled, "/readyz": self.unready}

    async def run(self) -> None:
        """Serve until stopped. Raises EngineStalled (after removing the heartbeat) when a step
        has run longer than engine_stall_s: the caller must then exit the process."""
        await self._retry("start", self.queue.ensure_groups)
        server = None
        if self.settings.metrics_port >= 0:
            server = self.metrics.serve(self.settings.metrics_host, self.settings.metrics_port, self.probes())
            self.metrics_port = server.server_port
            log.info("worker metrics on http://%s:%d/metrics", self.settings.metrics_host, self.metrics_port)
        loop = asyncio.create_task(self._loop())
        heartbeat = asyncio.create_task(self._beat_every_interval())
        listener = asyncio.create_task(self.cancels.listen())
        tasks = [loop, heartbeat, listener]
        try:
            # The listener ends only by failing: a worker deaf to cancels stops, and says why.
            done, _ = await asyncio.wait({loop, heartbeat, listener}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(*REDIS_DOWN):  # else the heartbeat expires and the free-slots entry with it
                await self.redis.delete(redis_keys.worker_heartbeat(self.settings.prefix, self.name))
                await self.intake.withdraw()
            if server is not None:
                server.shutdown()

    async def _loop(self) -> None:
        try:
            while True:
                self._progress = time.monotonic()
                if not self._stopping.is_set():
                    # Idle: wait for work. Busy: take what is there without waiting, then step.
                    await self._intake(block=not self.backend.has_work())
                if self.backend.has_work():
                    await self._step()
                elif self._stopping.is_set():
                    return
        except REDIS_DOWN as exc:  # retries give up only once stopping (_retry)
            # What it ran stays pending in the group: the scheduler hands it to another worker,
            # which continues after the tokens this one published, as after a crash.
            log.warning("stopping while Redis is unreachable (%s): %d requests left to be taken over",
                        exc, len(self.backend.running) + len(self.backend.waiting))

    async def _retry(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Retry while Redis is away, unless this worker is stopping: then a stop must not wait for it.
        Meanwhile the loop is not stuck, only waiting: the stall check leaves it be."""
        def away() -> bool:
            if self._redis_away_since is None:
                self._redis_away_since = time.monotonic()
            return self._stopping.is_set()
        try:
            return await until_redis_answers(what, call, log, give_up=away)
        finally:
            if self._redis_away_since is not None:
                self._redis_away_since, self._progress = None, time.monotonic()

    async def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = await self.backend.step()
        except Exception as exc:  # a failed step fails its requests, not the worker
            log.exception("step failed")
            outputs = self.backend.fail_all(f"{type(exc).__name__}: {exc}")
        # Counted before publishing: whoever sees a request end sees it in /metrics too.
        self.metrics.step(outputs, time.perf_counter() - started, self.backend, self.name)
        self.spans.stepped(outputs)
        # Until it is published, a step's tokens exist only here: retry until Redis takes them.
        # A retried pipeline may log a token twice; readers keep the first of each index.
        published, wall = time.perf_counter(), time.time()
        lost = await self._retry("publish", lambda: self.publisher.publish(outputs))
        self.metrics.published(time.perf_counter() - published)
        self.spans.published(outputs, wall)
        self._drop_lost(lost, outputs)

    def _drop_lost(self, lost: list[str], outputs: list[StepOutput]) -> None:
        """Stop the requests another worker took over while this one was paused past its heartbeat's
        TTL: nothing of theirs was written, and running them on would only hold KV blocks."""
        ended = {out.request_id for out in outputs if out.finished}
        for request_id in lost:
            if request_id not in ended:
                log.warning("request %s was taken over by another worker; this one stops it", request_id)
                self.backend.cancel(request_id)

    async def _intake(self, block: bool) -> None:
        """Take this worker's share of the queued requests, spread over the lanes; with no free
        slot, the head of each lane that has none waiting here (so the batcher can choose fairly
        between tenants when a slot frees), unless another worker has room. Remove the other
        workers' affinity lanes the take found abandoned. Wait for some if `block`."""
        free = self.backend.free_slots
        wanted = self._lanes_to_read(await self._retry("lanes", self._lane_streams), free)
        if not wanted and not block and free == self._announced:
            return
        try:
            taken = await self._retry("intake", lambda: self.intake.take(wanted, free, idle=block))
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("a request stream had no consumer group (%s); creating them", exc)
            await self._retry("groups", self.queue.ensure_groups)
            return
        self._announced = max(0, free - len(taken.entries))
        await self._claim_taken(taken)
        if taken.abandoned:
            await self._retry("drop lanes", lambda: self.intake.drop(taken.abandoned))
        if block and not taken.entries:
            await self._wait_for_entries(taken)

    def _lanes_to_read(self, lanes: list[str], free: int) -> list[str]:
        """Every lane where a slot is free; with none, the lanes of which no request waits here,
        of a service tier no worse than the best waiting here (a worse one's head would not be
        admitted before it)."""
        if free:
            return lanes
        if len(lanes) > 1:
            here = {self.queue.lane_stream(seq.lane) for seq in self.backend.waiting}
            best = min((self.intake.rank(lane) for lane in here), default=len(service_tier.TIERS))
            return [lane for lane in lanes if lane not in here and self.intake.rank(lane) <= best]
        return []

    async def _claim_taken(self, taken: Taken) -> None:
        """Hand the entries taken to the engine, and announce their prefixes where affinity is on."""
        claimed = []
        for stream, entry_id, fields in taken.entries:
            # Every Redis call of a claim can be repeated; the engine gets the request last.
            payload = await self._retry("claim", lambda s=stream, e=entry_id, f=fields: self.claims.claim(s, e, f))
            if payload is not None:
                claimed.append(payload)
        if claimed and self.affinity is not None:
            ttl_ms = int(self.settings.prefix_affinity_ttl_s * 1000)
            await self._retry("announce", lambda: self.affinity.announce(self.name, claimed, ttl_ms))

    async def _wait_for_entries(self, taken: Taken) -> None:
        """Nothing taken, nothing running: wait on the lanes (and the new-lane doorbell) for an entry."""
        block_ms = self.settings.intake_block_ms
        if taken.due_in_ms is not None:  # another worker's request may be taken here then
            block_ms = max(1, min(block_ms, taken.due_in_ms))
        added = await self._retry("wait", lambda: self.intake.wait(taken.last_ids, self._doorbell_id, block_ms))
        if added:  # a new lane: read it from the next intake on
            self._lanes_read_at = -math.inf

    async def _lane_streams(self) -> list[str]:
        now = time.monotonic()
        stale = now - self._lanes_read_at > LANES_REFRESH_S
        if not stale and now - self._doorbell_checked_at > DOORBELL_CHECK_S:
            self._doorbell_checked_at = now
            stale = await self.intake.doorbell() != self._doorbell_id
        if stale:
            self._lanes, self._doorbell_id = await self.intake.lanes(self.settings.backend)
            self._lanes_read_at = self._doorbell_checked_at = time.monotonic()
        return self._lanes

    def _held(self) -> list[str]:
        """The ids of the requests this worker holds: running, or taken and waiting to run."""
        return [seq.id for seq in self.backend.running + self.backend.waiting]

    async def _beat_every_interval(self) -> None:
        """Announce this worker every heartbeat interval while its loop goes round (beat)."""
        while True:
            await self.beat()
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def beat(self) -> None:
        """Write one heartbeat (logged, not raised, where Redis is down); raise EngineStalled
        instead if a step is stuck, so readiness and the scheduler see this worker gone and its
        requests are taken over."""
        if (stalled := self.stalled()) is not None:
            log.error("%s: withdrawing this worker", stalled)
            raise EngineStalled(stalled)
        adapters = self.backend.adapters
        try:
            sent = time.monotonic()
            await self.redis.set(redis_keys.worker_heartbeat(self.settings.prefix, self.name),
                                 self.heartbeat(adapters).encode(), px=int(self.settings.heartbeat_ttl_s * 1000))
            self._beat_at = time.monotonic()
            self.lease.beaten(sent, self._beat_at)
        except REDIS_DOWN as exc:
            log.warning("heartbeat not written (%s)", exc)
            return
        if adapters is not None:
            await self._learn_adapters()
        if self.backend.free_slots > 0 and not self._stopping.is_set():
            await self._reclaim()

    async def _learn_adapters(self) -> None:
        """The LoRA adapters loaded at run time for this model, for the next heartbeat and requests."""
        try:
            entries = await LoraRegistry(self.redis, self.settings.prefix).entries(self.model)
        except REDIS_DOWN as exc:
            log.warning("run-time LoRA adapters not read (%s)", exc)
            return
        self.backend.learn_adapters({name: Path(entry.path) for name, entry in entries.items()})

    async def _reclaim(self) -> None:
        """A worker with room puts back the requests of dead workers itself, as the scheduler does
        at its cron tick: a takeover then waits a heartbeat TTL and one beat at most. Never fatal:
        the scheduler's tick is there too."""
        try:
            await reclaim_dead_workers(self.redis, self.settings.prefix, self.model, self.settings.heartbeat_ttl_s,
                                       self.settings.max_attempts)
        except REDIS_DOWN as exc:
            log.warning("dead workers' requests not looked for (%s)", exc)
        except Exception:  # a bug here must not stop the heartbeat
            log.exception("looking for dead workers' requests failed")

    def heartbeat(self, adapters: list[str] | None) -> Heartbeat:
        """This worker as its heartbeat says it now (`adapters`: the backend's, read once per beat)."""
        backend, kv = self.backend, self.backend.kv_blocks()
        return Heartbeat(worker=self.name, model=self.model, backend=self.settings.backend, capacity=backend.batch_size,
                         running=len(backend.running), waiting=len(backend.waiting), metrics_port=self.metrics_port,
                         deterministic=self.settings.step.deterministic, batch_invariant=backend.batch_invariant,
                         pools=backend.pools, lora=adapters is not None, adapters=adapters or [],
                         plan=self._plan.labels(), kv_blocks_free=kv[0] if kv else None,
                         kv_blocks_total=kv[1] if kv else None,
                         at=round(now(), 3), **self.metrics.totals())  # at: when the totals were read


class EngineStalled(RuntimeError):
    """A model step has run longer than engine_stall_s; the process must exit."""
