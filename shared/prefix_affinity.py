"""Prefix affinity: a request goes to the worker that holds the KV blocks of its prompt's prefix.

A worker announces, for the requests it takes, the hash of each prompt's first `tokens` tokens,
with an expiry, in a per-model hash in the model's queue slot (`redis_keys.prefix_holders`):
the last taker of a prefix holds it. The api looks up a request's hash at enqueue; when a live
worker of the model (and of the request's backend, if it names one) announced it, the request
is marked for that worker (`RequestPayload.affinity`) and waits in that worker's affinity lane
of its tenant and priority (shared/queue.py). That worker reads it first; the others take it
only once it has waited past a bound (worker/intake.py), so nothing starves behind a busy or
dead worker.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from redis.asyncio import Redis

from shared import redis_keys
from shared.messages import RequestPayload

# KEYS: holders hash, expiry set. ARGV: worker, ttl ms, then the prefix hashes it took.
# Announces them, and drops up to 100 expired announcements (any worker's) per call.
_ANNOUNCE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expires = now + tonumber(ARGV[2])
for i = 3, #ARGV do
  redis.call('HSET', KEYS[1], ARGV[i], expires .. ':' .. ARGV[1])
  redis.call('ZADD', KEYS[2], expires, ARGV[i])
end
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 100)
if #old > 0 then
  redis.call('HDEL', KEYS[1], unpack(old))
  redis.call('ZREM', KEYS[2], unpack(old))
end
return #old
"""

# KEYS: holders hash. ARGV: prefix hashes. For each, the worker whose announcement of it has
# not expired by Redis's clock (the workers' expiries are in that clock too), or false.
_LOOKUP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local found = redis.call('HMGET', KEYS[1], unpack(ARGV))
for i, value in ipairs(found) do
  if value then
    local expires, worker = string.match(value, '^(%d+):(.*)$')
    found[i] = expires and tonumber(expires) > now and worker or false
  end
end
return found
"""


def prefix_hash(token_ids: Sequence[int], tokens: int) -> str | None:
    """The hash of a prompt's first `tokens` token ids; None when the prompt is not longer (the
    prefix cache never holds a prompt's last token, so a prompt of `tokens` tokens shares less)."""
    if len(token_ids) <= tokens:
        return None
    return hashlib.blake2b(",".join(map(str, token_ids[:tokens])).encode(), digest_size=12).hexdigest()


class PrefixAffinity:
    """One model's prefix announcements: a worker writes them (`announce`), the api reads them (`route`)."""

    def __init__(self, redis: Redis, prefix: str, model: str, tokens: int):
        self.redis = redis
        self.prefix = prefix
        self.model = model
        self.tokens = tokens
        self.holders_key = redis_keys.prefix_holders(prefix, model)
        self.expiry_key = redis_keys.prefix_expiry(prefix, model)
        self._announce = redis.register_script(_ANNOUNCE)
        self._lookup = redis.register_script(_LOOKUP)

    def hash_of(self, payload: RequestPayload) -> str | None:
        return prefix_hash(payload.prompt_token_ids, self.tokens)

    async def announce(self, worker: str, payloads: Sequence[RequestPayload], ttl_ms: int) -> None:
        """`worker` took these requests: it holds their prefixes for the next `ttl_ms`."""
        hashes = sorted({h for p in payloads if (h := self.hash_of(p)) is not None})
        if hashes:
            await self._announce(keys=[self.holders_key, self.expiry_key], args=[worker, ttl_ms, *hashes])

    async def route(self, payloads: Sequence[RequestPayload]) -> None:
        """Mark each request for the live worker that announced its prefix, if one did (and
        serves its backend, when it names one); leave the others unmarked."""
        hashes = [self.hash_of(p) for p in payloads]
        wanted = sorted({h for h in hashes if h is not None})
        if not wanted:
            return
        holder = dict(zip(wanted, await self._lookup(keys=[self.holders_key], args=wanted), strict=True))
        workers = sorted({w for w in holder.values() if w})
        if not workers:
            return
        # The heartbeats say who is alive now: an announcement outlives its worker by up to its ttl.
        # One GET each, not an MGET: heartbeats lie in other slots of a cluster.
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker in workers:
                pipe.get(redis_keys.worker_heartbeat(self.prefix, worker))
            beats = await pipe.execute()
        live = {w: json.loads(beat) for w, beat in zip(workers, beats, strict=True) if beat is not None}
        for payload, h in zip(payloads, hashes, strict=True):
            worker = holder.get(h) or ""
            beat = live.get(worker)
            if beat is None or beat.get("model") != self.model:
                continue
            if payload.backend is None or beat.get("backend") == payload.backend:
                payload.affinity = worker
