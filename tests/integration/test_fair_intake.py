"""The worker reads every lane (tenant, priority) of its model and admits fairly between them:
real Redis, the real WorkerService, and the null engine (no model, tokens at a set rate)."""
import asyncio
import uuid

from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.store import RequestStore
from tests.waiting import until
from worker.engine.threaded import Threaded
from worker.backends.null_engine import NullEngine
from worker.service.service import WorkerService


def _payload(tenant: str, tier: str = "default") -> RequestPayload:
    return RequestPayload(id=str(uuid.uuid4()), model="m", prompt_token_ids=[1, 2], tenant=tenant,
                          params=SamplingParams(max_tokens=3, ignore_eos=True), service_tier=tier)


async def _statuses(store, payloads):
    return [(await store.record(p.id)).status for p in payloads]


async def _start(redis, redis_url, prefix, engine, **settings):
    config = WorkerSettings(redis_url=redis_url, prefix=prefix, served_model_name="m", heartbeat_interval_s=0.2,
                            **settings)
    service = WorkerService(redis, Threaded(engine, "null"), config, "m")
    return service, asyncio.create_task(service.run())


async def _stop(service, task):
    service.stop()
    await asyncio.wait_for(task, 30)


async def test_a_tenant_arriving_behind_a_backlog_starts_within_a_few_admissions(redis, redis_url, prefix):
    """Tenant a queues 40 requests, then tenant b 4, all before the worker starts: the backlog in
    front of b is certain, whatever the machine's load. FIFO would start b's after all 40 of a's;
    fair intake starts them within the first few admissions (each tenant holds half the batch of two)."""
    store = RequestStore(redis, prefix)
    flood, b = [_payload("a") for _ in range(40)], [_payload("b") for _ in range(4)]
    for p in flood + b:
        await store.submit(p)
    service, task = await _start(redis, redis_url, prefix, NullEngine(batch_size=2, tokens_per_s=50),
                                 intake_block_ms=50)

    async def b_done():
        return set(await _statuses(store, b)) == {"done"}
    await until(b_done, what="b's requests done")
    await _stop(service, task)
    records = {p.id: await store.record(p.id) for p in flood + b}
    started = sorted((r.first_token_at, p.tenant) for p in flood + b
                     if (r := records[p.id]).first_token_at is not None)
    assert [tenant for _, tenant in started[:10]].count("b") == 4, started[:10]


async def test_a_new_tenant_wakes_a_worker_blocked_on_the_lanes_it_knew(redis, redis_url, prefix):
    store = RequestStore(redis, prefix)
    # It blocks a minute at a time: only the doorbell can make it read a new lane sooner.
    service, task = await _start(redis, redis_url, prefix, NullEngine(batch_size=2, tokens_per_s=1000),
                                 intake_block_ms=60_000)
    for tenant in ("a", "c", "d"):
        p = _payload(tenant)
        await store.submit(p)

        async def done(p=p):
            return (await store.record(p.id)).status == "done"
        await until(done, timeout_s=30, what=f"{tenant}'s request done")
    service.stop()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_priority_requests_start_before_a_flex_backlog_of_another_tenant(redis, redis_url, prefix):
    """Tenant a queues 40 flex requests, then tenant b 4 priority and 4 default ones, all before the
    worker starts. Fair share alone would interleave them; tiers start b's priority requests
    first, then its default ones, then a's flex backlog."""
    store = RequestStore(redis, prefix)
    flex = [_payload("a", "flex") for _ in range(40)]
    default, prio = [_payload("b") for _ in range(4)], [_payload("b", "priority") for _ in range(4)]
    for p in flex + default + prio:
        await store.submit(p)
    service, task = await _start(redis, redis_url, prefix, NullEngine(batch_size=2, tokens_per_s=50),
                                 intake_block_ms=50)

    async def b_done():
        return set(await _statuses(store, default + prio)) == {"done"}
    await until(b_done, what="b's requests done")
    await _stop(service, task)
    records = {p.id: await store.record(p.id) for p in flex + default + prio}
    started = sorted((r.first_token_at, p.service_tier) for p in flex + default + prio
                     if (r := records[p.id]).first_token_at is not None)
    assert [tier for _, tier in started[:8]] == ["priority"] * 4 + ["default"] * 4, started[:10]
