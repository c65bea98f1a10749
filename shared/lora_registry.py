"""The LoRA adapters an operator loads at run time (/v1/load_lora_adapter), per model, in Redis:
the api writes them, every worker of the model reads them at its heartbeat (to list them) and when
it takes a request of one (to run the entry's revision). An entry may name the tenants allowed to
use the adapter (none: every tenant)."""
from __future__ import annotations

from pydantic import ConfigDict
from redis.asyncio import Redis

from shared import redis_keys
from shared.messages import Versioned


class AdapterEntry(Versioned):
    """An adapter loaded at run time, as the api writes it and every worker of the model reads it."""

    model_config = ConfigDict(frozen=True)

    path: str
    tenants: tuple[str, ...] | None = None  # who may use it (None: everyone)
    # Bumped by every load of the model's adapters (register): a load under a name already loaded
    # gets a new one, so workers run its weights, not those they hold (0: written before revisions).
    revision: int = 0

    def allows(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


class LoraRegistry:
    def __init__(self, redis: Redis, prefix: str):
        self.redis = redis
        self.prefix = prefix

    async def register(self, model: str, name: str, entry: AdapterEntry) -> AdapterEntry:
        """Write `entry` under `name` with a revision no entry of the model had (the one written)."""
        revision = await self.redis.incr(redis_keys.lora_revision(self.prefix, model))
        entry = entry.model_copy(update={"revision": revision})
        await self.redis.hset(redis_keys.lora_adapters(self.prefix, model), name, entry.encode())
        return entry

    async def unregister(self, model: str, name: str) -> bool:
        return bool(await self.redis.hdel(redis_keys.lora_adapters(self.prefix, model), name))

    async def entry(self, model: str, name: str) -> AdapterEntry | None:
        data = await self.redis.hget(redis_keys.lora_adapters(self.prefix, model), name)
        return None if data is None else AdapterEntry.decode(data)

    async def entries(self, model: str) -> dict[str, AdapterEntry]:
        raw = await self.redis.hgetall(redis_keys.lora_adapters(self.prefix, model))
        return {name: AdapterEntry.decode(data) for name, data in raw.items()}
