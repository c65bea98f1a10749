"""Scheduler jobs against a real Redis stream and consumer group."""
import asyncio
import dataclasses
import uuid

from scheduler.jobs import expire_waiting
from shared.reclaim import reclaim_dead_workers
from shared.requeue import Requeue
from shared.messages import FinalEvent, RequestPayload, RequestStatus, TokenEvent, decode_event, encode_event, now
from shared.request_record import RecordField
from shared.sampling import SamplingParams
from shared.store import EVENT_FIELD, RequestStore
from scheduler.jobs import trim_request_stream
from scheduler.jobs import ModelQueues
from scheduler.main import expire, reclaim, trim, worker_settings
from shared.queue import queued_models
from shared import redis_keys
from shared.settings import SchedulerSettings


LANE = "0:-"  # priority 0, no tenant (auth off): where store.submit puts these tests' requests


async def _setup(redis, prefix):
    stream = redis_keys.request_stream(prefix, "m", LANE)
    await redis.sadd(redis_keys.request_lanes(prefix, "m"), LANE)
    await redis.xgroup_create(stream, redis_keys.WORKER_GROUP, id="0", mkstream=True)
    ids = [await redis.xadd(stream, {"payload": str(i)}) for i in range(5)]
    await redis.xreadgroup(redis_keys.WORKER_GROUP, "w1", {stream: ">"}, count=3)
    await redis.xack(stream, redis_keys.WORKER_GROUP, ids[0], ids[1])
    return stream, ids


async def test_trim_keeps_pending_and_unread_entries(redis, prefix):
    stream, ids = await _setup(redis, prefix)
    assert await trim_request_stream(redis, prefix, "m") == 2
    assert [e for e, _ in await redis.xrange(stream)] == ids[2:]
    assert await trim_request_stream(redis, prefix, "m") == 0  # safe to run again


async def test_trim_of_a_missing_stream_does_nothing(redis, prefix):
    assert await trim_request_stream(redis, prefix, "nobody") == 0


def _context(settings: SchedulerSettings, redis) -> dict:
    """The jobs' ctx, as the scheduler's on_startup fills it."""
    return {"settings": settings, "streamq_redis": redis,
            "queues": ModelQueues(settings.served_model_name, settings.trim_interval_s)}


async def test_cron_job_reads_settings_from_the_context(redis, redis_url, prefix):
    # The scheduler names another model: it trims "m" because "m" has a queue.
    settings = SchedulerSettings(redis_url=redis_url, prefix=prefix, served_model_name="own")
    stream, ids = await _setup(redis, prefix)
    assert await trim(_context(settings, redis)) == 2
    cls = worker_settings(settings)
    assert cls.queue_name == redis_keys.arq_queue(prefix)
    assert [job.coroutine.__name__ for job in cls.cron_jobs] == ["trim", "reclaim", "expire", "keep"]
    assert all(job.name.startswith(redis_keys.ARQ_TAG) for job in cls.cron_jobs)  # arq's cron job ids: in its slot


async def _running_request(redis, prefix, consumer="w-dead", tokens=2, **record):
    """A request a worker took and delivered `tokens` tokens of, as a worker leaves it; `record`
    changes its record's fields, by their RequestRecord names (attempts=2)."""
    store = RequestStore(redis, prefix)
    stream = redis_keys.request_stream(prefix, "m", LANE)
    payload = RequestPayload(id="7d1c2a8e-1111-4222-8333-444455556666", model="m", prompt_token_ids=[1, 2],
                             params=SamplingParams(max_tokens=8))
    await store.submit(payload)
    [(_, [(entry_id, _)])] = await redis.xreadgroup(redis_keys.WORKER_GROUP, consumer, {stream: ">"})
    assert await store.claim(payload.id, consumer)
    for i in range(tokens):
        await redis.xadd(redis_keys.token_log(prefix, payload.id),
                         {EVENT_FIELD: encode_event(TokenEvent(index=i, token_id=5, text="x"))})
    if record:
        changed = dataclasses.replace(await store.record(payload.id), **record)
        await redis.hset(redis_keys.request_record(prefix, payload.id), mapping=changed.fields())
    return store, stream, payload, entry_id


