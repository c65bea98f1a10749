"""Per-tenant limits, enforced across every replica through Redis: requests per minute, tokens
per minute (prompt plus max_tokens, reserved when charged, each sample of a request apart; once
the request ended, settled to the prompt plus the tokens it generated) and concurrent requests.

One Lua script checks all three and records the charge atomically, so two replicas together
never admit more than a limit. Past a limit: 429 with Retry-After (when the oldest request in
the window leaves it) and OpenAI's error body. A tenant's unfinished requests are counted by
looking at their records, so no finishing path has to remember to release a slot. The records
are read before the script, which is told which of the tenant's requests have ended: the script
touches only the tenant's own keys (one hash tag, so one slot on Redis Cluster), and a request
that ends between the read and the script still counts, until the next charge sees it ended.
"""
from __future__ import annotations

import math

from redis.asyncio import Redis

from api.core.errors import ApiError
from shared import redis_keys, scripts, service_tier
from shared.messages import RequestStatus, now
from shared.request_record import RecordField

# How many ended requests' reservations one charge settles at most (the oldest first).
SETTLE_AT_ONCE = 64
# A record's statuses while the request still counts against its tenant's concurrency.
_UNFINISHED = frozenset(s.value for s in RequestStatus if not s.finished)

class Limits:
    def __init__(self, redis: Redis, prefix: str, active_ttl_s: float):
        self.redis = redis
        self.prefix = prefix
        self.active_ttl_s = active_ttl_s  # an entry outliving its request this long is dropped
        self._charge = scripts.register(redis, "limits_charge")

    async def set(self, tenant: str, rpm: int | None = None, tpm: int | None = None, concurrent: int | None = None,
                  weight: float | None = None, tiers: tuple[str, ...] | None = None,
                  auto_tier: str | None = None) -> None:
        """Sets the limits given (0: none) and keeps the tenant's others as they were. `tiers`: the
        service tiers it may use; `auto_tier`: the one a request asking for `auto` gets (one of them)."""
        if weight is not None and weight <= 0:
            raise ValueError(f"weight must be positive; got {weight}")
        given = {name: value for name, value in
                 (("rpm", rpm), ("tpm", tpm), ("concurrent", concurrent), ("weight", weight)) if value is not None}
        if any(given[name] < 0 for name in ("rpm", "tpm", "concurrent") if name in given):
            raise ValueError(f"limits are 0 (none) or more; got {given}")
        key = redis_keys.tenant_limits(self.prefix, tenant)
        if tiers is not None or auto_tier is not None:
            granted, auto = await self._tiers(tenant)
            granted, auto = tiers or granted, auto_tier or auto
            if auto not in granted:
                raise ValueError(f"the auto tier {auto!r} must be one of the tenant's tiers {list(granted)}")
            given |= {"tiers": ",".join(granted), "auto_tier": auto}
        if given:
            await self.redis.hset(key, mapping=given)

    async def service_tier(self, tenant: str, requested: str) -> str:
        """The service tier a request of `tenant` asking for `requested` runs in; 403 where the
        tenant may not use it (shared/service_tier.py)."""
        granted, auto = await self._tiers(tenant)
        try:
            return service_tier.resolve(requested, granted, auto)
        except PermissionError as exc:
            raise ApiError(403, str(exc), param="service_tier", code="service_tier_not_allowed") from exc

    async def _tiers(self, tenant: str) -> tuple[tuple[str, ...], str]:
        """The tenant's granted tiers and its auto tier (the defaults where it was given none)."""
        tiers, auto = await self.redis.hmget(redis_keys.tenant_limits(self.prefix, tenant), ["tiers", "auto_tier"])
        return (service_tier.parse(tiers) if tiers else service_tier.DEFAULT_GRANT,
                auto or service_tier.DEFAULT_AUTO)

    async def admit(self, tenant: str) -> None:
        """429 where one more request of one token would not pass the tenant's limits now; records
        nothing. Asked before a request's body is read further (its prompt tokenized, its constraint
        compiled), so a tenant past its limits costs the api no CPU; `charge` decides for good."""
        await self._run(tenant, ["admission"], [1], peek=True)

    async def charge(self, tenant: str, request_ids: list[str], tokens: int | list[int]) -> float:
        """Charge these requests to the tenant's limits and return the tenant's scheduling weight,
        or raise 429 naming the limit and the wait. `tokens`: what each reserves (one count: the
        first request's, all of them together)."""
        costs = tokens if isinstance(tokens, list) else [tokens] + [0] * (len(request_ids) - 1)
        return await self._run(tenant, request_ids, costs, peek=False)

    async def _run(self, tenant: str, request_ids: list[str], costs: list[int], peek: bool) -> float:
        ended, settle = await self._ended(tenant)
        result = await self._charge(
            keys=[redis_keys.tenant_limits(self.prefix, tenant)] +
                 [redis_keys.tenant_usage(self.prefix, tenant, k) for k in ("rpm", "tpm", "active")],
            args=[now(), " ".join(request_ids), " ".join(str(c) for c in costs), " ".join(ended), self.active_ttl_s,
                  "peek" if peek else "", " ".join(settle)])
        if result[0] == 0:
            return float(result[1])
        kind, wait = result[0], max(1, math.ceil(float(result[1])))
        raise ApiError(429, f"rate limit reached for tenant {tenant!r}: {kind}; retry in {wait} s",
                       code="rate_limit_exceeded", headers={"Retry-After": str(wait)})

    async def _ended(self, tenant: str) -> tuple[list[str], list[str]]:
        """From the records of the tenant's requests: its active ones that ended (or are gone), none
        looked at without a concurrency limit, as the script then counts none; and the reservations
        of ended ones to settle to what they used ("id reserved used" words, the oldest
        SETTLE_AT_ONCE), none without a tokens-per-minute limit."""
        limits_key = redis_keys.tenant_limits(self.prefix, tenant)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(limits_key, ["concurrent", "tpm"])
            pipe.zrange(redis_keys.tenant_usage(self.prefix, tenant, "active"), 0, -1)
            (concurrent, tpm), active = await pipe.execute()
        active = active if float(concurrent or 0) > 0 else []
        unsettled = []
        if float(tpm or 0) > 0:  # the minute's reservations, read only where they are limited
            reserved = await self.redis.zrange(redis_keys.tenant_usage(self.prefix, tenant, "tpm"), 0, -1)
            unsettled = [m.rsplit(":", 1) for m in reserved if ":" in m][:SETTLE_AT_ONCE]
        wanted = list(dict.fromkeys(active + [rid for rid, _ in unsettled]))
        if not wanted:
            return [], []
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in wanted:
                pipe.hmget(redis_keys.request_record(self.prefix, rid),
                           [RecordField.STATUS, RecordField.PROMPT_TOKENS, RecordField.COMPLETION_TOKENS])
            rows = dict(zip(wanted, await pipe.execute(), strict=True))
        ended = [rid for rid in active if rows[rid][0] not in _UNFINISHED]
        settle = []
        for rid, cost in unsettled:
            status, prompt, completion = rows[rid]
            if status is not None and status not in _UNFINISHED:  # a gone record keeps its reservation
                settle += [rid, cost, str(min(int(cost), int(prompt or 0) + int(completion or 0)))]
        return ended, settle

    async def release(self, tenant: str, request_ids: list[str], costs: list[int]) -> None:
        """Undo `charge` for requests that were then refused (e.g. by backpressure), in one round trip
        (not one transaction: a charge in between counts them still, and refuses rather than lets through)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(redis_keys.tenant_usage(self.prefix, tenant, "rpm"), *request_ids)
            pipe.zrem(redis_keys.tenant_usage(self.prefix, tenant, "tpm"),
                      *(f"{rid}:{cost}" for rid, cost in zip(request_ids, costs, strict=True)))
            pipe.zrem(redis_keys.tenant_usage(self.prefix, tenant, "active"), *request_ids)
            await pipe.execute()
