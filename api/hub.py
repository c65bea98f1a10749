"""One pub/sub connection per api replica, fanning events out to all of its open streams.

A stream subscribes to its request's channel through the hub; the first subscriber of a
channel makes the hub SUBSCRIBE, the last one leaving makes it UNSUBSCRIBE. One reader task
reads the connection and puts each message on the queues of that channel. Every
`tick_s` the hub also puts TICK on every queue, so a quiet stream can send a keepalive
without a timer per stream (a timeout per awaited message costs more than the message).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from redis.asyncio import Redis

log = logging.getLogger(__name__)

TICK = ""  # put on every queue each tick_s; never a real message (those are JSON)


class PubSubHub:
    def __init__(self, redis: Redis, home_channel: str, tick_s: float = 15.0):
        self._pubsub = redis.pubsub()
        self._home = home_channel  # always subscribed, so the connection always has a subscription
        self._tick_s = tick_s
        self._queues: dict[str, set[asyncio.Queue[str]]] = {}
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self._pubsub.subscribe(self._home)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._tick())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._pubsub.aclose()

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
                await self._pubsub.subscribe(channel)
            # Wait for Redis to confirm, so nothing published after this point is missed.
            await asyncio.shield(self._confirmed[channel])
            yield queue
        finally:
            subscribers.discard(queue)
            if not subscribers and self._queues.get(channel) is subscribers:
                del self._queues[channel]
                self._confirmed.pop(channel, None)
                await self._pubsub.unsubscribe(channel)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            for queues in list(self._queues.values()):
                for queue in queues:
                    queue.put_nowait(TICK)

    async def _read(self) -> None:
        while True:
            try:
                message = await self._pubsub.get_message(timeout=None)  # block: no timer per message
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep relaying; redis-py reconnects the pubsub
                log.exception("pub/sub read failed; retrying")
                await asyncio.sleep(0.5)
                continue
            if message is None:
                continue
            channel = message["channel"]
            if message["type"] == "subscribe":
                future = self._confirmed.get(channel)
                if future is not None and not future.done():
                    future.set_result(None)
            elif message["type"] == "message":
                for queue in self._queues.get(channel, ()):
                    queue.put_nowait(message["data"])
