"""shared/pubsub.py's ShardPubSub on a real Redis."""
import asyncio

from shared.pubsub import MESSAGE, pubsub_on


async def test_first_subscribes_at_once_share_one_connection(redis, prefix):
    """A hub opens a cluster master's connection on its first subscribe, often for several
    streams at once: every channel must be on the one connection its reader reads."""
    pubsub = pubsub_on(redis, "redis")  # not yet connected, as for a master's first streams
    channels = [f"{prefix}:ch{i}" for i in range(3)]
    try:
        await asyncio.gather(*(pubsub.subscribe(c) for c in channels))
        for c in channels:
            await redis.execute_command("SPUBLISH", c, c)
        heard = set()
        while len(heard) < len(channels):
            message = await asyncio.wait_for(pubsub.get_message(timeout=None), 5)
            if message and message["type"] == MESSAGE:
                heard.add(message["data"])
        assert heard == set(channels)
    finally:
        await pubsub.aclose()


async def test_a_subscribe_after_the_connection_dropped_reconnects_it(redis, prefix):
    """The hub drops a lost connection's socket; the next subscribe opens it again, and redis-py
    subscribes it to the earlier channels on the way (through this same connect: it must not wait
    for itself, as a lock held over every connect did)."""
    pubsub = pubsub_on(redis, "redis")
    try:
        await pubsub.subscribe(f"{prefix}:before")
        await pubsub.connection.disconnect()  # what the hub does once it sees the connection lost
        await asyncio.wait_for(pubsub.subscribe(f"{prefix}:after"), 10)
        await redis.execute_command("SPUBLISH", f"{prefix}:before", "b")
        await redis.execute_command("SPUBLISH", f"{prefix}:after", "a")
        heard = set()
        while len(heard) < 2:
            message = await asyncio.wait_for(pubsub.get_message(timeout=None), 5)
            if message and message["type"] == MESSAGE:
                heard.add(message["data"])
        assert heard == {"a", "b"}
    finally:
        await pubsub.aclose()
