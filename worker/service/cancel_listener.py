"""The worker's cancel listener: the cancel channel's control messages (shared/messages.py Cancel),
each handed to the backend, which stops the request at its next step if this worker holds it.

A cancel is published once, to whoever listens then: on each (re)subscription the listener
also stops what this worker holds whose record was flagged cancelled while it was not
subscribed (Redis restarted, the connection was lost, the channel's slot moved).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisClusterException, ResponseError

from shared import redis_keys
from shared.messages import Cancel, UnknownVersion
from shared.pubsub import MESSAGE, SUBSCRIBED, UNSUBSCRIBED, close_pubsub, node_of, pubsub_on, refresh
from shared.redis_client import REDIS_DOWN
from shared.store import RequestStore
from worker.engine.backend import Backend

log = logging.getLogger(__name__)


class CancelListener:
    def __init__(self, redis: Redis, prefix: str, store: RequestStore, backend: Backend,
                 held: Callable[[], list[str]]):
        self.redis, self.store, self.backend = redis, store, backend
        self.channel = redis_keys.cancel_channel(prefix)
        self._held = held  # the ids of the requests this worker holds now

    async def listen(self) -> None:
        """Listen for as long as the worker runs, subscribing again after each loss."""
        # By hand, not a redis-py Retry: the listen loop itself must start again on a fresh
        # subscription. On a cluster, the subscription goes to the node that serves the channel's slot now.
        while True:
            pubsub = None
            try:
                await refresh(self.redis)
                pubsub = pubsub_on(self.redis, node_of(self.redis, self.channel))
                await pubsub.subscribe(self.channel)
                async for message in pubsub.listen():
                    if message["type"] == MESSAGE:
                        self._cancel(message["data"])
                    elif message["type"] == SUBSCRIBED:  # listening from here on: catch up on before
                        await self._cancel_flagged()
                    elif message["type"] == UNSUBSCRIBED:  # its slot moved to another node
                        break
            except (*REDIS_DOWN, RedisClusterException, ResponseError) as exc:  # e.g. MOVED: the slot's new node
                log.warning("cancel listener lost redis (%s); resubscribing", exc)
                await asyncio.sleep(0.5)
            finally:
                if pubsub is not None:
                    await close_pubsub(self.redis, pubsub)

    def _cancel(self, data: str | bytes) -> None:
        try:
            cancel = Cancel.decode(data)
        except (UnknownVersion, ValidationError) as exc:  # e.g. a newer api's: said, not guessed at
            log.error("cancel message not understood, left out: %s", exc)
            return
        self.backend.cancel(cancel.request_id)

    async def _cancel_flagged(self) -> None:
        """Stop what this worker holds whose record was flagged cancelled while the listener was not
        subscribed: without this, a cancel sent meanwhile would leave its request running to its end."""
        held = self._held()
        for request_id in await self.store.cancel_flagged(held) if held else []:
            log.info("request %s was cancelled while the cancel listener was away", request_id)
            self.backend.cancel(request_id)
