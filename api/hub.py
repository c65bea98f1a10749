"""One pub/sub connection per api replica, fanning events out to all of its open streams.

A stream subscribes to its request's channel through the hub; the first subscriber of a
channel makes the hub SUBSCRIBE, the last one leaving makes it UNSUBSCRIBE. One reader task
reads the connection and puts each message on the queues of that channel. Every
`tick_s` the hub also puts TICK on every queue, so a quiet stream can send a keepalive
without a timer per stream (a timeout per awaited message costs more than the message).

When the connection drops (a Redis restart), redis-py reconnects it and subscribes again to
every channel; what was published in between is lost. So once the connection is back the hub
puts RESYNC on every queue, and each stream reads what it missed from the token log.

If the reader task crashes (anything but a lost connection), its done-callback logs the error
and starts it again on a fresh connection: the crash may have eaten a message, a subscribe
confirmation or half a reply. The subscribers stay; redis-py subscribes the new connection to
every channel, and the streams resync from their logs as after a reconnection.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from redis.asyncio import Redis

from shared.redis_client import REDIS_DOWN, until_redis_answers

log = logging.getLogger(__name__)

TICK = ""  # put on every queue each tick_s; never a real message (those are JSON)
RESYNC = "resync"  # put on every queue after a reconnection: messages may have been lost
OUTAGE_S = 60.0  # how long a stream waits for Redis to come back before it gives up
RETRY_MAX_S = 2.0  # the longest pause between reconnection tries, and between restarts of a crashing task


class PubSubHub:
    def __init__(self, redis: Redis, home_channel: str, tick_s: float = 15.0):
        self._pubsub = redis.pubsub()
        self._home = home_channel  # always subscribed, so the connection always has a subscription
        self._tick_s = tick_s
        self._queues: dict[str, set[asyncio.Queue[str]]] = {}
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._crashes = 0  # reader crashes since it last handled a message: spaces the restarts
        self._restart: asyncio.TimerHandle | None = None
        self._closing = False

    async def start(self) -> None:
        await self._pubsub.subscribe(self._home)
        self._run("reader", self._read)
        self._run("ticker", self._tick)

    async def close(self) -> None:
        self._closing = True
        if self._restart is not None:
            self._restart.cancel()
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        await self._pubsub.aclose()

    def _run(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        task = asyncio.create_task(loop(), name=f"pubsub-{name}")
        task.add_done_callback(lambda done: self._ended(done, name))
        self._tasks[name] = task

    def _ended(self, task: asyncio.Task[None], name: str) -> None:
        """Both tasks run until close(): any other end is a crash, logged, and the task restarted."""
        if self._closing or task.cancelled():
            return
        error = task.exception()
        log.error("pub/sub %s task %s; restarting it", name,
                  f"crashed ({type(error).__name__}: {error})" if error else "ended", exc_info=error)
        if name == "ticker":  # it sleeps tick_s before it can fail again
            self._run(name, self._tick)
            return
        self._crashes += 1  # the first restart is at once; a reader that keeps crashing, spaced out
        delay = 0.0 if self._crashes == 1 else min(RETRY_MAX_S, 0.1 * 2 ** (self._crashes - 2))
        self._restart = asyncio.get_running_loop().call_later(delay, self._restart_reader)

    def _restart_reader(self) -> None:
        if not self._closing:
            self._run("reader", lambda: self._read(fresh=True))

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
                await until_redis_answers("subscribe", lambda: self._pubsub.subscribe(channel), log, OUTAGE_S)
            # Wait for Redis to confirm, so nothing published after this point is missed.
            await asyncio.wait_for(asyncio.shield(self._confirmed[channel]), OUTAGE_S)
            yield queue
        finally:
            subscribers.discard(queue)
            if not subscribers and self._queues.get(channel) is subscribers:
                del self._queues[channel]
                self._confirmed.pop(channel, None)
                try:
                    await self._pubsub.unsubscribe(channel)
                except REDIS_DOWN:  # still subscribed after the reconnection: dropped at the resync
                    pass

    async def _resync(self) -> None:
        for queues in list(self._queues.values()):
            for queue in queues:
                queue.put_nowait(RESYNC)
        stale = [c for c in self._pubsub.channels if c != self._home and c not in self._queues]
        if stale:  # left while Redis was down
            try:
                await self._pubsub.unsubscribe(*stale)
            except REDIS_DOWN:
                pass

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            for queues in list(self._queues.values()):
                for queue in queues:
                    queue.put_nowait(TICK)

    async def _read(self, fresh: bool = False) -> None:
        """Relay every message to its channel's queues. `fresh`: after a crash, start from a new
        connection (redis-py subscribes it to every channel) and resync every stream."""
        # The reconnection is by hand, not a redis-py Retry: between tries it must drop the socket,
        # and the first message on the new connection must resync every stream.
        delay = 0.0  # > 0 while the connection is down
        if fresh:
            await self._disconnect()
            delay = 0.1
        while True:
            try:
                message = await self._pubsub.get_message(timeout=None)  # block: no timer per message
            except REDIS_DOWN as exc:  # redis-py reconnects the pubsub at the next read
                delay = min(RETRY_MAX_S, delay * 2 or 0.1)
                log.warning("pub/sub connection lost (%s: %s); reconnecting in %.1f s", type(exc).__name__, exc, delay)
                # Start the next try from a closed socket: a reconnect whose resubscription failed
                # (Redis still loading its AOF) would otherwise look connected, subscribed to nothing.
                await self._disconnect()
                await asyncio.sleep(delay)
                continue
            if message is None:
                continue
            if delay:  # the first answer on the new connection: resubscribed to every channel
                delay = 0.0
                log.info("pub/sub reconnected; %d streams catch up from their logs", len(self._queues))
                await self._resync()
            channel = message["channel"]
            if message["type"] == "subscribe":
                future = self._confirmed.get(channel)
                if future is not None and not future.done():
                    future.set_result(None)
            elif message["type"] == "message":
                for queue in self._queues.get(channel, ()):
                    queue.put_nowait(message["data"])
            self._crashes = 0

    async def _disconnect(self) -> None:
        if self._pubsub.connection is not None:
            await self._pubsub.connection.disconnect()
