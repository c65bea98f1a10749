"""Several workers on one queue split a burst: real Redis, real WorkerServices, the null engine.

The requests of a burst are queued in one script, so they arrive together whatever the machine's
speed; the null engine emits a token a second, so nothing ends (and frees a slot) meanwhile.
"""
import asyncio
import uuid
from collections import Counter

from shared import redis_keys
from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.store import RequestStore
from tests.waiting import until
from worker.engine.threaded import Threaded
from worker.backends.null_engine import NullEngine
from worker.service.service import WorkerService


def _payload(tenant: str, max_tokens: int = 60) -> RequestPayload:
    return RequestPayload(id=str(uuid.uuid4()), model="m", prompt_token_ids=[1, 2], tenant=tenant,
                          params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _burst(redis, prefix, payloads) -> None:
    """Queue every request in one script: the workers see them all at once."""
    await RequestStore(redis, prefix).enqueue(payloads)


async def _workers(redis, redis_url, prefix, count, batch_size=8, tokens_per_s=1.0):
    services = []
    for _ in range(count):
        config = WorkerSettings(redis_url=redis_url, prefix=prefix, served_model_name="m",
                                heartbeat_interval_s=0.2, intake_block_ms=60_000)
        service = WorkerService(redis, Threaded(NullEngine(batch_size, tokens_per_s), "null"), config, "m")
        services.append((service, asyncio.create_task(service.run())))
    free_key = redis_keys.worker_free_slots(prefix, "m")

    async def all_waiting() -> bool:  # each has announced its room, so each is reading
        announced = await redis.hgetall(free_key)
        return all(announced.get(s.name, "").startswith(f"{batch_size}:") for s, _ in services)
    await until(all_waiting, what="every worker waiting for requests")
    return services


async def _stop(services) -> None:
    for service, task in services:
        service.stop()
        task.cancel()
    await asyncio.gather(*(task for _, task in services), return_exceptions=True)


async def _taken_by(store, payloads) -> Counter:
    async def all_taken() -> bool:
        return all([(await store.record(p.id)).worker for p in payloads])
    await until(all_taken, what="every request taken by a worker")
    return Counter([(await store.record(p.id)).worker for p in payloads])


async def test_idle_workers_split_a_burst_on_a_new_lane(redis, redis_url, prefix):
    # A new lane: every waiting worker must hear of it, not only the first.
    store = RequestStore(redis, prefix)
    services = await _workers(redis, redis_url, prefix, 2)
    burst = [_payload("new-tenant") for _ in range(8)]
    await _burst(redis, prefix, burst)
    taken = await _taken_by(store, burst)
    await _stop(services)
    assert sorted(taken.values()) == [4, 4], taken


async def test_idle_workers_split_a_burst_on_a_lane_they_read(redis, redis_url, prefix):
    store = RequestStore(redis, prefix)
    services = await _workers(redis, redis_url, prefix, 3, tokens_per_s=1000)
    first = _payload("t", max_tokens=1)
    await store.submit(first)

    async def first_done() -> bool:
        return (await store.record(first.id)).status == "done"
    await until(first_done, what="the first request done")
    free_key = redis_keys.worker_free_slots(prefix, "m")

    async def all_idle() -> bool:
        return all(v.startswith("8:") for v in (await redis.hgetall(free_key)).values())
    await until(all_idle, what="every worker idle again")
    for service, _ in services:
        service.backend.engine.interval = 1.0  # from now on nothing ends during the test
    burst = [_payload("t") for _ in range(9)]
    await _burst(redis, prefix, burst)
    taken = await _taken_by(store, burst)
    await _stop(services)
    assert sorted(taken.values()) == [3, 3, 3], taken


async def test_a_busy_worker_leaves_a_burst_to_the_idle_one(redis, redis_url, prefix):
    store = RequestStore(redis, prefix)
    [(busy, busy_task)] = await _workers(redis, redis_url, prefix, 1)
    first = [_payload("x") for _ in range(7)]  # alone, it takes them all: its batch has one slot left
    await _burst(redis, prefix, first)
    assert await _taken_by(store, first) == {busy.name: 7}
    free_key = redis_keys.worker_free_slots(prefix, "m")

    async def busy_announced() -> bool:
        return (await redis.hget(free_key, busy.name) or "").startswith("1:")
    await until(busy_announced, what="the busy worker announcing its one free slot")
    [(idle, idle_task)] = await _workers(redis, redis_url, prefix, 1)
    burst = [_payload("t") for _ in range(6)]
    await _burst(redis, prefix, burst)
    taken = await _taken_by(store, burst)
    await _stop([(busy, busy_task), (idle, idle_task)])
    # Spread to an equal level, 1 and 8 free slots take 0 and 6: they keep 1 and 2 free.
    assert taken == {idle.name: 6}, taken


async def test_an_expired_announcement_is_dropped(redis, redis_url, prefix):
    store = RequestStore(redis, prefix)
    free_key = redis_keys.worker_free_slots(prefix, "m")
    await redis.hset(free_key, "gone", "64:1")  # a worker that died long ago, with room for 64
    services = await _workers(redis, redis_url, prefix, 1)
    burst = [_payload("t") for _ in range(6)]
    await _burst(redis, prefix, burst)
    taken = await _taken_by(store, burst)
    await _stop(services)
    assert list(taken.values()) == [6], taken
    assert "gone" not in await redis.hgetall(free_key)


async def test_an_entry_the_worker_cannot_parse_fails_its_request_alone(redis, redis_url, prefix):
    # Queued by an api with looser bounds (here: built without validation): its client must hear why.
    store = RequestStore(redis, prefix)
    services = await _workers(redis, redis_url, prefix, 1, tokens_per_s=1000)
    bad = _payload("t", max_tokens=3)
    bad.params = SamplingParams.model_construct(**{**bad.params.model_dump(), "top_k": 10**30})
    good = _payload("t", max_tokens=3)
    await store.enqueue([bad, good])

    async def both_ended() -> bool:
        return {(await store.record(p.id)).status for p in (bad, good)} <= {"done", "failed"}
    await until(both_ended, what="both requests ended")
    await _stop(services)
    failed, done = await store.record(bad.id), await store.record(good.id)
    assert failed.status == "failed" and "top_k" in failed.error, failed
    assert done.status == "done" and done.completion_tokens == 3, done
    final = [e for _, e in await store.events(bad.id)]
    assert len(final) == 1 and '"failed"' in final[0], final
