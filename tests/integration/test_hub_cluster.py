"""The api's pub/sub hub on a Redis Cluster: one connection per master, whatever the number of
streams, and every channel's messages reach its streams (sharded pub/sub)."""
import asyncio
import uuid
from contextlib import AsyncExitStack

import pytest
import redis

from api.core.hub import PubSubHub
from shared import redis_keys
from shared.redis_client import connect
from streamq.testing.redis_cluster import RedisCluster
from tests.waiting import until


@pytest.fixture
def cluster(tmp_path):
    cluster = RedisCluster(tmp_path, masters=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _pubsub_clients(node) -> int:
    with redis.Redis(port=node.port, decode_responses=True) as client:
        return len(client.client_list(_type="pubsub"))


def _channels(cluster, each: int) -> list[str]:
    """`each` request channels on every master."""
    by_master: dict[int, list[str]] = {n.port: [] for n in cluster.live()}
    while any(len(c) < each for c in by_master.values()):
        channel = redis_keys.request_channel("hubtest", str(uuid.uuid4()))
        by_master[cluster.master_of(channel).port].append(channel)
    return [c for chosen in by_master.values() for c in chosen[:each]]


async def test_one_connection_per_master_carries_every_stream(cluster):
    client = connect(cluster.url)
    hub = PubSubHub(client, redis_keys.replica_channel("hubtest", "r0"), tick_s=30)
    await hub.start()
    channels = _channels(cluster, 8)  # 8 streams on each master
    masters = {n.port for n in cluster.live()}
    try:
        async with AsyncExitStack() as streams:
            queues = [await streams.enter_async_context(hub.subscribe(c)) for c in channels]
            assert hub.channels == 24
            assert {port: _pubsub_clients(n) for n in cluster.live() if (port := n.port) in masters} == \
                dict.fromkeys(masters, 1)
            for i, channel in enumerate(channels):
                assert await client.execute_command("SPUBLISH", channel, f"event {i}") == 1
            for i, queue in enumerate(queues):
                assert await asyncio.wait_for(queue.get(), 10) == f"event {i}"
        assert hub.channels == 0
    finally:
        await hub.close()
        await client.aclose()


async def test_streams_opened_at_once_on_a_new_connection_all_get_their_messages(cluster):
    """A replica's first streams on a master open its connection together (a burst after a
    start): one connection, read by the hub, carries them all."""
    client = connect(cluster.url)
    hub = PubSubHub(client, redis_keys.replica_channel("hubtest", "r0"), tick_s=30)
    await hub.start()
    channels, opened, published = _channels(cluster, 4), [], asyncio.Event()

    async def stream(channel: str) -> str:
        async with hub.subscribe(channel) as queue:
            opened.append(channel)
            await published.wait()
            return await asyncio.wait_for(queue.get(), 10)
    try:
        streams = [asyncio.create_task(stream(c)) for c in channels]
        async def all_open() -> bool:
            return len(opened) == len(channels)
        await until(all_open, 10, "every stream confirmed by its master")
        assert {_pubsub_clients(n) for n in cluster.live()} == {1}
        for channel in channels:
            assert await client.execute_command("SPUBLISH", channel, channel) == 1
        published.set()
        assert await asyncio.gather(*streams) == channels
    finally:
        await hub.close()
        await client.aclose()


async def test_a_stream_whose_slot_moves_to_another_master_follows_it(cluster):
    """The slot of a subscribed channel is given to another master (a resharding): the old one
    unsubscribes the channel (sunsubscribe); the hub subscribes it on the new one, the stream
    is told to catch up from its log (RESYNC), and it hears the channel's messages again."""
    from api.core.hub import RESYNC

    client = connect(cluster.url)
    hub = PubSubHub(client, redis_keys.replica_channel("hubtest", "r0"), tick_s=30)
    await hub.start()
    channel = redis_keys.request_channel("hubtest", str(uuid.uuid4()))
    source = cluster.master_of(channel)
    target = next(n for n in cluster.live() if n is not source)
    try:
        async with hub.subscribe(channel) as queue:
            await client.execute_command("SPUBLISH", channel, "before")
            assert await asyncio.wait_for(queue.get(), 10) == "before"
            with redis.Redis(port=source.port, decode_responses=True) as old, \
                    redis.Redis(port=target.port, decode_responses=True) as new:
                slot = old.cluster("keyslot", channel)
                target_id = new.cluster("myid")
                new.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)  # no keys: no MIGRATE
                old.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            assert await asyncio.wait_for(queue.get(), 10) == RESYNC
            await until(lambda: _subscribed_on(target, channel), timeout_s=10, what="subscribed on the new master")
            await client.execute_command("SPUBLISH", channel, "after")  # MOVED, then to the new master
            assert await asyncio.wait_for(queue.get(), 10) == "after"
    finally:
        await hub.close()
        await client.aclose()


async def _subscribed_on(node, channel: str) -> bool:
    with redis.Redis(port=node.port, decode_responses=True) as client:
        return client.execute_command("PUBSUB", "SHARDNUMSUB", channel)[1] == 1
