"""Fixtures: a private redis-server for the session, tiny models, and real service processes."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from shared.redis_server import RedisServer
from shared.tokenizer import Tokenizer
from tests.stack import Stack
from streamq.testing.tiny_models import build_model


def pytest_configure(config):
    """Each test process, and every worker it starts, computes on its share of the cores: with
    two test processes on 2 cores, torch's two threads a process waited at every barrier for a
    core the other process held (one case of the default model's deterministic set, bf16 on a
    2-core Xeon, took 40 s with one core busy beside it, 14 s on one thread). An OMP_NUM_THREADS
    already set is kept.
    tests/unit/test_quant_kernels.py runs the kernels on several threads explicitly."""
    if "PYTEST_XDIST_WORKER" not in os.environ and getattr(config.option, "numprocesses", None):
        return  # pytest-xdist's controller, which runs no test: its test processes choose
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // processes)))
    import torch
    torch.set_num_threads(int(threads))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    url = server.start()
    yield url
    server.stop()


@pytest_asyncio.fixture
async def redis(redis_url) -> Redis:
    """A client on the session's Redis, flushed before each test."""
    client = Redis.from_url(redis_url, decode_responses=True)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture
def counted_tokenizer(tiny_llama):
    """The tiny llama's tokenizer, and the names of its encode calls as they are made (a test
    that a request was refused before its prompt was tokenized reads them)."""
    tokenizer = Tokenizer(tiny_llama)
    calls = []
    for name in ("encode", "encode_chat"):
        method = getattr(tokenizer, name)
        setattr(tokenizer, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    return tokenizer, calls


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny-opt"), "opt")


@pytest.fixture(scope="module")
def stack(redis_url, tiny_llama, tmp_path_factory) -> Stack:
    """One worker (batch 8) and two api replicas on the tiny llama model."""
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("stack"), replicas=2) as running:
        yield running