async def test_a_dead_workers_request_is_queued_again_once(redis, prefix):
    store, stream, payload, entry_id = await _running_request(redis, prefix)
    outcomes = await asyncio.gather(*(reclaim_dead_workers(redis, prefix, "m", 0.0, 3) for _ in range(3)))
    # Three reclaimers at once (a TTL of 0 lets every one of them claim): one requeue.
    assert sum(o.get("requeued", 0) for o in outcomes) == 1
    assert sum(o.get("dead", 0) for o in outcomes) == 0
    record = await store.record(payload.id)
    assert record.status == "queued" and record.attempts == 1
    entries = await redis.xrange(stream)
    assert [e for e, _ in entries][-1] != entry_id
    assert RequestPayload.model_validate_json(entries[-1][1]["payload"]) == payload
    assert (await redis.xpending(stream, redis_keys.WORKER_GROUP))["pending"] == 0
    # The next worker reads it like any new request, and can claim it.
    [(_, [(new_entry, _)])] = await redis.xreadgroup(redis_keys.WORKER_GROUP, "w-new", {stream: ">"})
    assert await store.claim(payload.id, "w-new")


async def test_a_live_worker_keeps_its_requests(redis, prefix):
    store, stream, payload, _ = await _running_request(redis, prefix, consumer="w-live")
    await redis.set(redis_keys.worker_heartbeat(prefix, "w-live"), "{}", px=60_000)
    assert await reclaim_dead_workers(redis, prefix, "m", 0.0, 3) == {}
    assert (await store.record(payload.id)).status == "running"


async def test_a_poison_request_goes_to_the_dead_letter_stream(redis, prefix):
    store, stream, payload, _ = await _running_request(redis, prefix, attempts=2)
    assert await reclaim_dead_workers(redis, prefix, "m", 0.0, 3) == {"dead": 1}
    record = await store.record(payload.id)
    assert record.status == "failed" and "3 times" in record.error
    [(_, dead)] = await redis.xrange(redis_keys.dead_letter_stream(prefix))
    assert dead["id"] == payload.id
    final = decode_event((await store.events(payload.id))[-1][1])
    assert isinstance(final, FinalEvent) and final.usage.completion_tokens == 2


async def test_a_cancelled_request_of_a_dead_worker_ends_cancelled(redis, prefix):
    store, _, payload, _ = await _running_request(redis, prefix, cancel_requested=True)
    assert await reclaim_dead_workers(redis, prefix, "m", 0.0, 3) == {"cancelled": 1}
    assert (await store.record(payload.id)).status == "cancelled"


async def test_expire_waiting_ends_only_unstarted_requests_past_their_deadline(redis, prefix):
    store = RequestStore(redis, prefix)
    stream = redis_keys.request_stream(prefix, "m", LANE)
    past, future = now() - 10, now() + 600

    def payload(i, expires_at):
        return RequestPayload(id=f"8e1c2a8e-1111-4222-8333-44445555666{i}", model="m", prompt_token_ids=[1],
                              params=SamplingParams(max_tokens=2), expires_at=expires_at)

    started, late, fresh = payload(0, past), payload(1, past), payload(2, future)
    await store.submit(started)
    await redis.xreadgroup(redis_keys.WORKER_GROUP, "w1", {stream: ">"}, count=1)  # a worker took this one
    assert await store.claim(started.id, "w1")
    await store.submit(late)
    await store.submit(fresh)
    assert await expire_waiting(redis, prefix, "m") == 1
    assert (await store.record(late.id)).status == "expired"
    assert (await store.record(fresh.id)).status == "queued"
    assert (await store.record(started.id)).status == "running"
    [(_, data)] = await store.events(late.id)
    assert decode_event(data).finish_reason.value == "expired"
    assert await expire_waiting(redis, prefix, "m") == 0  # safe to run again


