"""One pub/sub connection per shard per api replica, fanning events out to all of its open streams.

A stream subscribes to its request's channel through the hub; the first subscriber of a
channel makes the hub SSUBSCRIBE (sharded pub/sub, shared/pubsub.py), the last one leaving
makes it SUNSUBSCRIBE. On one Redis there is one connection; on a Redis Cluster, one to each
master whose slots hold a subscribed channel. One reader task per connection reads it and puts
each message on the queues of that channel. Every `tick_s` the hub also puts TICK on every
queue, so a quiet stream can send a keepalive without a timer per stream (a timeout per
awaited message costs more than the message).

When the connection drops (a Redis restart), redis-py reconnects it and subscribes again to
every channel; what was published in between is lost. So once the connection is back the hub
puts RESYNC on every queue, and each stream reads what it missed from the token log. On a
cluster, a lost connection may be a master that failed over: the hub asks the cluster for its
slots again, subscribes each of that connection's channels where its slot now is, and resyncs
those streams. A channel whose slot moved (the server unsubscribes it) is moved the same way.

If a reader task crashes (anything but a lost connection), its done-callback logs the error
and starts it again on a fresh connection: the crash may have eaten a message, a subscribe
confirmation or half a reply. The subscribers stay; redis-py subscribes the new connection to
every channel, and the streams resync from their logs as after a reconnection.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress

from redis.asyncio import Redis
from redis.exceptions import RedisClusterException

from shared.pubsub import MESSAGE, SUBSCRIBED, UNSUBSCRIBED, ShardPubSub, close_pubsub, node_of, pubsub_on, refresh
from shared.redis_client import REDIS_DOWN, is_cluster, until_redis_answers

log = logging.getLogger(__name__)

TICK = ""  # put on every queue each tick_s; never a real message (those are JSON)
RESYNC = "resync"  # put on every queue after a reconnection: messages may have been lost
OUTAGE_S = 60.0  # how long a stream waits for Redis to come back before it gives up
RETRY_MAX_S = 2.0  # the longest pause between reconnection tries, and between restarts of a crashing task


class _Shard:
    """One pub/sub connection (to the one Redis, or to one master of a cluster) and its reader."""

    def __init__(self, node: str, pubsub: ShardPubSub):
        self.node = node
        self.pubsub = pubsub
        self.crashes = 0  # reader crashes since it last handled a message: spaces the restarts
        self.restart: asyncio.TimerHandle | None = None
        self.retired = False  # its channels moved to other connections (a cluster node was lost)
        self.reader: asyncio.Task[None] | None = None


class PubSubHub:
    def __init__(self, redis: Redis, home_channel: str, tick_s: float = 15.0):
        self._redis = redis
        self._cluster = is_cluster(redis)
        self._home = home_channel  # one Redis: always subscribed, so the connection always has a subscription
        self._tick_s = tick_s
        self._queues: dict[str, set[asyncio.Queue[str]]] = {}
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        self._shards: dict[str, _Shard] = {}
        self._shard_of: dict[str, _Shard] = {}  # subscribed channel -> its connection
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        if not self._cluster:
            self._shards["redis"] = _Shard("redis", pubsub_on(redis, "redis"))

    @property
    def pubsub(self) -> ShardPubSub:
        """The hub's pub/sub connection on a single Redis (on a cluster it holds one a shard, made
        as channels need them): what it reads every channel through, and where a fault can be
        injected to test the recovery."""
        if self._cluster:
            raise AttributeError("a hub on a Redis Cluster holds one pub/sub connection a shard")
        return self._shards["redis"].pubsub

    async def start(self) -> None:
        if self._cluster:
            await self._redis.initialize()  # the map of the slots, to route channels by
        else:
            await self.pubsub.subscribe(self._home)
            self._run_reader(self._shards["redis"])
        self._run("ticker", self._tick)

    async def close(self) -> None:
        self._closing = True
        for shard in self._shards.values():
            if shard.restart is not None:
                shard.restart.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for shard in list(self._shards.values()):
            await self._close_shard(shard)

    def _run(self, name: str, loop: Callable[[], Awaitable[None]], shard: _Shard | None = None) -> asyncio.Task:
        task = asyncio.create_task(loop(), name=f"pubsub-{name}")
        task.add_done_callback(lambda done: self._ended(done, name, shard))
        self._tasks.add(task)
        return task

    def _run_reader(self, shard: _Shard, fresh: bool = False) -> None:
        name = f"reader {shard.node}" if self._cluster else "reader"
        shard.reader = self._run(name, lambda: self._read(shard, fresh), shard)

    def _ended(self, task: asyncio.Task[None], name: str, shard: _Shard | None) -> None:
        """The ticker runs until close(), a reader until its shard retires: any other end is a
        crash, logged, and the task restarted. (A move ends when done; its errors are logged.)"""
        self._tasks.discard(task)
        if self._closing or task.cancelled() or (shard is not None and shard.retired):
            return
        error = task.exception()
        if name.startswith("move"):
            if error is not None:
                log.error("pub/sub %s crashed (%s: %s)", name, type(error).__name__, error, exc_info=error)
            return
        log.error("pub/sub %s task %s; restarting it", name,
                  f"crashed ({type(error).__name__}: {error})" if error else "ended", exc_info=error)
        if shard is None:  # the ticker: it sleeps tick_s before it can fail again
            self._run(name, self._tick)
            return
        shard.crashes += 1  # the first restart is at once; a reader that keeps crashing, spaced out
        delay = 0.0 if shard.crashes == 1 else min(RETRY_MAX_S, 0.1 * 2 ** (shard.crashes - 2))
        shard.restart = asyncio.get_running_loop().call_later(delay, self._restart_reader, shard)

    def _restart_reader(self, shard: _Shard) -> None:
        if not self._closing and not shard.retired:
            self._run_reader(shard, fresh=True)

    @property
    def channels(self) -> int:
        """How many request channels are subscribed now (for tests and metrics)."""
        return len(self._queues)

    @asynccontextmanager
    async def subscribe(self, channel: str) -> AsyncIterator[asyncio.Queue[str]]:
        """A queue of this channel's messages, live from the moment the context is entered."""
        queue: asyncio.Queue[str] = asyncio.Queue()
        subscribers = self._queues.setdefault(channel, set())
        subscribers.add(queue)
        try:
            if len(subscribers) == 1:
                self._confirmed[channel] = asyncio.get_running_loop().create_future()
                await until_redis_answers("subscribe", lambda: self._subscribe(channel), log, OUTAGE_S)
            # Wait for Redis to confirm, so nothing published after this point is missed.
            await asyncio.wait_for(asyncio.shield(self._confirmed[channel]), OUTAGE_S)
            yield queue
        finally:
            subscribers.discard(queue)
            if not subscribers and self._queues.get(channel) is subscribers:
                del self._queues[channel]
                self._confirmed.pop(channel, None)
                shard = self._shard_of.pop(channel, None)
                if shard is not None and not shard.retired:
                    try:
                        await shard.pubsub.unsubscribe(channel)
                    except REDIS_DOWN:  # still subscribed after the reconnection: dropped at the resync
                        pass

    async def _subscribe(self, channel: str) -> None:
        """SSUBSCRIBE `channel` on the connection to the node that serves it now (opened on first use)."""
        node = node_of(self._redis, channel)
        shard = self._shards.get(node)
        if shard is None:
            shard = self._shards[node] = _Shard(node, pubsub_on(self._redis, node))
        self._shard_of[channel] = shard
        try:
            await shard.pubsub.subscribe(channel)
        except REDIS_DOWN:
            if shard.reader is None:  # never opened: the next try starts afresh
                self._shard_of.pop(channel, None)
                self._shards.pop(node, None)
                await self._close_shard(shard)
            if self._cluster:  # perhaps a master that failed over: the next try routes by a fresh map
                with suppress(*REDIS_DOWN, RedisClusterException):
                    await refresh(self._redis)
            raise
        if shard.reader is None:
            self._run_reader(shard)

    async def _move(self, channels: list[str]) -> None:
        """Subscribe `channels` where their slots are now (a cluster node was lost, or a slot
        moved), asking the cluster for its map of the slots again until that works; then their
        streams catch up from their logs."""
        delay = 0.1
        while not self._closing:
            channels = [c for c in channels if c in self._queues]
            try:
                await refresh(self._redis)
                for channel in channels:
                    await self._subscribe(channel)
                break
            except (*REDIS_DOWN, RedisClusterException) as exc:
                log.warning("pub/sub: %d channels wait for the cluster (%s); again in %.1f s", len(channels), exc,
                            delay)
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
        log.info("pub/sub: %d streams moved to their slots' nodes catch up from their logs", len(channels))
        for channel in channels:
            for queue in self._queues.get(channel, ()):
                queue.put_nowait(RESYNC)

    async def _retire(self, shard: _Shard) -> None:
        """A cluster node's connection is lost: its channels go where their slots are now."""
        shard.retired = True
        if self._shards.get(shard.node) is shard:
            del self._shards[shard.node]
        await self._close_shard(shard)
        await self._move([c for c, s in list(self._shard_of.items()) if s is shard])

    async def _resync(self, shard: _Shard) -> None:
        for channel, queues in list(self._queues.items()):
            if self._shard_of.get(channel) is shard:
                for queue in queues:
                    queue.put_nowait(RESYNC)
        stale = [c for c in shard.pubsub.channels if c != self._home and self._shard_of.get(c) is not shard]
        if stale:  # left while Redis was down
            try:
                await shard.pubsub.unsubscribe(*stale)
            except REDIS_DOWN:
                pass

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            for queues in list(self._queues.values()):
                for queue in queues:
                    queue.put_nowait(TICK)

    async def _read(self, shard: _Shard, fresh: bool = False) -> None:
        """Relay every message to its channel's queues. `fresh`: after a crash, start from a new
        connection (redis-py subscribes it to every channel) and resync every stream."""
        # The reconnection is by hand, not a redis-py Retry: between tries it must drop the socket,
        # and the first message on the new connection must resync every stream.
        delay = 0.0  # > 0 while the connection is down
        if fresh:
            await self._disconnect(shard)
            delay = 0.1
        while True:
            try:
                message = await shard.pubsub.get_message(timeout=None)  # block: no timer per message
            except REDIS_DOWN as exc:  # redis-py reconnects the pubsub at the next read
                if self._cluster:  # perhaps a master that failed over: go where the slots are now
                    log.warning("pub/sub connection to %s lost (%s: %s)", shard.node, type(exc).__name__, exc)
                    await self._retire(shard)
                    return
                delay = min(RETRY_MAX_S, delay * 2 or 0.1)
                log.warning("pub/sub connection lost (%s: %s); reconnecting in %.1f s", type(exc).__name__, exc, delay)
                # Start the next try from a closed socket: a reconnect whose resubscription failed
                # (Redis still loading its AOF) would otherwise look connected, subscribed to nothing.
                await self._disconnect(shard)
                await asyncio.sleep(delay)
                continue
            if message is None:
                continue
            if delay:  # the first answer on the new connection: resubscribed to every channel
                delay = 0.0
                log.info("pub/sub reconnected; its streams catch up from their logs")
                await self._resync(shard)
            self._dispatch(shard, message)
            shard.crashes = 0

    def _dispatch(self, shard: _Shard, message: dict) -> None:
        """One message of `shard`'s connection: a subscription confirmed, a message for the
        channel's queues, or a channel unsubscribed by Redis (its slot moved away)."""
        channel = message["channel"]
        if message["type"] == SUBSCRIBED:
            future = self._confirmed.get(channel)
            if future is not None and not future.done():
                future.set_result(None)
        elif message["type"] == MESSAGE:
            for queue in self._queues.get(channel, ()):
                queue.put_nowait(message["data"])
        elif message["type"] == UNSUBSCRIBED and self._shard_of.get(channel) is shard:
            # Not ours (we forget a channel before we unsubscribe it): its slot moved away.
            shard.pubsub.channels.pop(channel, None)
            del self._shard_of[channel]
            self._run(f"move {channel}", lambda c=channel: self._move([c]))

    async def _disconnect(self, shard: _Shard) -> None:
        if shard.pubsub.connection is not None:
            await shard.pubsub.connection.disconnect()

    async def _close_shard(self, shard: _Shard) -> None:
        with suppress(*REDIS_DOWN):
            await close_pubsub(self._redis, shard.pubsub)
