"""Prefix affinity on a real Redis: the api marks a request for the live worker that announced its
prompt's prefix; that worker takes it first, the others only once it has waited the bound."""
import asyncio
import json
import uuid

from shared import redis_keys
from shared.heartbeat import Heartbeat
from shared.messages import RequestPayload
from shared.prefix_affinity import PrefixAffinity
from shared.queue import RequestQueue, lane_of
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.store import RequestStore
from tests.waiting import until
from worker.engine.threaded import Threaded
from worker.service.intake import Intake
from worker.backends.null_engine import NullEngine
from worker.service.service import WorkerService

TOKENS = 8  # leading tokens that identify a prefix, here
SYSTEM = list(range(100, 100 + 2 * TOKENS))  # a shared "system prompt"
HOUR_MS = 3_600_000


def _payload(prompt: list[int] = SYSTEM, tenant: str = "t", backend: str | None = None,
             affinity: str | None = None) -> RequestPayload:
    return RequestPayload(id=str(uuid.uuid4()), model="m", prompt_token_ids=[*prompt, 7], tenant=tenant,
                          params=SamplingParams(max_tokens=3, ignore_eos=True), backend=backend, affinity=affinity)


async def _beat(redis, prefix, worker: str, model: str = "m", backend: str = "null") -> None:
    """A heartbeat, as a live worker writes it."""
    beat = Heartbeat(worker=worker, model=model, backend=backend, capacity=8, running=0, waiting=0, metrics_port=None,
                     deterministic=False, batch_invariant=False, pools=False, lora=False, adapters=[], plan={},
                     at=0.0, generated_tokens=0, ttft_sum_s=0.0, ttft_count=0)
    await redis.set(redis_keys.worker_heartbeat(prefix, worker), beat.encode())


async def _routed(redis, prefix, payload: RequestPayload) -> RequestPayload:
    """What the api does at enqueue: look the prefix up, then queue the request in its lane."""
    await PrefixAffinity(redis, prefix, "m", TOKENS).route([payload])
    await RequestStore(redis, prefix).enqueue([payload])
    return payload


def _intake(redis, prefix, worker: str, wait_ms: int | None) -> Intake:
    return Intake(redis, RequestQueue(redis, prefix, "m"), worker, ttl_s=6, affinity_wait_ms=wait_ms)


async def test_a_request_goes_to_the_live_worker_that_announced_its_prefix(redis, prefix):
    affinity = PrefixAffinity(redis, prefix, "m", TOKENS)
    await _beat(redis, prefix, "w1")
    await affinity.announce("w1", [_payload()], ttl_ms=HOUR_MS)
    same, other, short = _payload(), _payload(prompt=list(range(500, 520))), _payload(prompt=SYSTEM[:TOKENS - 1])
    await affinity.route([same, other, short])
    assert (same.affinity, other.affinity, short.affinity) == ("w1", None, None)
    assert lane_of(same) == "^w1/0:t"


async def test_of_several_holders_the_one_with_most_free_slots_gets_it(redis, prefix):
    affinity = PrefixAffinity(redis, prefix, "m", TOKENS)
    for worker in ("w1", "w2", "w3", "w4", "w5"):
        await _beat(redis, prefix, worker)
        await affinity.announce(worker, [_payload()], ttl_ms=HOUR_MS)
    held = await redis.hget(affinity.holders_key, affinity.hash_of(_payload()))
    assert [h.partition(":")[2] for h in held.split("/")] == ["w5", "w4", "w3", "w2"]  # the latest few
    request = _payload()
    await affinity.route([request])
    assert request.affinity == "w5"  # none announced free slots: the latest
    free_key = redis_keys.worker_free_slots(prefix, "m")
    await redis.hset(free_key, mapping={"w5": f"1:{2**52}", "w3": f"6:{2**52}", "w2": f"8:{2**52}", "w1": f"9:{2**52}"})
    await affinity.route([request])
    assert request.affinity == "w2"  # w1, with more room, no longer holds it
    await redis.delete(redis_keys.worker_heartbeat(prefix, "w2"))
    await affinity.route([request])
    assert request.affinity == "w3"


async def test_the_worker_that_announced_a_prefix_takes_its_request_though_another_reads_first(redis, prefix):
    await _beat(redis, prefix, "w1")
    await PrefixAffinity(redis, prefix, "m", TOKENS).announce("w1", [_payload()], ttl_ms=HOUR_MS)
    request = await _routed(redis, prefix, _payload())
    w1, w2 = _intake(redis, prefix, "w1", HOUR_MS), _intake(redis, prefix, "w2", HOUR_MS)
    lanes, _ = await w2.lanes("null")
    first = await w2.take(lanes, free=8, idle=True)
    assert first.entries == [] and 0 < first.due_in_ms <= HOUR_MS  # it wakes when the entry is due
    second = await w1.take(lanes, free=8, idle=True)
    assert [json.loads(f["payload"])["id"] for _, _, f in second.entries] == [request.id]