async def test_an_entry_a_dead_worker_read_just_before_it_died_is_reclaimed_too(redis, prefix):
    """A dead worker's entries are reclaimed once idle for the TTL. One read just before the
    death is younger than that at the first round: it must stay pending (deleting the consumer
    would drop it, and the request would hang as 'running' forever) and be taken at a later round."""
    store, stream, old, old_entry = await _running_request(redis, prefix)
    young = RequestPayload(id="7d1c2a8e-2222-4222-8333-444455556666", model="m", prompt_token_ids=[3],
                           params=SamplingParams(max_tokens=8))
    await store.submit(young)
    [(_, [(young_entry, _)])] = await redis.xreadgroup(redis_keys.WORKER_GROUP, "w-dead", {stream: ">"})
    assert await store.claim(young.id, "w-dead")
    # Idle times set outright (XCLAIM's IDLE), never waited for: the old entry 60 s, the young one 0.
    await redis.xclaim(stream, redis_keys.WORKER_GROUP, "w-dead", 0, [old_entry], idle=60_000)
    await redis.xclaim(stream, redis_keys.WORKER_GROUP, "w-dead", 0, [young_entry], idle=0)
    assert await reclaim_dead_workers(redis, prefix, "m", 30.0, 3) == {"requeued": 1}
    assert (await store.record(old.id)).status == "queued"
    assert (await store.record(young.id)).status == "running"
    [left] = await redis.xpending_range(stream, redis_keys.WORKER_GROUP, min="-", max="+", count=10,
                                        consumername="w-dead")
    assert left["message_id"] == young_entry
    await redis.xclaim(stream, redis_keys.WORKER_GROUP, "w-dead", 0, [young_entry], idle=60_000)  # time passes
    assert await reclaim_dead_workers(redis, prefix, "m", 30.0, 3) == {"requeued": 1}
    assert (await store.record(young.id)).status == "queued"
    consumers = {c["name"] for c in await redis.xinfo_consumers(stream, redis_keys.WORKER_GROUP)}
    assert "w-dead" not in consumers


async def test_two_schedulers_requeuing_one_entry_queue_it_once_and_count_one_attempt(redis, prefix):
    """Each step of the requeue run twice for the same entry, interleaved as two schedulers that
    both claimed it would run them: one new entry in the lane, one attempt counted."""
    store, stream, payload, entry_id = await _running_request(redis, prefix)
    first, second = Requeue(redis, prefix, 3), Requeue(redis, prefix, 3)
    assert await first.decide(entry_id, payload) == ("requeued", True)
    assert await second.decide(entry_id, payload) == ("requeued", False)  # decided already: the record is kept
    assert await second.release(stream, entry_id, "requeued", payload) == "requeued"
    assert await first.release(stream, entry_id, "requeued", payload) == "gone"  # the second acked it first
    record = await store.record(payload.id)
    assert record.status == "queued" and record.attempts == 1
    assert [e for e, _ in await redis.xrange(stream)][:1] == [entry_id] and await redis.xlen(stream) == 2
    assert (await redis.xpending(stream, redis_keys.WORKER_GROUP))["pending"] == 0


async def test_a_scheduler_that_dies_between_the_two_steps_leaves_one_entry_and_one_attempt(redis, prefix):
    """The record step ran, then the scheduler died before the lane step: the entry is still
    pending on the reclaimer, and the next round finishes the requeue without counting again."""
    store, stream, payload, entry_id = await _running_request(redis, prefix)
    await redis.xclaim(stream, redis_keys.WORKER_GROUP, redis_keys.RECLAIMER, 0, [entry_id])
    assert await Requeue(redis, prefix, 3).decide(entry_id, payload) == ("requeued", True)  # ... and it died
    assert await reclaim_dead_workers(redis, prefix, "m", 0.0, 3) == {"requeued": 1}
    assert (await store.record(payload.id)).attempts == 1
    entries = await redis.xrange(stream)
    assert len(entries) == 2 and entries[0][0] == entry_id
    assert RequestPayload.model_validate_json(entries[1][1]["payload"]) == payload
    assert (await redis.xpending(stream, redis_keys.WORKER_GROUP))["pending"] == 0
    assert await reclaim_dead_workers(redis, prefix, "m", 0.0, 3) == {}  # nothing left to do


async def test_a_dead_request_reaches_the_dead_letter_stream_once_across_a_death_between_the_steps(redis, prefix):
    store, stream, payload, entry_id = await _running_request(redis, prefix, attempts=2)
    await redis.xclaim(stream, redis_keys.WORKER_GROUP, redis_keys.RECLAIMER, 0, [entry_id])
    assert await Requeue(redis, prefix, 3).decide(entry_id, payload) == ("dead", True)
    outcomes = await asyncio.gather(*(reclaim_dead_workers(redis, prefix, "m", 0.0, 3) for _ in range(2)))
    assert sum(o.get("dead", 0) for o in outcomes) == 1
    record = await store.record(payload.id)
    assert record.status == "failed" and record.attempts == 3
    assert len(await redis.xrange(redis_keys.dead_letter_stream(prefix))) == 1
    assert len([e for e in await store.events(payload.id) if isinstance(decode_event(e[1]), FinalEvent)]) == 1


