"""A stream survives a Redis restart: it waits for Redis, then reads what it missed from the log.

Each test runs its own redis-server (AOF, fsync always) so it can kill it.
"""
import asyncio
import weakref

import pytest
from redis.exceptions import BusyLoadingError

from api.core.hub import PubSubHub
from api.core.relay import Relay
from shared import redis_keys
from shared.messages import (
    FinalEvent,
    FinishReason,
    RequestStatus,
    TokenEvent,
    Usage,
    encode_event,
)
from shared.redis_client import connect
from shared.redis_server import RedisServer
from shared.store import EVENT_FIELD, RequestStore
from tests.waiting import until

RID = "0b1c2d3e-1111-4222-8333-444455556666"
PREFIX = "outage"


@pytest.fixture
async def server(tmp_path):
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always")
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def relay(server):
    client = connect(server.url)
    hub = PubSubHub(client, redis_keys.replica_channel(PREFIX, "test"), tick_s=30)
    await hub.start()
    yield Relay(RequestStore(client, PREFIX), hub)
    await hub.close()
    await client.aclose()


async def _emit(server, event, publish=True):
    """Write to the token log (and publish), as the worker does, on a fresh connection."""
    client = connect(server.url)
    data = encode_event(event)
    await client.xadd(redis_keys.token_log(PREFIX, RID), {EVENT_FIELD: data})
    if publish:
        await client.execute_command("SPUBLISH", redis_keys.request_channel(PREFIX, RID), data)
    await client.aclose()


def _token(i):
    return TokenEvent(index=i, token_id=100 + i, text=f"t{i} ")


def _final(n):
    return FinalEvent(status=RequestStatus.DONE, finish_reason=FinishReason.LENGTH,
                      usage=Usage(prompt_tokens=1, completion_tokens=n))


async def test_events_missed_by_pubsub_come_from_the_log_once_the_connection_is_back(server, relay):
    task, received = await _follow(server, relay)
    # Logged, never seen on the channel (as when published while the connection was down) ...
    for i in (1, 2):
        await _emit(server, _token(i), publish=False)
    await _emit(server, _final(3), publish=False)
    # ... then the connection drops and comes back: the stream must catch up by itself.
    await _kill_pubsub_connections(server)
    await asyncio.wait_for(task, 30)
    assert [e.index for e in received[:-1]] == [0, 1, 2]
    assert isinstance(received[-1], FinalEvent)


async def test_streams_carry_on_after_redis_restarts(server, relay):
    task, received = await _follow(server, relay)
    await asyncio.to_thread(server.crash_and_restart)
    await _emit(server, _token(1), publish=False)  # written before or after the hub is back: either way
    await until(lambda: _subscribed(server), what="subscribed again")
    await _emit(server, _token(2))
    await _emit(server, _final(3))
    await asyncio.wait_for(task, 30)
    assert [e.index for e in received[:-1]] == [0, 1, 2]


async def _follow(server, relay) -> tuple[asyncio.Task, list]:
    """A stream of RID that has received token 0 live; the task ends at the final event."""
    received: list = []

    async def collect():
        async for event in relay.events(RID):
            if event is not None:
                received.append(event)
                if isinstance(event, FinalEvent):
                    return

    task = asyncio.create_task(collect())
    await until(lambda: _subscribed(server), what="stream subscribed")
    await _emit(server, _token(0))
    await until(lambda: _true(len(received) == 1), what="token 0 delivered live")
    return task, received


async def _kill_pubsub_connections(server):
    admin = connect(server.url)
    await admin.client_kill_filter(_type="pubsub")
    await admin.aclose()


async def test_a_stream_opened_while_redis_is_down_waits_for_it(server, relay):
    await _emit(server, _token(0))
    server.kill()
    task = asyncio.create_task(_collect(relay))
    await until(lambda: _true(relay.hub.channels == 1), what="the stream is waiting for redis")
    await asyncio.to_thread(server.start)
    await _emit(server, _token(1))
    await _emit(server, _final(2))
    events = await asyncio.wait_for(task, 30)
    assert [e.index for e in events[:-1]] == [0, 1]
    assert isinstance(events[-1], FinalEvent)


async def _collect(relay):
    return [e async for e in relay.events(RID) if e is not None]


async def _subscribed(server):
    client = connect(server.url)
    try:
        return (await client.execute_command("PUBSUB", "SHARDNUMSUB", redis_keys.request_channel(PREFIX, RID)))[1] > 0
    finally:
        await client.aclose()


async def _true(value):
    return value


class _FailOnce:
    """A connect callback that fails the first reconnection, as Redis answers while it still
    loads its AOF: the socket is open, but nothing was subscribed on it."""

    def __init__(self):
        self.calls = 0

    async def __call__(self, connection):
        self.calls += 1
        if self.calls == 1:
            raise BusyLoadingError("Redis is loading the dataset in memory")


async def test_a_reconnection_whose_resubscription_failed_is_made_again(server, relay):
    task, received = await _follow(server, relay)
    fail_once = _FailOnce()
    fail_once.method = fail_once.__call__  # a bound method, kept alive: redis-py holds it weakly
    relay.hub.pubsub.connection._connect_callbacks.insert(0, weakref.WeakMethod(fail_once.method))
    for i in (1, 2):
        await _emit(server, _token(i), publish=False)
    await _emit(server, _final(3), publish=False)
    await _kill_pubsub_connections(server)
    await asyncio.wait_for(task, 30)
    assert fail_once.calls >= 2  # the failed reconnection was made again
    assert [e.index for e in received[:-1]] == [0, 1, 2]
