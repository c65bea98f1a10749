"""The scheduler's supervisor against a real Redis: whatever Redis error ends arq's worker (the
WatchError arq's start_jobs raises when its connection drops under a WATCH, a ResponseError, a
lost connection), a fresh worker takes over and the scheduler lives on."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, WatchError

import scheduler.main
from scheduler.main import supervise
from shared.settings import SchedulerSettings
from tests.waiting import until

ERRORS = [
    WatchError("A ConnectionError occurred on while watching one or more keys"),
    ResponseError("LOADING Redis is loading the dataset in memory"),
    RedisConnectionError("Connection closed by server."),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
async def test_any_redis_error_of_arqs_worker_starts_a_fresh_one(redis_url, prefix, monkeypatch, error):
    started: list[object] = []
    serving = asyncio.Event()

    class Worker:
        """arq's Worker as the supervisor sees it: the first one's main() fails with `error`."""
        def __init__(self):
            self.tasks, self.ctx = {}, {}

        async def main(self) -> None:
            if len(started) == 1:
                raise error
            serving.set()
            await asyncio.Event().wait()  # runs until cancelled

    def create_worker(cls, redis_pool, handle_signals):
        started.append(Worker())
        return started[-1]

    monkeypatch.setattr(scheduler.main, "create_worker", create_worker)
    settings = SchedulerSettings(redis_url=redis_url, prefix=prefix, served_model_name="m")
    running = asyncio.create_task(supervise(settings))
    try:
        async def restarted() -> bool:
            return serving.is_set() or running.done()
        await until(restarted, 30, "a second arq worker after the first one's error")
        assert not running.done(), f"the supervisor ended: {running.exception()!r}"
        assert len(started) == 2
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
