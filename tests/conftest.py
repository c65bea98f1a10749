"""Fixtures: a private redis-server for the session, tiny models, and real service processes."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from shared.redis_server import RedisServer
from tests.stack import Stack
from tests.tiny_models import build_model


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


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny-opt"), "opt")


@pytest.fixture(scope="module")
def stack(redis_url, tiny_llama, tmp_path_factory) -> Stack:
    """One worker (batch 8) and two api replicas on the tiny llama model."""
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("stack"), replicas=2) as running:
        yield running
