"""Prefix affinity: a request goes to the worker that holds the KV blocks of its prompt's prefix.

A worker announces, for the requests it takes, the hash of each prompt's first `tokens` tokens,
with an expiry, in a per-model hash in the model's queue slot (`redis_keys.prefix_holders`),
which keeps the last few takers of each prefix. The api looks up a request's hash at enqueue;
when live workers of the model (and of the request's backend, if it names one) announced it,
the request is marked for the one of them with the most free slots (`RequestPayload.affinity`)
and waits in that worker's affinity lane of its tenant and priority (shared/queue.py). That
worker reads it first; the others take it only once it has waited past a bound
(worker/service/intake.py), so nothing starves behind a busy or dead worker.

A prefix is hashed within its tenant's space (shared/prefix_scope.py), as the worker's cache keys
its blocks: a request goes to the worker holding its own tenant's copy of the prefix, never to one
that holds only another tenant's.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

from redis.asyncio import Redis

from shared import redis_keys, scripts
from shared.heartbeat import Heartbeat
from shared.messages import RequestPayload
from shared.prefix_scope import PER_TENANT, PrefixScope
from shared.workers import read_heartbeat

MAX_HOLDERS = 4  # workers remembered per prefix, the latest first

def prefix_hash(token_ids: Sequence[int], tokens: int, root: int | None = None) -> str | None:
    """The hash of a prompt's first `tokens` token ids in the space of chain root `root` (None: the
    shared one); None when the prompt is not longer (the prefix cache never holds a prompt's last
    token, so a prompt of `tokens` tokens shares less)."""
    if len(token_ids) <= tokens:
        return None
    head = b"" if root is None else root.to_bytes(16, "little") + b"|"
    return hashlib.blake2b(head + ",".join(map(str, token_ids[:tokens])).encode(), digest_size=12).hexdigest()


class PrefixAffinity:
    """One model's prefix announcements: a worker writes them (`announce`), the api reads them (`route`)."""

    def __init__(self, redis: Redis, prefix: str, model: str, tokens: int, scope: PrefixScope = PER_TENANT):
        self.redis = redis
        self.scope = scope  # whose prefixes share a hash: the workers' caches' own
        self.prefix = prefix
        self.model = model
        self.tokens = tokens
        self.holders_key = redis_keys.prefix_holders(prefix, model)
        self.expiry_key = redis_keys.prefix_expiry(prefix, model)
        self.free_key = redis_keys.worker_free_slots(prefix, model)
        self._announce = scripts.register(redis, "affinity_announce")
        self._lookup = scripts.register(redis, "affinity_lookup")

    def hash_of(self, payload: RequestPayload) -> str | None:
        return prefix_hash(payload.prompt_token_ids, self.tokens, self.scope.root(payload.tenant))

    async def announce(self, worker: str, payloads: Sequence[RequestPayload], ttl_ms: int) -> None:
        """`worker` took these requests: it holds their prefixes for the next `ttl_ms`."""
        hashes = sorted({h for p in payloads if (h := self.hash_of(p)) is not None})
        if hashes:
            await self._announce(keys=[self.holders_key, self.expiry_key],
                                 args=[worker, ttl_ms, MAX_HOLDERS, *hashes])

    async def route(self, payloads: Sequence[RequestPayload]) -> None:
        """Mark each request for a live worker that holds its prefix, if one does (and serves its
        backend, when it names one): of several, the one with the most free slots. Leave the
        others unmarked."""
        hashes = [self.hash_of(p) for p in payloads]
        wanted = sorted({h for h in hashes if h is not None})
        if not wanted:
            return
        holders = dict(zip(wanted, await self._lookup(keys=[self.holders_key, self.free_key], args=wanted),
                           strict=True))
        workers = sorted({w for found in holders.values() for w in found})
        if not workers:
            return
        # The heartbeats say who is alive now: an announcement outlives its worker by up to its ttl.
        # One GET each, not an MGET: heartbeats lie in other slots of a cluster.
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker in workers:
                pipe.get(redis_keys.worker_heartbeat(self.prefix, worker))
            beats = await pipe.execute()
        live = {w: read for w, beat in zip(workers, beats, strict=True)
                if beat is not None and (read := read_heartbeat(w, beat)) is not None}
        for payload, h in zip(payloads, hashes, strict=True):
            payload.affinity = next((w for w in holders.get(h, []) if w in live and self._serves(live[w], payload)),
                                    None)

    def _serves(self, beat: Heartbeat, payload: RequestPayload) -> bool:
        return beat.model == self.model and payload.backend in (None, beat.backend)
