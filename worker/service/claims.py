"""A queue entry the intake took, made a request this worker runs: validated, expired if it waited
too long, claimed (its record queued → running for this worker), continued after the tokens
already delivered where another worker ran it before, and handed to the backend last.

Every Redis call here may be repeated (the service retries while Redis is away): the backend
gets the request only once all of them went through.
"""
from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable

from pydantic import ValidationError
from redis.asyncio import Redis

from shared import redis_keys
from shared.lora_registry import LoraRegistry
from shared.messages import FinalEvent, RequestPayload, decode_event, now
from shared.store import RequestStore, delivered_tokens
from worker.engine.backend import Backend
from worker.engine.sequence import refused
from worker.service.metrics import WorkerMetrics
from worker.service.publisher import Publisher
from worker.service.tracing import RequestSpans

log = logging.getLogger(__name__)


class Claims:
    def __init__(self, redis: Redis, store: RequestStore, backend: Backend, publisher: Publisher,
                 metrics: WorkerMetrics, spans: RequestSpans, name: str, held: Callable[[], list[str]],
                 configured: frozenset[str] = frozenset()):
        """`configured`: the LoRA adapters of this worker's STREAMQ_LORA_MODULES (run on their own folders)."""
        self.redis, self.store, self.backend, self.publisher = redis, store, backend, publisher
        self.metrics, self.spans, self.name = metrics, spans, name
        self._held = held  # the ids of the requests this worker holds now
        self._configured = configured

    async def claim(self, stream: str, entry_id: str, fields: dict[str, str]) -> RequestPayload | None:
        """Hand a taken entry's request to the backend; None when it is not to run (malformed,
        expired, ended while queued, already running here)."""
        try:
            payload = RequestPayload.model_validate_json(fields.get("payload", ""))
        except ValidationError as exc:
            # E.g. queued by an api with other bounds or a newer version: its client hears why instead of waiting.
            log.error("failing malformed request entry %s: %s", entry_id, exc)
            request_id = _request_id(fields.get("payload", ""))
            if request_id is not None:
                await self.store.fail_queued(request_id, f"the worker cannot run this request: {exc}")
            await self._ack(stream, entry_id)
            return None
        if payload.expires_at is not None and now() > payload.expires_at and await self.store.expire(payload):
            log.info("request %s expired in the queue", payload.id)
            await self._ack(stream, entry_id)
            return None
        if not await self.store.claim(payload.id, self.name):
            # Cancelled (or otherwise ended) while queued: nothing to run.
            await self._ack(stream, entry_id)
            return None
        if payload.id in self._held():
            # Put back while this worker still ran it (its heartbeat came late: a stalled machine, a
            # long pause): it goes on here, and its end acks the entry it came back as.
            log.warning("request %s came back to the worker that still runs it; it goes on", payload.id)
            self.publisher.taken(payload.id, entry_id)
            return None
        # A request put back after its worker died continues after the tokens already delivered.
        delivered = [decode_event(data) for _, data in await self.store.events(payload.id)]
        if any(isinstance(e, FinalEvent) for e in delivered):
            await self._ack(stream, entry_id)
            return None
        # By index, not by entry: a retried publish may have logged a token twice.
        resumed = delivered_tokens(delivered)
        log.info("request %s started", payload.id, extra={
            "request_id": payload.id, "worker": self.name, "tenant": payload.tenant,
            "queue_s": round(now() - payload.created_at, 4), "prompt_tokens": payload.num_prompt_tokens,
            "resumed_after": len(resumed)})
        self.metrics.taken(payload)
        self.spans.taken(payload, len(resumed))
        self.publisher.taken(payload.id, entry_id)
        if (error := self.cannot_run(payload)) is not None:  # queued for this backend by hand
            await self.publisher.publish([refused(payload, error)])
            return None
        loaded = await self._with_adapter_load(payload)
        if isinstance(loaded, str):
            await self.publisher.publish([refused(payload, loaded, code="model_not_found")])
            return None
        if loaded.images:
            blobs = await self._images(loaded)
            if isinstance(blobs, str):
                await self.publisher.publish([refused(loaded, blobs)])
                return None
            self.backend.add_with_images(loaded, resumed, blobs)
        else:
            self.backend.add(loaded, resumed)
        return loaded

    async def _images(self, payload: RequestPayload) -> list[bytes] | str:
        """The request's images' bytes from Redis (the api kept them), or why it cannot run."""
        keys = [redis_keys.image(self.store.prefix, sha) for sha in payload.images]
        blobs = []
        for key in keys:  # one key a call: on a Redis Cluster they lie apart
            blobs.append(await self.redis.get(key))
            await self.redis.expire(key, redis_keys.IMAGE_TTL_S)  # kept for a takeover while it runs
        if any(blob is None for blob in blobs):
            return ("the request's images are no longer kept (an hour after their latest request or start: "
                    "send it again)")
        return [base64.b64decode(blob) for blob in blobs]

    def cannot_run(self, payload: RequestPayload) -> str | None:
        """Why this worker's backend cannot run the request (None: it can)."""
        if payload.pool is not None and not self.backend.pools:
            return f"the {self.backend.name} backend does not compute embeddings or scores"
        if payload.images and not self.backend.takes_images:
            return f"this worker's model ({self.backend.name} backend) takes no images"
        if payload.adapter is not None and self.backend.adapters is None:
            return (f"LoRA adapter {payload.adapter!r}: this worker serves no adapters (the paged engine with "
                    "STREAMQ_ENABLE_LORA or STREAMQ_LORA_MODULES does)")
        return None

    async def _with_adapter_load(self, payload: RequestPayload) -> RequestPayload | str:
        """The request with its adapter's load as the registry holds it now (revision and folder),
        where the adapter was loaded at run time: a load under its name since the api took it runs
        the new weights. Why it cannot run where the adapter was unloaded meanwhile."""
        name = payload.adapter
        if name is None or name in self._configured:
            return payload
        entry = await LoraRegistry(self.redis, self.store.prefix).entry(payload.model, name)
        if entry is None:
            return (f"model {name!r} is not served here: the LoRA adapter was unloaded "
                    "(/v1/unload_lora_adapter) before this request ran")
        return payload.model_copy(update={"adapter_revision": entry.revision, "adapter_path": entry.path})

    async def _ack(self, stream: str, entry_id: str) -> None:
        await self.redis.xack(stream, redis_keys.WORKER_GROUP, entry_id)


def _request_id(payload: str) -> str | None:
    """The id of a request entry whose payload does not validate, if it has one."""
    try:
        request_id = json.loads(payload).get("id")
    except (ValueError, AttributeError):
        return None
    return request_id if isinstance(request_id, str) else None