async def test_past_the_bound_any_worker_takes_it(redis, prefix):
    await _beat(redis, prefix, "w1")
    await PrefixAffinity(redis, prefix, "m", TOKENS).announce("w1", [_payload()], ttl_ms=HOUR_MS)
    request = await _routed(redis, prefix, _payload())
    assert request.affinity == "w1"
    lanes, _ = await _intake(redis, prefix, "w2", 0).lanes("null")
    assert (await _intake(redis, prefix, "w2", HOUR_MS).take(lanes, free=8, idle=True)).entries == []
    taken = await _intake(redis, prefix, "w2", 0).take(lanes, free=8, idle=True)  # bound 0: due at once
    assert [json.loads(f["payload"])["id"] for _, _, f in taken.entries] == [request.id]


async def test_an_empty_affinity_lane_goes_once_its_worker_stops_reading(redis, prefix):
    request = _payload(affinity="w1")
    await RequestStore(redis, prefix).enqueue([request])
    w1, w2 = _intake(redis, prefix, "w1", HOUR_MS), _intake(redis, prefix, "w2", HOUR_MS)
    lanes, _ = await w1.lanes("null")
    [(stream, entry_id, _)] = (await w1.take(lanes, free=8, idle=True)).entries
    lanes_key = redis_keys.request_lanes(prefix, "m")
    assert (await w2.take(lanes, free=8, idle=True)).abandoned == []  # taken, not acked yet
    await redis.xack(stream, redis_keys.WORKER_GROUP, entry_id)
    assert (await w2.take(lanes, free=8, idle=True)).abandoned == []  # empty, but w1 reads
    await w1.withdraw()
    taken = await w2.take(lanes, free=8, idle=True)
    assert taken.abandoned == [stream] and "^w1/0:t" in await redis.smembers(lanes_key)  # the take removes nothing
    assert await w2.drop(taken.abandoned) == [stream]
    assert "^w1/0:t" not in await redis.smembers(lanes_key) and not await redis.exists(stream)
    again = _payload(affinity="w1")  # queued there later: the lane comes back, with its group
    await RequestStore(redis, prefix).enqueue([again])
    lanes, _ = await w1.lanes("null")
    assert [json.loads(f["payload"])["id"] for _, _, f in (await w1.take(lanes, 8, True)).entries] == [again.id]


async def test_a_lane_goes_only_if_still_abandoned_when_the_drop_runs(redis, prefix):
    """A take only reports a lane that looks abandoned; the drop checks again in its own script, so a
    request queued there, or its worker back, in between keeps the lane."""
    store, lanes_key = RequestStore(redis, prefix), redis_keys.request_lanes(prefix, "m")
    await store.enqueue([_payload(affinity="w1")])
    w1, w2 = _intake(redis, prefix, "w1", HOUR_MS), _intake(redis, prefix, "w2", HOUR_MS)
    lanes, _ = await w1.lanes("null")
    [(stream, entry_id, _)] = (await w1.take(lanes, free=8, idle=True)).entries
    await redis.xack(stream, redis_keys.WORKER_GROUP, entry_id)
    await w1.withdraw()  # abandoned now, as a take would report it
    again = _payload(affinity="w1")
    await store.enqueue([again])  # queued between that take and the drop
    assert await w2.drop([stream]) == [] and "^w1/0:t" in await redis.smembers(lanes_key)
    [(_, entry_id, fields)] = (await w1.take(lanes, free=8, idle=True)).entries  # w1 is back
    assert json.loads(fields["payload"])["id"] == again.id
    await redis.xack(stream, redis_keys.WORKER_GROUP, entry_id)
    assert await w2.drop([stream]) == [] and "^w1/0:t" in await redis.smembers(lanes_key)
    await w1.withdraw()
    assert await w2.drop([stream]) == [stream]
    assert "^w1/0:t" not in await redis.smembers(lanes_key) and not await redis.exists(stream)


async def test_without_affinity_a_worker_reads_every_lane_as_its_own(redis, prefix):
    request = _payload(affinity="w1")  # marked for w1 by an api with affinity on
    await RequestStore(redis, prefix).enqueue([request])
    w2 = _intake(redis, prefix, "w2", None)
    lanes, _ = await w2.lanes("null")
    assert [json.loads(f["payload"])["id"] for _, _, f in (await w2.take(lanes, 8, True)).entries] == [request.id]


