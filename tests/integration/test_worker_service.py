"""The worker's asyncio side keeps working while a model step runs (real Redis, stub engine)."""
import asyncio
import json
import threading
from types import SimpleNamespace

import pytest

from shared import redis_keys
from shared.request_record import RecordField
from shared.settings import WorkerSettings
from tests.waiting import until
from worker.engine.backend import Counts
from worker.engine.threaded import Threaded
from worker.engine.base import BaseEngine
from worker.engine.execution_plan import null_plan
from worker.service.service import WorkerService


def _settings(redis_url: str, prefix: str, **more) -> WorkerSettings:
    """A worker that beats and reads its lanes often, serving the model "m"."""
    return WorkerSettings(redis_url=redis_url, prefix=prefix, heartbeat_interval_s=0.05, heartbeat_ttl_s=5,
                          intake_block_ms=50, served_model_name="m", **more)


def _subscribed(redis, channel):
    async def check():
        return (await redis.execute_command("PUBSUB", "SHARDNUMSUB", channel))[1] > 0
    return check


async def _true(value):
    return value


class BlockingEngine(BaseEngine):
    """Stands in for the engine: its step blocks until released, as a long forward would."""

    pools = False  # runs no pooling requests
    plan = null_plan()

    def __init__(self):
        super().__init__(batch_size=4)
        self.release = threading.Event()
        self.stepping = threading.Event()
        self.cancelled: list[str] = []
        self.waiting: list = []
        self.running: list = [SimpleNamespace(id="running")]
        self._work = True

    def has_work(self):
        return self._work

    def step(self):
        self.stepping.set()
        assert self.release.wait(30), "never released"
        self._work = False
        return []

    def cancel(self, request_id):
        self.cancelled.append(request_id)

    @property
    def free_slots(self):
        return 0

    def kv_blocks(self):
        return None

    def counts(self):
        return Counts()

    def add(self, payload, resumed=()):
        raise AssertionError("no request is queued for it")

    def _running_or_waiting(self):
        return self.running + self.waiting

    def _forget(self, seq):
        pass

    def _reset(self):
        pass


async def test_cancels_and_heartbeats_flow_while_a_step_runs(redis, redis_url, prefix):
    settings = _settings(redis_url, prefix)
    engine = BlockingEngine()
    service = WorkerService(redis, Threaded(engine, "stub"), settings, "m")
    run = asyncio.create_task(service.run())
    await asyncio.to_thread(engine.stepping.wait, 30)  # the step is now blocking its thread

    beat_key = redis_keys.worker_heartbeat(prefix, settings.worker_name)
    await until(lambda: redis.exists(beat_key), what="first heartbeat")
    beat = json.loads(await redis.get(beat_key))
    assert beat["model"] == "m" and beat["capacity"] == 4 and beat["running"] == 1

    await until(_subscribed(redis, redis_keys.cancel_channel(prefix)), what="cancel listener subscribed")
    await redis.execute_command("SPUBLISH", redis_keys.cancel_channel(prefix), "some-request")
    await until(lambda: _true(bool(engine.cancelled)), what="cancel delivered")
    assert engine.cancelled == ["some-request"]
    assert not engine.release.is_set()  # all of that happened during the step

    engine.release.set()
    service.stop()
    await asyncio.wait_for(run, 10)
    assert await redis.get(beat_key) is None  # a stopped worker removes its heartbeat


