"""The worker's /livez and /readyz (on its metrics port), what Kubernetes probes: the verdicts
and the HTTP answers, with a fake Redis and a moved clock."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import fakeredis
import httpx
import pytest

from shared import redis_keys
from shared.settings import WorkerSettings
from worker.service import service as service_module
from worker.engine.threaded import Threaded
from worker.service.metrics import WorkerMetrics
from worker.backends.null_engine import NullEngine
from worker.service.service import EngineStalled, WorkerService


@pytest.fixture
def clock(monkeypatch):
    """worker.service.service's monotonic clock, moved by hand (the event loop keeps the real one)."""
    now = [1000.0]
    monkeypatch.setattr(service_module, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                                perf_counter=time.perf_counter))
    return now


@pytest.fixture
def service(clock):
    settings = WorkerSettings(heartbeat_interval_s=1, heartbeat_ttl_s=6, engine_stall_s=120, served_model_name="m")
    return WorkerService(fakeredis.FakeAsyncRedis(decode_responses=True),
                         Threaded(NullEngine(batch_size=2, tokens_per_s=10), "null"), settings, "m")


async def test_ready_once_a_heartbeat_reached_redis_and_until_it_would_have_expired(service, clock):
    assert service.unready() == "no heartbeat written yet"
    await service.beat()
    assert service.unready() is None
    clock[0] += 6
    assert service.unready() is None
    clock[0] += 1  # past heartbeat_ttl_s: the scheduler and the api count the worker gone too
    assert service.unready() == "no heartbeat written for 7 s (heartbeat_ttl_s=6.0)"


async def test_a_stopping_worker_is_not_ready(service):
    await service.beat()
    service.stop()
    assert service.unready() == "stopping: it takes no new requests"


async def test_a_heartbeat_is_in_redis_with_the_ttl_and_a_stalled_worker_writes_none(service, clock):
    await service.beat()
    key = redis_keys.worker_heartbeat(service.settings.prefix, service.name)
    assert json.loads(await service.redis.get(key))["capacity"] == 2
    assert 5000 < await service.redis.pttl(key) <= 6000
    await service.redis.delete(key)
    clock[0] += 121  # the engine loop has not gone round for engine_stall_s
    with pytest.raises(EngineStalled):
        await service.beat()
    assert await service.redis.get(key) is None


def test_alive_until_the_loop_stops_going_round_for_engine_stall_s(service, clock):
    assert service.stalled() is None
    clock[0] += 120
    assert service.stalled() is None
    clock[0] += 1
    assert service.stalled() == "the engine loop has not gone round for 121 s (engine_stall_s=120.0)"


def test_the_metrics_port_answers_each_check_and_still_the_metrics():
    verdicts = {"/livez": None, "/readyz": "no heartbeat written yet"}
    metrics = WorkerMetrics()
    server = metrics.serve("127.0.0.1", 0, {path: (lambda p=path: verdicts[p]) for path in verdicts})
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        live, ready = httpx.get(f"{base}/livez"), httpx.get(f"{base}/readyz")
        assert (live.status_code, live.json()) == (200, {"status": "ok"})
        assert (ready.status_code, ready.json()) == (503, {"status": "unavailable",
                                                           "reason": "no heartbeat written yet"})
        verdicts["/readyz"] = None
        assert httpx.get(f"{base}/readyz").status_code == 200
        scraped = httpx.get(f"{base}/metrics")
        assert scraped.status_code == 200 and "streamq:num_requests_running" in scraped.text
    finally:
        server.shutdown()
        server.server_close()


def test_the_metrics_keep_their_names_when_a_scraper_asks_for_openmetrics():
    """Prometheus 2 asks for OpenMetrics first, where prometheus_client would write `streamq_`: the names
    the dashboard, the alerts and KEDA read must come whatever the Accept header."""
    server = WorkerMetrics().serve("127.0.0.1", 0)
    prometheus_2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    try:
        for accept in (prometheus_2, "*/*"):
            scraped = httpx.get(f"http://127.0.0.1:{server.server_port}/metrics", headers={"Accept": accept})
            assert scraped.headers["content-type"].startswith("text/plain;"), accept
            assert "\nstreamq:generation_tokens_total 0.0\n" in scraped.text and "streamq_" not in scraped.text, accept
    finally:
        server.shutdown()
        server.server_close()


def test_the_metrics_server_binds_ipv6_too():
    server = WorkerMetrics().serve("::1", 0, {"/livez": lambda: None})
    try:
        assert httpx.get(f"http://[::1]:{server.server_port}/livez").status_code == 200
    finally:
        server.shutdown()
        server.server_close()
