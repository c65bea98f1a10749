"""Open streams per tenant (api/core/stream_slots.py) on a real Redis: one cap over every replica
(two StreamSlots on one Redis are two replicas), slots freed by their streams, renewed while held,
and lapsing with their lease where a replica died."""
from __future__ import annotations

import pytest

from api.core.errors import ApiError
from api.core.stream_slots import StreamSlots
from shared import redis_keys
from tests.waiting import until


@pytest.fixture
async def replicas(redis, prefix):
    made = [StreamSlots(redis, prefix, 2, 30), StreamSlots(redis, prefix, 2, 30)]
    yield made
    for slots in made:
        await slots.close()


async def _refused(slots: StreamSlots, tenant: str) -> ApiError:
    with pytest.raises(ApiError) as refused:
        await slots.take(tenant)
    return refused.value


async def test_a_tenant_s_cap_holds_over_every_replica_and_a_freed_slot_is_taken_again(redis, prefix, replicas):
    a, b = replicas
    first, _ = await a.take("acme"), await b.take("acme")
    refused = await _refused(a, "acme")
    assert refused.status == 429 and refused.code == "rate_limit_exceeded" and refused.headers["Retry-After"]
    assert (await _refused(b, "acme")).status == 429
    await b.take("other")  # another tenant's streams are its own
    await first.release()
    await first.release()  # twice: nothing more
    again = await b.take("acme")
    assert (await _refused(a, "acme")).status == 429
    assert a.held() == 0 and b.held() == 3
    await again.release()
    assert await redis.zcard(redis_keys.tenant_streams(prefix, "acme")) == 1


async def test_the_last_slot_freed_leaves_no_key(redis, prefix, replicas):
    a, _ = replicas
    slots = [await a.take("acme"), await a.take("acme")]
    key = redis_keys.tenant_streams(prefix, "acme")
    assert 0 < await redis.pttl(key) <= 30_000  # never a key without an end
    for slot in slots:
        await slot.release()
    assert not await redis.exists(key) and a.held() == 0


async def test_a_slot_taken_for_a_stream_whose_request_is_refused_is_freed(redis, prefix, replicas):
    a, _ = replicas
    with pytest.raises(ApiError):
        async with a.opening("acme") as slot:
            assert slot is not None and a.held() == 1
            raise ApiError(503, "the queue is full")
    assert a.held() == 0 and not await redis.exists(redis_keys.tenant_streams(prefix, "acme"))


async def test_held_slots_are_renewed_and_a_freed_one_is_not_brought_back(redis, prefix):
    slots = StreamSlots(redis, prefix, 2, 3)  # renewed each second
    try:
        kept, freed = await slots.take("acme"), await slots.take("acme")
        key = redis_keys.tenant_streams(prefix, "acme")
        taken_until = await redis.zscore(key, kept.id)
        await freed.release()
        await until(lambda: _later(redis, key, kept.id, taken_until), 10, "the renewer pushing the lease on")
        assert await redis.zrange(key, 0, -1) == [kept.id]
        assert await slots.renew() == 1
    finally:
        await slots.close()


async def _later(redis, key: str, member: str, than: float) -> bool:
    return (await redis.zscore(key, member) or 0) > than


async def test_a_dead_replica_s_slots_lapse_with_their_lease(redis, prefix):
    dead, alive = StreamSlots(redis, prefix, 1, 1), StreamSlots(redis, prefix, 1, 1)
    await dead.take("acme")
    await dead.close()  # the replica died: nothing renews or frees its slot
    assert (await _refused(alive, "acme")).status == 429
    key = redis_keys.tenant_streams(prefix, "acme")
    await until(lambda: _gone(redis, key), 10, "the dead replica's slot lapsing")
    slot = await alive.take("acme")
    await slot.release()
    await alive.close()


async def _gone(redis, key: str) -> bool:
    return not await redis.exists(key)


async def test_no_cap_touches_no_redis():
    slots = StreamSlots(None, "p", 0, 30)  # no Redis at all: nothing is counted
    slot = await slots.take("acme")
    await slot.release()
    assert slots.held() == 0
