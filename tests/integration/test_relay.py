"""The relay merges the token log and the live channel: every event once, in order."""
import asyncio

import pytest

from api.core.hub import PubSubHub
from api.core.relay import Relay
from shared import redis_keys
from shared.messages import FinalEvent, FinishReason, RequestStatus, TokenEvent, Usage, encode_event
from shared.store import EVENT_FIELD, RequestStore
from tests.waiting import until

RID = "9a7c2a8e-1111-4222-8333-444455556666"


@pytest.fixture
async def relay(redis, prefix):
    hub = PubSubHub(redis, redis_keys.replica_channel(prefix, "test"), tick_s=30)
    await hub.start()
    yield Relay(RequestStore(redis, prefix), hub)
    await hub.close()


def _token(i):
    return TokenEvent(index=i, token_id=100 + i, text=f"t{i} ")


def _final(n):
    return FinalEvent(status=RequestStatus.DONE, finish_reason=FinishReason.LENGTH,
                      usage=Usage(prompt_tokens=1, completion_tokens=n))


async def _emit(redis, prefix, event, log=True, publish=True):
    data = encode_event(event)
    if log:
        await redis.xadd(redis_keys.token_log(prefix, RID), {EVENT_FIELD: data})
    if publish:
        await redis.execute_command("SPUBLISH", redis_keys.request_channel(prefix, RID), data)


async def _subscribed(redis, prefix):
    """Return once Redis itself reports the relay's subscription to the request channel."""
    channel = redis_keys.request_channel(prefix, RID)

    async def check():
        return (await redis.execute_command("PUBSUB", "SHARDNUMSUB", channel))[1] > 0
    await until(check, what="relay subscribed")


async def _collect(relay, after=-1):
    out = []
    async for event in relay.events(RID, after):
        if event is not None:
            out.append(event)
    return out


async def test_log_then_live_without_repeats(redis, prefix, relay):
    for i in range(3):
        await _emit(redis, prefix, _token(i), publish=False)
    task = asyncio.create_task(_collect(relay))
    await _subscribed(redis, prefix)
    # Publish an event that is also in the log: it must not be delivered twice.
    await _emit(redis, prefix, _token(2), log=False)
    for i in range(3, 6):
        await _emit(redis, prefix, _token(i))
    await _emit(redis, prefix, _final(6))
    events = await asyncio.wait_for(task, 10)
    assert [e.index for e in events[:-1]] == list(range(6))
    assert isinstance(events[-1], FinalEvent)
    assert relay.hub.channels == 0  # unsubscribed when done


async def test_resume_from_the_middle(redis, prefix, relay):
    for i in range(5):
        await _emit(redis, prefix, _token(i))
    await _emit(redis, prefix, _final(5))
    events = await asyncio.wait_for(_collect(relay, after=2), 10)
    assert [e.index for e in events[:-1]] == [3, 4]
    assert isinstance(events[-1], FinalEvent)


async def test_a_missed_live_message_is_filled_from_the_log(redis, prefix, relay):
    task = asyncio.create_task(_collect(relay))
    await _subscribed(redis, prefix)
    await _emit(redis, prefix, _token(0))
    await _emit(redis, prefix, _token(1), publish=False)  # lost on the way, as on a dropped connection
    await _emit(redis, prefix, _token(2))
    await _emit(redis, prefix, _token(3), publish=False)
    await _emit(redis, prefix, _final(4))
    events = await asyncio.wait_for(task, 10)
    assert [e.index for e in events[:-1]] == [0, 1, 2, 3]


