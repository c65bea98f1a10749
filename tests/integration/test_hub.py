"""The hub's reader task survives a crash: logged, restarted, and open streams carry on."""
import asyncio
import logging

import pytest

from api.core.hub import PubSubHub
from api.core.relay import Relay
from shared import redis_keys
from shared.messages import FinalEvent, FinishReason, RequestStatus, TokenEvent, Usage, encode_event
from shared.store import EVENT_FIELD, RequestStore
from tests.waiting import until

RID = "5e6f7a8b-1111-4222-8333-444455556666"


class CrashOnce:
    """Wraps the hub's pub/sub reads: once armed, it eats the next channel message and hands
    the reader a malformed one instead (no channel), as a bug in the reader's path would."""

    def __init__(self, pubsub):
        self._read = pubsub.get_message
        self.armed = False
        self.crashed = asyncio.Event()

    async def __call__(self, *args, **kwargs):
        message = await self._read(*args, **kwargs)
        if self.armed and message and message["type"] == "smessage" and not self.crashed.is_set():
            self.crashed.set()
            return {"type": "smessage", "data": message["data"]}
        return message


@pytest.fixture
async def hub(redis, prefix):
    hub = PubSubHub(redis, redis_keys.replica_channel(prefix, "test"), tick_s=30)
    hub.crash = CrashOnce(hub.pubsub)
    hub.pubsub.get_message = hub.crash  # before start(): the reader's first read goes through it
    await hub.start()
    yield hub
    await hub.close()


async def _emit(redis, prefix, event):
    data = encode_event(event)
    await redis.xadd(redis_keys.token_log(prefix, RID), {EVENT_FIELD: data})
    await redis.execute_command("SPUBLISH", redis_keys.request_channel(prefix, RID), data)


async def _subscribers(redis, prefix) -> int:
    return (await redis.execute_command("PUBSUB", "SHARDNUMSUB", redis_keys.request_channel(prefix, RID)))[1]


async def _one_subscriber(redis, prefix) -> bool:
    return await _subscribers(redis, prefix) == 1


async def test_a_crashed_reader_is_logged_and_restarted_and_streams_carry_on(redis, prefix, hub, caplog):
    received: asyncio.Queue = asyncio.Queue()

    async def follow():
        async for event in Relay(RequestStore(redis, prefix), hub).events(RID):
            if event is not None:
                await received.put(event)
                if isinstance(event, FinalEvent):
                    return

    async def next_event():
        return await asyncio.wait_for(received.get(), 10)

    stream = asyncio.create_task(follow())
    await until(lambda: _subscribers(redis, prefix), what="stream subscribed")
    await _emit(redis, prefix, TokenEvent(index=0, token_id=100, text="a"))
    assert (await next_event()).index == 0

    hub.crash.armed = True
    with caplog.at_level(logging.INFO, logger="api.core.hub"):
        # Token 1 is eaten by the crash; the restarted reader resyncs, and the stream reads it from the log.
        await _emit(redis, prefix, TokenEvent(index=1, token_id=101, text="b"))
        await asyncio.wait_for(hub.crash.crashed.wait(), 10)
        assert (await next_event()).index == 1
    crashes = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(crashes) == 1 and "reader task crashed" in crashes[0].getMessage()
    assert crashes[0].exc_info and crashes[0].exc_info[0] is KeyError  # with its traceback
    assert any("reconnected" in r.getMessage() for r in caplog.records)

    # Live again, on the restarted reader's new connection (the old one is gone): token 2 only on
    # the channel, never logged, so it can reach the stream only live.
    await until(lambda: _one_subscriber(redis, prefix), what="only the new connection subscribed")
    await redis.execute_command("SPUBLISH", redis_keys.request_channel(prefix, RID),
                                encode_event(TokenEvent(index=2, token_id=102, text="c")))
    assert (await next_event()).index == 2
    await _emit(redis, prefix, FinalEvent(status=RequestStatus.DONE, finish_reason=FinishReason.LENGTH,
                                          usage=Usage(prompt_tokens=1, completion_tokens=3)))
    assert isinstance(await next_event(), FinalEvent)
    await asyncio.wait_for(stream, 10)
    assert received.empty()  # nothing twice
    assert hub.channels == 0
