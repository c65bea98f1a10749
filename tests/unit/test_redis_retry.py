"""until_redis_answers: redis-py's Retry with backoff, giving up on a clock or when told to."""
import logging

import pytest
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from shared.redis_client import until_redis_answers


class Flaky:
    """A call that fails `failures` times with `error`, then answers."""

    def __init__(self, failures: int, error: Exception | None = None):
        self.failures, self.error, self.calls = failures, error or ConnectionError("down"), 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "answer"


async def test_it_retries_until_redis_answers_backing_off_from_a_tenth_of_a_second(caplog):
    call = Flaky(3, TimeoutError("slow"))
    with caplog.at_level(logging.WARNING):
        assert await until_redis_answers("x", call, logging.getLogger("t")) == "answer"
    assert call.calls == 4
    assert [r.getMessage().rsplit("retrying in ", 1)[1] for r in caplog.records] == ["0.1 s", "0.2 s", "0.4 s"]


async def test_it_gives_up_once_the_time_is_spent():
    call = Flaky(100)
    with pytest.raises(ConnectionError):
        await until_redis_answers("x", call, logging.getLogger("t"), give_up_after_s=0.25)
    assert call.calls == 2  # waited 0.1 s; a further 0.2 s would pass the limit


async def test_it_gives_up_when_told_to_after_a_failure():
    call = Flaky(100)
    with pytest.raises(ConnectionError):
        await until_redis_answers("x", call, logging.getLogger("t"), give_up=lambda: True)
    assert call.calls == 1


async def test_other_errors_are_not_retried():
    call = Flaky(1, ResponseError("WRONGTYPE"))
    with pytest.raises(ResponseError):
        await until_redis_answers("x", call, logging.getLogger("t"))
    assert call.calls == 1