async def test_an_index_logged_or_published_twice_is_sent_once_as_first_logged(redis, prefix, relay):
    """A takeover's log may hold an index twice (a retried publish of the worker that ran it, a
    token of the paused one written before the claim): each index reaches the client once, the
    first logged, from the log, live, or in the catch-up that fills a gap."""
    await _emit(redis, prefix, _token(0), publish=False)
    for _ in range(2):
        await _emit(redis, prefix, _token(1), publish=False)
    task = asyncio.create_task(_collect(relay))
    await _subscribed(redis, prefix)
    await _emit(redis, prefix, TokenEvent(index=1, token_id=901, text="late "))  # an index it has, live
    await _emit(redis, prefix, _token(2), publish=False)  # lost live: the next one's gap brings it from the log
    await _emit(redis, prefix, TokenEvent(index=0, token_id=900, text="late "), publish=False)
    await _emit(redis, prefix, _token(3))
    await _emit(redis, prefix, TokenEvent(index=3, token_id=903, text="late "))
    await _emit(redis, prefix, _final(4))
    events = await asyncio.wait_for(task, 10)
    assert [(e.index, e.token_id) for e in events[:-1]] == [(i, 100 + i) for i in range(4)]
    assert isinstance(events[-1], FinalEvent)
    resumed = await asyncio.wait_for(_collect(relay, after=1), 10)  # Last-Event-ID: 1, on any replica
    assert [(e.index, e.token_id) for e in resumed[:-1]] == [(2, 102), (3, 103)]


async def test_many_streams_share_the_hub_connection(redis, prefix, relay):
    tasks = [asyncio.create_task(_collect(relay)) for _ in range(20)]
    await _subscribed(redis, prefix)
    clients = await redis.client_list(_type="pubsub")
    assert len(clients) == 1  # one pub/sub connection for all 20 streams
    for i in range(3):
        await _emit(redis, prefix, _token(i))
    await _emit(redis, prefix, _final(3))
    for events in await asyncio.wait_for(asyncio.gather(*tasks), 10):
        assert [e.index for e in events[:-1]] == [0, 1, 2]


async def test_a_quiet_stream_gets_keepalives_from_the_hub_tick(redis, prefix):
    hub = PubSubHub(redis, redis_keys.replica_channel(prefix, "tick"), tick_s=0.05)
    await hub.start()
    relay = Relay(RequestStore(redis, prefix), hub)
    events = relay.events(RID)
    first = await asyncio.wait_for(events.__anext__(), 10)
    assert first is None  # a keepalive, with nothing published
    await events.aclose()
    await hub.close()


@pytest.fixture
async def quick_relay(redis, prefix):
    """A relay whose streams look at the record after 0.05 s without an event (ticks every 0.01 s)."""
    hub = PubSubHub(redis, redis_keys.replica_channel(prefix, "quick"), tick_s=0.01)
    await hub.start()
    yield Relay(RequestStore(redis, prefix), hub, idle_s=0.05)
    await hub.close()


async def _record(redis, prefix, **fields):
    await redis.hset(redis_keys.request_record(prefix, RID), mapping={"status": "running", "prompt_tokens": 4,
                                                                      "model": "m", **fields})


async def test_a_stream_whose_final_event_was_lost_ends_with_the_records(redis, prefix, quick_relay):
    """The record says done (its final event lost with a failed-over master): the stream ends with
    the record's status, reason and counts after the tokens the log has."""
    await _record(redis, prefix, status="done", finish_reason="length", completion_tokens=2, reused_tokens=1)
    await _emit(redis, prefix, _token(0), publish=False)
    events = await asyncio.wait_for(_collect(quick_relay), 30)
    assert events[:-1] == [_token(0)]
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.status == RequestStatus.DONE
    assert final.finish_reason == FinishReason.LENGTH
    assert final.usage == Usage(prompt_tokens=4, completion_tokens=2, cached_tokens=1)


async def test_a_stream_whose_record_is_gone_ends_with_an_error(redis, prefix, quick_relay):
    events = await asyncio.wait_for(_collect(quick_relay), 30)
    [final] = events
    assert final.status == RequestStatus.FAILED and "record is gone" in final.error


async def test_a_running_request_is_waited_for_past_the_idle_deadline(redis, prefix, quick_relay):
    await _record(redis, prefix)
    stream = quick_relay.events(RID)
    quiet = 0
    async for event in stream:  # keepalives, one a tick, well past several idle deadlines
        assert event is None
        quiet += 1
        if quiet == 30:
            break
    await _emit(redis, prefix, _token(0))
    await _emit(redis, prefix, _final(1))
    rest = [e async for e in stream if e is not None]
    await stream.aclose()
    assert rest == [_token(0), _final(1)]