async def test_a_cancel_flagged_while_the_listener_was_away_stops_its_request(redis, redis_url, prefix):
    """A cancel is published once, to whoever listens then. Whatever was flagged before the
    listener (re)subscribed is cancelled when it does: at start, and after its connection is cut."""
    settings = _settings(redis_url, prefix)
    engine = BlockingEngine()
    engine.running = [SimpleNamespace(id="flagged-before"), SimpleNamespace(id="flagged-later")]
    engine.waiting = [SimpleNamespace(id="never-flagged")]
    flag = RecordField.CANCEL_REQUESTED.value
    await redis.hset(redis_keys.request_record(prefix, "flagged-before"), flag, "1")
    service = WorkerService(redis, Threaded(engine, "stub"), settings, "m")
    run = asyncio.create_task(service.run())
    await asyncio.to_thread(engine.stepping.wait, 30)
    await until(lambda: _true(engine.cancelled == ["flagged-before"]), what="the earlier cancel taken at start")

    # As if the api's SPUBLISH was lost: the flag alone, then the listener's connection cut.
    await redis.hset(redis_keys.request_record(prefix, "flagged-later"), flag, "1")
    await redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    await until(lambda: _true("flagged-later" in engine.cancelled), what="the cancel taken after resubscribing")
    assert "never-flagged" not in engine.cancelled

    engine.release.set()
    service.stop()
    await asyncio.wait_for(run, 10)


async def test_a_cancel_listener_that_fails_stops_the_worker(redis, redis_url, prefix):
    """Not a worker left running deaf to cancels: its run ends with the listener's error."""
    settings = _settings(redis_url, prefix)
    engine = BlockingEngine()
    engine.running = [object()]  # no id: reading what it holds fails when the listener subscribes
    service = WorkerService(redis, Threaded(engine, "stub"), settings, "m")
    try:
        with pytest.raises(AttributeError):
            await asyncio.wait_for(service.run(), 30)
    finally:
        engine.release.set()


async def test_a_stuck_step_withdraws_the_worker(redis, redis_url, prefix):
    from worker.service.service import EngineStalled

    settings = _settings(redis_url, prefix, engine_stall_s=0.5)
    engine = BlockingEngine()  # its step never returns until released
    service = WorkerService(redis, Threaded(engine, "stub"), settings, "m")
    beat_key = redis_keys.worker_heartbeat(prefix, settings.worker_name)
    run = asyncio.create_task(service.run())
    await until(lambda: redis.exists(beat_key), what="first heartbeat")
    with pytest.raises(EngineStalled):
        await asyncio.wait_for(run, 30)
    assert not await redis.exists(beat_key)  # gone at once, not after its TTL
    engine.release.set()


async def test_a_worker_told_to_stop_while_redis_is_away_stops(tmp_path):
    import uuid

    from shared.redis_client import connect
    from shared.redis_server import RedisServer
    from worker.backends.null_engine import NullEngine

    server = RedisServer(tmp_path / "redis")
    url = server.start()
    redis = connect(url)
    settings = _settings(url, f"t{uuid.uuid4().hex[:8]}")
    service = WorkerService(redis, Threaded(NullEngine(batch_size=2, tokens_per_s=100), "null"), settings, "m")
    run = asyncio.create_task(service.run())
    free_key = redis_keys.worker_free_slots(settings.prefix, "m")
    await until(lambda: redis.hexists(free_key, settings.worker_name), what="the worker reading the lanes")
    server.kill()
    service.stop()
    # Without giving up its retries once stopping, it would wait for a Redis that never returns.
    await asyncio.wait_for(run, 30)
    await redis.aclose()


async def test_the_probes_follow_the_heartbeat_and_a_stop(redis, redis_url, prefix):
    import httpx

    settings = _settings(redis_url, prefix, metrics_port=0)
    engine = BlockingEngine()
    service = WorkerService(redis, Threaded(engine, "stub"), settings, "m")
    run = asyncio.create_task(service.run())
    await asyncio.to_thread(engine.stepping.wait, 30)
    base = f"http://127.0.0.1:{service.metrics_port}"
    async with httpx.AsyncClient() as client:
        async def ready():
            return (await client.get(f"{base}/readyz")).status_code == 200
        await until(ready, what="/readyz once a heartbeat is written")
        assert (await client.get(f"{base}/livez")).json() == {"status": "ok"}
        service.stop()  # the step still runs: alive, but no longer ready
        answer = await client.get(f"{base}/readyz")
        assert answer.status_code == 503 and answer.json()["reason"].startswith("stopping")
        assert (await client.get(f"{base}/livez")).status_code == 200
    engine.release.set()
    await asyncio.wait_for(run, 10)
