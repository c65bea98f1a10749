"""API keys: created, listed and revoked with `streamq keys`; stored as SHA-256 digests only.

Every replica looks a key up in Redis on every request, so a revoked key stops working
everywhere at once.
"""
from __future__ import annotations

import hashlib
import secrets
import time

from redis.asyncio import Redis

from shared import redis_keys
from shared.messages import Versioned

KEY_PREFIX = "sq-"


class KeyMeta(Versioned):
    """What Redis keeps of a key, under its digest: written by `streamq keys create`, read by every
    api replica (its tenant) and by `streamq keys list|revoke`."""

    tenant: str
    name: str = ""  # the label given at creation
    created_at: float
    hint: str  # the key's first characters, to tell keys apart in a list


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, redis: Redis, prefix: str):
        self.redis = redis
        self.name = redis_keys.api_keys(prefix)

    async def create(self, tenant: str, label: str = "") -> str:
        """A new key for `tenant`; the only time the key itself is seen."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        meta = KeyMeta(tenant=tenant, name=label, created_at=time.time(), hint=key[:10])
        await self.redis.hset(self.name, digest(key), meta.encode())
        return key

    async def tenant_for(self, key: str) -> str | None:
        meta = await self.redis.hget(self.name, digest(key))
        return KeyMeta.decode(meta).tenant if meta else None

    async def list(self) -> list[dict]:
        entries = await self.redis.hgetall(self.name)
        """Each key's digest (its first characters) and what is kept of it, oldest first."""
        metas = [(d, KeyMeta.decode(m)) for d, m in entries.items()]
        return sorted(({"digest": d[:12], **m.model_dump(exclude={"version"})} for d, m in metas),
                      key=lambda e: e["created_at"])

    async def revoke(self, key_or_hint: str) -> int:
        """Revoke a key, given the key itself or its hint (the first characters `list` shows)."""
        if await self.redis.hdel(self.name, digest(key_or_hint)):
            return 1
        matches = [d for d, m in (await self.redis.hgetall(self.name)).items()
                   if KeyMeta.decode(m).hint == key_or_hint or d.startswith(key_or_hint)]
        if len(matches) != 1:
            return 0
        return await self.redis.hdel(self.name, matches[0])
