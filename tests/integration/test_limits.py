"""Per-tenant limits against a real Redis, from two 'replicas' at once."""
import asyncio
import uuid

import pytest

from api.core.errors import ApiError
from api.core.limits import Limits
from shared import redis_keys
from shared.messages import RequestStatus
from shared.request_record import RecordField


def rid() -> str:
    return str(uuid.uuid4())


async def _try(limits: Limits, tenant: str, tokens: int = 10) -> bool:
    try:
        await limits.charge(tenant, [rid()], tokens)
        return True
    except ApiError as exc:
        assert exc.status == 429 and int(exc.headers["Retry-After"]) >= 1
        return False


async def test_two_replicas_together_admit_no_more_than_the_rpm(redis, prefix):
    one, two = Limits(redis, prefix, 600), Limits(redis, prefix, 600)
    await one.set("acme", rpm=5)
    results = await asyncio.gather(*(_try(r, "acme") for r in [one, two] * 10))
    assert results.count(True) == 5
    assert await _try(one, "other-tenant")  # limits are per tenant


async def test_tokens_per_minute(redis, prefix):
    limits = Limits(redis, prefix, 600)
    await limits.set("acme", tpm=100)
    assert await _try(limits, "acme", 60)
    assert not await _try(limits, "acme", 50)
    assert await _try(limits, "acme", 40)
    with pytest.raises(ApiError, match="tokens per minute"):
        await limits.charge("acme", [rid()], 1)


async def test_concurrency_counts_unfinished_requests_only(redis, prefix):
    limits = Limits(redis, prefix, 600)
    await limits.set("acme", concurrent=2)
    first, second = rid(), rid()
    for r in (first, second):
        await limits.charge("acme", [r], 1)
        await redis.hset(redis_keys.request_record(prefix, r), RecordField.STATUS, RequestStatus.RUNNING)
    with pytest.raises(ApiError, match="concurrent"):
        await limits.charge("acme", [rid()], 1)
    await redis.hset(redis_keys.request_record(prefix, first), RecordField.STATUS, RequestStatus.DONE)
    await limits.charge("acme", [rid()], 1)  # a finished request frees its slot


async def test_setting_one_limit_keeps_the_others(redis, prefix):
    """`streamq keys limits --weight 2` after `--rpm 60 --tpm 20000 --concurrent 8` keeps those."""
    limits = Limits(redis, prefix, 600)
    await limits.set("acme", rpm=60, tpm=20000, concurrent=8)
    await limits.set("acme", weight=2)
    assert await redis.hgetall(redis_keys.tenant_limits(prefix, "acme")) == {
        "rpm": "60", "tpm": "20000", "concurrent": "8", "weight": "2"}
    assert await limits.charge("acme", [rid()], 1) == 2.0
    await limits.set("acme", rpm=0)  # 0 lifts one limit
    assert (await redis.hgetall(redis_keys.tenant_limits(prefix, "acme")))["rpm"] == "0"
    with pytest.raises(ValueError, match="0 \\(none\\) or more"):
        await limits.set("acme", tpm=-1)


async def test_an_ended_requests_reservation_is_settled_to_what_it_used(redis, prefix):
    """tpm 100: a request reserving 60 that ended after 10 tokens in all leaves room for 80 more;
    one still running keeps its whole reservation; each sample is reserved and settled apart."""
    limits = Limits(redis, prefix, 600)
    await limits.set("acme", tpm=100)
    short, running = rid(), rid()
    await limits.charge("acme", [short], 60)
    await redis.hset(redis_keys.request_record(prefix, short), mapping={
        RecordField.STATUS: RequestStatus.DONE, RecordField.PROMPT_TOKENS: 4, RecordField.COMPLETION_TOKENS: 6})
    samples = [rid(), rid()]
    await limits.charge("acme", samples, [40, 40])  # 10 used + 80 reserved
    with pytest.raises(ApiError, match="tokens per minute"):
        await limits.charge("acme", [rid()], 11)
    await redis.hset(redis_keys.request_record(prefix, samples[0]), mapping={
        RecordField.STATUS: RequestStatus.DONE, RecordField.PROMPT_TOKENS: 4, RecordField.COMPLETION_TOKENS: 1})
    await redis.hset(redis_keys.request_record(prefix, samples[1]), RecordField.STATUS, RequestStatus.RUNNING)
    await limits.charge("acme", [running], 45)  # 10 + 5 + 40 (still running) + 45 = 100
    members = set(await redis.zrange(redis_keys.tenant_usage(prefix, "acme", "tpm"), 0, -1))
    assert members == {f"{short}=10", f"{samples[0]}=5", f"{samples[1]}:40", f"{running}:45"}
    assert not await _try(limits, "acme", 1)


async def test_service_tiers_are_resolved_against_what_the_tenant_may_use(redis, prefix):
    limits = Limits(redis, prefix, 600)
    assert [await limits.service_tier("acme", t) for t in ("auto", "default", "flex")] == ["default", "default", "flex"]
    with pytest.raises(ApiError) as refused:  # priority is granted, not anyone's
        await limits.service_tier("acme", "priority")
    assert refused.value.status == 403 and refused.value.param == "service_tier"
    assert "auto, default, flex" in refused.value.message
    await limits.set("acme", rpm=5, tiers=("priority", "flex"), auto_tier="priority")
    assert [await limits.service_tier("acme", t) for t in ("auto", "priority", "flex")] == ["priority", "priority", "flex"]
    with pytest.raises(ApiError):
        await limits.service_tier("acme", "default")
    assert await limits.service_tier("other", "auto") == "default"  # another tenant's grant is its own
    await limits.set("acme", tpm=100)  # setting a limit keeps the tiers
    assert await limits.service_tier("acme", "auto") == "priority"
    with pytest.raises(ValueError, match="auto tier"):  # auto must be one of the tenant's tiers
        await limits.set("acme", tiers=("default",))
    assert await limits.service_tier("acme", "auto") == "priority"  # a refused set changes nothing
