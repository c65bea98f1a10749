"""The worker's asyncio side: intake, cancellation, heartbeats, and the step loop.

Between steps it takes newly queued requests (up to the engine's free slots), so a request
that arrives mid-batch joins at the next step.

The backend's step is awaited (the built-in engines compute in a thread, vLLM in its own
process), so intake, cancels and heartbeats keep running while the model computes.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisClusterException, ResponseError

from shared import redis_keys
from shared.lora_registry import LoraRegistry
from shared.messages import FinalEvent, RequestPayload, TokenEvent, decode_event, now
from shared.prefix_affinity import PrefixAffinity
from shared.pubsub import MESSAGE, SUBSCRIBED, UNSUBSCRIBED, close_pubsub, node_of, pubsub_on, refresh
from shared.queue import RequestQueue
from shared.reclaim import reclaim_dead_workers
from shared.redis_client import REDIS_DOWN, until_redis_answers
from shared.settings import WorkerSettings
from shared.store import RequestStore
from worker.engine.backend import Backend
from worker.service.intake import Intake, Taken
from worker.service.metrics import Check, WorkerMetrics
from worker.service.publisher import Publisher
from worker.engine.sequence import refused
from worker.service.tracing import RequestSpans

log = logging.getLogger(__name__)
T = TypeVar("T")
LANES_REFRESH_S = 1.0  # a new lane is also announced on the doorbell stream; this is the fallback


class WorkerService:
    def __init__(self, redis: Redis, backend: Backend, settings: WorkerSettings, model: str):
        self.redis = redis
        self.backend = backend
        self.settings = settings
        self.model = model
        self.name = settings.worker_name
        self.queue = RequestQueue(redis, settings.prefix, model)
        self.store = RequestStore(redis, settings.prefix)
        self.publisher = Publisher(redis, self.queue)
        self._stopping = asyncio.Event()
        self.intake = Intake(redis, self.queue, self.name, settings.heartbeat_ttl_s,
                             settings.prefix_affinity_wait_ms if settings.prefix_affinity else None)
        # Announces the prefixes it takes, when it keeps them (a prefix cache) and affinity is on.
        self.affinity = (PrefixAffinity(redis, settings.prefix, model, settings.prefix_affinity_tokens)
                         if settings.prefix_affinity and settings.prefix_caching else None)
        self._lanes: list[str] = []  # the lane streams, refreshed every LANES_REFRESH_S or on the doorbell
        self._lanes_read_at = -math.inf
        self._doorbell_id = "0-0"  # the doorbell's last entry when the lanes were read
        self._announced = -1  # the free slots this worker last told the others of
        self.metrics = WorkerMetrics()
        self._plan = backend.plan  # decided when the engine was built: read once
        self.metrics.plan.labels(**self._plan.labels()).set(1)
        self.spans = RequestSpans(self.name)  # where tracing is on (worker/service/tracing.py)
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
        heartbeat = asyncio.create_task(self._heartbeat())
        listener = asyncio.create_task(self._listen_cancels())
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
        await self._retry("publish", lambda: self.publisher.publish(outputs))
        self.metrics.published(time.perf_counter() - published)
        self.spans.published(outputs, wall)

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
        await self._admit_taken(taken)
        if taken.abandoned:
            await self._retry("drop lanes", lambda: self.intake.drop(taken.abandoned))
        if block and not taken.entries:
            await self._wait_for_entries(taken)

    def _lanes_to_read(self, lanes: list[str], free: int) -> list[str]:
        """Every lane where a slot is free; with none, the lanes of which no request waits here."""
        if free:
            return lanes
        if len(lanes) > 1:
            here = {self.queue.lane_stream(seq.lane) for seq in self.backend.waiting}
            return [lane for lane in lanes if lane not in here]
        return []

    async def _admit_taken(self, taken: Taken) -> None:
        """Hand the entries taken to the engine, and announce their prefixes where affinity is on."""
        admitted = []
        for stream, entry_id, fields in taken.entries:
            # Every Redis call of _admit can be repeated; the engine gets the request last.
            payload = await self._retry("admission", lambda s=stream, e=entry_id, f=fields: self._admit(s, e, f))
            if payload is not None:
                admitted.append(payload)
        if admitted and self.affinity is not None:
            ttl_ms = int(self.settings.prefix_affinity_ttl_s * 1000)
            await self._retry("announce", lambda: self.affinity.announce(self.name, admitted, ttl_ms))

    async def _wait_for_entries(self, taken: Taken) -> None:
        """Nothing taken, nothing running: wait on the lanes (and the new-lane doorbell) for an entry."""
        block_ms = self.settings.intake_block_ms
        if taken.due_in_ms is not None:  # another worker's request may be taken here then
            block_ms = max(1, min(block_ms, taken.due_in_ms))
        added = await self._retry("wait", lambda: self.intake.wait(taken.last_ids, self._doorbell_id, block_ms))
        if added:  # a new lane: read it from the next intake on
            self._lanes_read_at = -math.inf

    async def _lane_streams(self) -> list[str]:
        if time.monotonic() - self._lanes_read_at > LANES_REFRESH_S:
            self._lanes, self._doorbell_id = await self.intake.lanes(self.settings.backend)
            self._lanes_read_at = time.monotonic()
        return self._lanes

    async def _admit(self, stream: str, entry_id: str, fields: dict[str, str]) -> RequestPayload | None:
        """Hand a taken entry's request to the backend; None when it is not to run (malformed,
        expired, ended while queued)."""
        try:
            payload = RequestPayload.model_validate_json(fields.get("payload", ""))
        except ValidationError as exc:
            # E.g. queued by an api with other bounds: its client hears why instead of waiting.
            log.error("failing malformed request entry %s: %s", entry_id, exc)
            request_id = _request_id(fields.get("payload", ""))
            if request_id is not None:
                await self.store.fail_queued(request_id, f"the worker cannot run this request: {exc}")
            await self.redis.xack(stream, redis_keys.WORKER_GROUP, entry_id)
            return None
        if payload.expires_at is not None and now() > payload.expires_at and await self.store.expire(payload):
            log.info("request %s expired in the queue", payload.id)
            await self.redis.xack(stream, redis_keys.WORKER_GROUP, entry_id)
            return None
        if not await self.store.claim(payload.id, self.name):
            # Cancelled (or otherwise ended) while queued: nothing to run.
            await self.redis.xack(stream, redis_keys.WORKER_GROUP, entry_id)
            return None
        if payload.id in self._held():
            # Put back while this worker still ran it (its heartbeat came late: a stalled machine, a
            # long pause): it goes on here, and its end acks the entry it came back as.
            log.warning("request %s came back to the worker that still runs it; it goes on", payload.id)
            self.publisher.taken(payload.id, entry_id)
            return None
        # A request put back after its worker died continues after the tokens already delivered.
        delivered = [decode_event(data) for _, data in await self.store.events(payload.id)]
        if any(isinstance(e, FinalEvent) for e in delivered):
            await self.redis.xack(stream, redis_keys.WORKER_GROUP, entry_id)
            return None
        resumed = [e for e in delivered if isinstance(e, TokenEvent)]
        log.info("request %s started", payload.id, extra={
            "request_id": payload.id, "worker": self.name, "tenant": payload.tenant,
            "queue_s": round(now() - payload.created_at, 4), "prompt_tokens": len(payload.prompt_token_ids),
            "resumed_after": len(resumed)})
        self.metrics.taken(payload)
        self.spans.taken(payload, len(resumed))
        self.publisher.taken(payload.id, entry_id)
        if (error := self._cannot_run(payload)) is not None:  # queued for this backend by hand
            await self.publisher.publish([refused(payload, error)])
            return None
        self.backend.add(payload, resumed)
        return payload

    def _cannot_run(self, payload: RequestPayload) -> str | None:
        """Why this worker's backend cannot run the request (None: it can)."""
        if payload.pool is not None and not self.backend.pools:
            return f"the {self.backend.name} backend does not compute embeddings or scores"
        if payload.adapter is not None and self.backend.adapters is None:
            return (f"LoRA adapter {payload.adapter!r}: this worker serves no adapters (the paged engine with "
                    "STREAMQ_ENABLE_LORA or STREAMQ_LORA_MODULES does)")
        return None

    async def _listen_cancels(self) -> None:
        # By hand, not a redis-py Retry: the listen loop itself must start again on a fresh
        # subscription, for as long as the worker runs.
        # On a cluster, the subscription goes to the node that serves the channel's slot now.
        channel = redis_keys.cancel_channel(self.settings.prefix)
        while True:
            pubsub = None
            try:
                await refresh(self.redis)
                pubsub = pubsub_on(self.redis, node_of(self.redis, channel))
                await pubsub.subscribe(channel)
                async for message in pubsub.listen():
                    if message["type"] == MESSAGE:
                        self.backend.cancel(message["data"])
                    elif message["type"] == SUBSCRIBED:  # listening from here on: catch up on before
                        await self._cancel_flagged()
                    elif message["type"] == UNSUBSCRIBED:  # its slot moved to another node
                        break
            except (*REDIS_DOWN, RedisClusterException, ResponseError) as exc:  # e.g. MOVED: the slot's new node
                log.warning("cancel listener lost redis (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                if pubsub is not None:
                    await close_pubsub(self.redis, pubsub)

    async def _cancel_flagged(self) -> None:
        """Stop what this worker holds whose record was flagged cancelled while its listener was not
        subscribed. A cancel is published once, to whoever listens then: without this, one sent
        while Redis restarted, the connection was lost or the channel's slot moved would leave its
        request running to its end."""
        held = self._held()
        for request_id in await self.store.cancel_flagged(held) if held else []:
            log.info("request %s was cancelled while the cancel listener was away", request_id)
            self.backend.cancel(request_id)

    def _held(self) -> list[str]:
        """The ids of the requests this worker holds: running, or taken and waiting to run."""
        return [seq.id for seq in self.backend.running + self.backend.waiting]

    async def _heartbeat(self) -> None:
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
        beat = {"worker": self.name, "model": self.model, "backend": self.settings.backend,
                "capacity": self.backend.batch_size, "running": len(self.backend.running),
                "waiting": len(self.backend.waiting), "metrics_port": self.metrics_port,
                "deterministic": self.settings.step.deterministic, "batch_invariant": self.backend.batch_invariant,
                "pools": self.backend.pools, "lora": adapters is not None, "adapters": adapters or [],
                "plan": self._plan.labels(),
                **self._kv_blocks(),
                "at": round(now(), 3), **self.metrics.totals()}  # at: when the totals were read
        try:
            await self.redis.set(redis_keys.worker_heartbeat(self.settings.prefix, self.name), json.dumps(beat),
                                 px=int(self.settings.heartbeat_ttl_s * 1000))
            self._beat_at = time.monotonic()
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

    def _kv_blocks(self) -> dict[str, int]:
        blocks = self.backend.kv_blocks()
        return {} if blocks is None else {"kv_blocks_free": blocks[0], "kv_blocks_total": blocks[1]}


def _request_id(payload: str) -> str | None:
    """The id of a request entry whose payload does not validate, if it has one."""
    try:
        request_id = json.loads(payload).get("id")
    except (ValueError, AttributeError):
        return None
    return request_id if isinstance(request_id, str) else None


class EngineStalled(RuntimeError):
    """A model step has run longer than engine_stall_s; the process must exit."""
