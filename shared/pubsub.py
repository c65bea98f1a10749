"""Sharded pub/sub (SSUBSCRIBE, Redis 7), on one Redis and on a Redis Cluster.

Every channel is published with SPUBLISH. On a cluster a sharded message goes to the nodes of
its channel's slot only (a classic PUBLISH goes to every node), so pub/sub traffic spreads over
the shards as the keys do; a subscriber holds one connection to each master whose channels it
reads. On one Redis the same commands work, on one connection.

redis-py 5's asyncio PubSub has no sharded commands: `ShardPubSub` is that PubSub speaking
SSUBSCRIBE/SUNSUBSCRIBE. Its messages have the types "ssubscribe", "smessage" and "sunsubscribe".
"""
from __future__ import annotations

import asyncio

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster

SUBSCRIBED, MESSAGE, UNSUBSCRIBED = "ssubscribe", "smessage", "sunsubscribe"

# Options of a cluster client's connections that a plain connection does not take, or should not:
# its parser is a pure-Python one (hiredis parses faster), its pool size is per node.
_CLUSTER_ONLY = ("response_callbacks", "parser_class", "max_connections")


class ShardPubSub(PubSub):
    PUBLISH_MESSAGE_TYPES = ("message", "pmessage", MESSAGE)
    UNSUBSCRIBE_MESSAGE_TYPES = ("unsubscribe", "punsubscribe", UNSUBSCRIBED)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._connecting = asyncio.Lock()

    async def connect(self) -> None:
        """One connection however many subscribes open it at once (a cluster master's first
        streams): redis-py's connect awaits the pool between its check and its assignment, so
        each would open its own, and the channels of all but the last go unread.

        Only that first opening holds the lock. A reconnection runs on_connect, which subscribes
        again through execute_command and so comes back here: under the lock, it would wait for
        itself (a Redis restart left every new stream hanging)."""
        if self.connection is None:
            async with self._connecting:
                if self.connection is None:
                    await super().connect()
                    return
        await super().connect()

    async def execute_command(self, *args):
        if args[0] in ("SUBSCRIBE", "UNSUBSCRIBE"):  # what subscribe() and unsubscribe() send
            args = (f"S{args[0]}", *args[1:])
        return await super().execute_command(*args)

    async def on_connect(self, connection) -> None:
        """After a reconnection, subscribe again one channel per command: on a cluster, one
        SSUBSCRIBE of channels in several slots is refused (CROSSSLOT)."""
        self.pending_unsubscribe_channels.clear()
        for channel in [self.encoder.decode(c, force=True) for c in self.channels]:
            await self.subscribe(channel)


def node_of(redis: Redis | RedisCluster, channel: str) -> str:
    """The name of the node that serves `channel` ("host:port" on a cluster, "redis" otherwise),
    by the cluster client's current map of the slots."""
    if isinstance(redis, RedisCluster):
        return redis.get_node_from_key(channel).name
    return "redis"


def pubsub_on(redis: Redis | RedisCluster, node: str) -> ShardPubSub:
    """A pub/sub connection (not yet open) to `node`, as node_of names it."""
    if not isinstance(redis, RedisCluster):
        return ShardPubSub(redis.connection_pool)
    host, _, port = node.rpartition(":")
    options = {k: v for k, v in redis.connection_kwargs.items() if k not in _CLUSTER_ONLY}
    return ShardPubSub(ConnectionPool(**{**options, "host": host, "port": int(port)}))


async def refresh(redis: Redis | RedisCluster) -> None:
    """Ask the cluster for its map of the slots again (after a node was lost: a replica may now
    hold its slots). Nothing to do on one Redis."""
    if isinstance(redis, RedisCluster):
        await redis.nodes_manager.initialize()


async def close_pubsub(redis: Redis | RedisCluster, pubsub: ShardPubSub) -> None:
    """Close a connection from pubsub_on (and, on a cluster, its own pool to the node)."""
    await pubsub.aclose()
    if isinstance(redis, RedisCluster):
        await pubsub.connection_pool.disconnect()