async def test_an_announcement_of_a_dead_or_other_worker_routes_nothing(redis, prefix):
    affinity = PrefixAffinity(redis, prefix, "m", TOKENS)
    await affinity.announce("gone", [_payload()], ttl_ms=HOUR_MS)  # no heartbeat: it died
    request = _payload()
    await affinity.route([request])
    assert request.affinity is None
    await _beat(redis, prefix, "gone", model="another-model")  # a name now used by another model's worker
    await affinity.route([request])
    assert request.affinity is None
    await _beat(redis, prefix, "gone", backend="hf")
    vllm_only = _payload(backend="vllm")
    await affinity.route([vllm_only, request])
    assert (vllm_only.affinity, request.affinity) == (None, "gone")


async def test_an_expired_announcement_routes_nothing_and_is_dropped(redis, prefix):
    affinity = PrefixAffinity(redis, prefix, "m", TOKENS)
    await _beat(redis, prefix, "w1")
    stale = affinity.hash_of(_payload())
    await redis.hset(affinity.holders_key, stale, "1:w1")  # announced long ago
    await redis.zadd(affinity.expiry_key, {stale: 1})
    request = _payload()
    await affinity.route([request])
    assert request.affinity is None
    await affinity.announce("w2", [_payload(prompt=list(range(500, 520)))], ttl_ms=HOUR_MS)  # any announcement prunes
    assert stale not in await redis.hgetall(affinity.holders_key)
    assert await redis.zscore(affinity.expiry_key, stale) is None


async def _service(redis, redis_url, prefix, wait_ms: int) -> tuple[WorkerService, asyncio.Task]:
    config = WorkerSettings(redis_url=redis_url, prefix=prefix, served_model_name="m", heartbeat_interval_s=0.2,
                            intake_block_ms=60_000, prefix_affinity_tokens=TOKENS, prefix_affinity_wait_ms=wait_ms)
    service = WorkerService(redis, Threaded(NullEngine(8, 1000.0), "null"), config, "m")
    return service, asyncio.create_task(service.run())


async def _idle(redis, prefix, services) -> None:
    free_key = redis_keys.worker_free_slots(prefix, "m")

    async def all_waiting() -> bool:
        announced = await redis.hgetall(free_key)
        return all(announced.get(s.name, "").startswith("8:") for s, _ in services)
    await until(all_waiting, what="every worker idle, reading the lanes")


async def _workers_of(store, payloads) -> list[str]:
    async def all_done() -> bool:
        return all([(await store.record(p.id)).status == "done" for p in payloads])
    await until(all_done, what="every request done")
    return [(await store.record(p.id)).worker for p in payloads]


async def _stop(services) -> None:
    for service, task in services:
        service.stop()
        task.cancel()
    await asyncio.gather(*(task for _, task in services), return_exceptions=True)


async def test_requests_follow_the_worker_that_ran_their_prefix(redis, redis_url, prefix):
    store = RequestStore(redis, prefix)
    holder = await _service(redis, redis_url, prefix, HOUR_MS)
    await _idle(redis, prefix, [holder])
    first = await _routed(redis, prefix, _payload())  # only one worker yet: it runs it, and announces the prefix
    assert await _workers_of(store, [first]) == [holder[0].name]
    other = await _service(redis, redis_url, prefix, HOUR_MS)
    await _idle(redis, prefix, [holder, other])
    # Both idle; the other wakes on each entry too, and reads as often: it leaves them all.
    burst = [await _routed(redis, prefix, _payload()) for _ in range(6)]
    assert {p.affinity for p in burst} == {holder[0].name}
    assert await _workers_of(store, burst) == [holder[0].name] * 6
    # Another tenant's same prompt is not routed by this tenant's prefix (shared/prefix_scope.py).
    stranger = await _routed(redis, prefix, _payload(tenant="b"))
    assert stranger.affinity is None
    await _stop([holder, other])


async def test_a_dead_workers_affinity_lane_drains_after_the_bound(redis, redis_url, prefix):
    # The only live worker blocks a minute at a time: it takes the entry because it wakes when the
    # entry is due, not at its next read.
    store = RequestStore(redis, prefix)
    survivor = await _service(redis, redis_url, prefix, wait_ms=200)
    await _idle(redis, prefix, [survivor])
    orphan = _payload(affinity="dead-worker")  # marked while that worker was alive
    await store.enqueue([orphan])
    assert await _workers_of(store, [orphan]) == [survivor[0].name]
    lanes_key = redis_keys.request_lanes(prefix, "m")

    async def dropped() -> bool:  # the survivor's next take finds the lane abandoned, and drops it
        return lane_of(orphan) not in await redis.smembers(lanes_key)
    await until(dropped, what="the dead worker's drained lane dropped")
    assert not await redis.exists(RequestQueue(redis, prefix, "m").stream_of(orphan))
    await _stop([survivor])