async def test_a_stale_entry_of_an_already_requeued_request_changes_nothing(redis, prefix):
    """A scheduler that claimed the first entry and stalled past a whole second requeue: its
    record step sees an entry older than the one recorded and leaves the record alone."""
    store, stream, payload, entry_id = await _running_request(redis, prefix)
    requeue = Requeue(redis, prefix, 3)
    assert await requeue(stream, entry_id, {"payload": payload.model_dump_json()}) == "requeued"
    [(_, [(second_entry, _)])] = await redis.xreadgroup(redis_keys.WORKER_GROUP, "w2", {stream: ">"})
    assert await store.claim(payload.id, "w2")
    assert await requeue(stream, second_entry, {"payload": payload.model_dump_json()}) == "requeued"
    assert await requeue.decide(entry_id, payload) == ("stale", False)
    assert await requeue.release(stream, entry_id, "stale", payload) == "gone"
    record = await store.record(payload.id)
    assert record.attempts == 2 and record.requeued_from == second_entry


async def test_keep_responses_keeps_a_finished_request_as_long_as_its_response(redis, prefix):
    """A response kept 48 h: once its request has ended, the request's record and log last as
    long as the response; a running one is left for next time; a gone response leaves the set."""
    import json

    from scheduler.jobs import keep_responses

    kept = redis_keys.kept_responses(prefix)
    day = redis_keys.RESULT_TTL_S
    for name, status in (("done", RequestStatus.DONE), ("running", RequestStatus.RUNNING), ("gone", RequestStatus.DONE)):
        await redis.hset(redis_keys.request_record(prefix, name), RecordField.STATUS, status)
        await redis.expire(redis_keys.request_record(prefix, name), day)
        await redis.xadd(redis_keys.token_log(prefix, name), {EVENT_FIELD: "x"})
        await redis.expire(redis_keys.token_log(prefix, name), day)
        if name != "gone":
            response = redis_keys.response_record(prefix, "t", f"resp_{name}")
            await redis.hset(response, mapping={"request_id": name})
            await redis.expire(response, 2 * day)
        await redis.zadd(kept, {json.dumps(["t", f"resp_{name}", name]): 1})
    assert await keep_responses(redis, prefix) == 1
    assert await redis.ttl(redis_keys.token_log(prefix, "done")) > day + 3600
    assert await redis.ttl(redis_keys.request_record(prefix, "done")) > day + 3600
    for name in ("running", "gone"):
        assert await redis.ttl(redis_keys.token_log(prefix, name)) <= day
    assert [json.loads(m)[2] for m in await redis.zrange(kept, 0, -1)] == ["running"]
    await redis.hset(redis_keys.request_record(prefix, "running"), RecordField.STATUS, RequestStatus.CANCELLED)
    assert await keep_responses(redis, prefix) == 1 and await redis.zcard(kept) == 0
    assert await redis.ttl(redis_keys.token_log(prefix, "running")) > day + 3600


async def test_every_model_with_a_queue_is_found(redis, prefix):
    for model in ("m", "other/model-1"):
        await RequestStore(redis, prefix).submit(RequestPayload(id=str(uuid.uuid4()), model=model,
                                                                prompt_token_ids=[1], params=SamplingParams(max_tokens=2)))
    await redis.sadd(redis_keys.request_lanes("elsewhere", "x"), LANE)  # another deployment's prefix
    assert await queued_models(redis, prefix) == {"m", "other/model-1"}


async def test_the_jobs_tend_a_model_the_scheduler_was_not_started_with(redis, redis_url, prefix):
    """A scheduler started for "own" reclaims and expires the requests of "m", whose only worker died."""
    settings = SchedulerSettings(redis_url=redis_url, prefix=prefix, served_model_name="own")
    store, stream, payload, entry_id = await _running_request(redis, prefix)
    # Pending for a minute on the dead worker: past any heartbeat TTL, without waiting one.
    await redis.xclaim(stream, redis_keys.WORKER_GROUP, "w-dead", 0, [entry_id], idle=60_000, justid=True)
    late = RequestPayload(id=str(uuid.uuid4()), model="m", prompt_token_ids=[1], params=SamplingParams(max_tokens=2), expires_at=now() - 10)
    await store.submit(late)
    ctx = _context(settings, redis)
    assert await reclaim(ctx) == {"requeued": 1}
    record = await store.record(payload.id)
    assert record.status == "queued" and record.attempts == 1
    assert await expire(ctx) == 1
    assert (await store.record(late.id)).status == "expired"
