"""Request records and status changes against a real Redis."""
import asyncio
import json

from shared import redis_keys
from shared.pubsub import ShardPubSub
from shared.messages import Cancel, FinalEvent, RequestPayload, RequestStatus, decode_event
from shared.sampling import SamplingParams
from shared.store import EVENT_FIELD, RequestStore


def _payload(rid="3f1c2a8e-1111-4222-8333-444455556666"):
    return RequestPayload(id=rid, model="m", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4))


async def test_submit_writes_record_and_queues_entry(redis, prefix):
    store = RequestStore(redis, prefix)
    payload = _payload().model_copy(update={"tenant": "alice"})
    await store.submit(payload)
    record = await store.record(payload.id)
    assert (record.status, record.tenant, record.prompt_tokens) == (RequestStatus.QUEUED, "alice", 3)
    # As Redis keeps it: the names and values records had before the schema was said in one place
    raw = await redis.hgetall(redis_keys.request_record(prefix, payload.id))
    assert raw == {"status": "queued", "model": "m", "owner": "alice", "params": payload.params.model_dump_json(),
                   "prompt_tokens": "3", "created_at": repr(payload.created_at)}
    assert await redis.smembers(redis_keys.request_lanes(prefix, "m")) == {"0:alice"}
    entries = await redis.xrange(redis_keys.request_stream(prefix, "m", "0:alice"))
    assert len(entries) == 1
    assert RequestPayload.model_validate_json(entries[0][1]["payload"]) == payload
    assert json.loads(entries[0][1]["payload"])["owner"] == "alice"  # the entry's name for the tenant, as before


async def test_cancel_of_queued_request_ends_it_and_blocks_the_claim(redis, prefix):
    store = RequestStore(redis, prefix)
    payload = _payload()
    await store.submit(payload)
    assert await store.cancel(payload.id, 3) == RequestStatus.QUEUED
    assert (await store.record(payload.id)).status == "cancelled"
    [(_, data)] = await store.events(payload.id)
    final = decode_event(data)
    assert isinstance(final, FinalEvent) and final.finish_reason.value == "cancelled"
    assert await store.claim(payload.id, "w1") is False
    assert await redis.ttl(redis_keys.request_record(prefix, payload.id)) > 0


async def test_cancel_of_running_request_flags_it_and_tells_the_workers(redis, prefix):
    store = RequestStore(redis, prefix)
    payload = _payload()
    await store.submit(payload)
    pubsub = ShardPubSub(redis.connection_pool)  # the workers listen with SSUBSCRIBE
    await pubsub.subscribe(redis_keys.cancel_channel(prefix))
    assert await store.claim(payload.id, "w1") is True
    assert await store.cancel(payload.id, 3) == RequestStatus.RUNNING
    record = await store.record(payload.id)
    assert record.status == "running" and record.cancel_requested and record.worker == "w1"
    message = None
    while message is None or message["type"] != "smessage":
        message = await pubsub.get_message(timeout=5)
        assert message is not None, "no cancel message reached the workers' channel"
    assert Cancel.decode(message["data"]) == Cancel(request_id=payload.id)
    await pubsub.aclose()


async def test_unknown_request_cancel_returns_none(redis, prefix):
    assert await RequestStore(redis, prefix).cancel("3f1c2a8e-0000-4222-8333-444455556666", 0) is None


async def test_concurrent_claims_have_one_winner(redis, prefix):
    store = RequestStore(redis, prefix)
    payload = _payload()
    await store.submit(payload)
    results = await asyncio.gather(*(store.claim(payload.id, f"w{i}") for i in range(8)))
    assert results.count(True) == 1


async def test_events_reads_after_a_given_entry(redis, prefix):
    store = RequestStore(redis, prefix)
    log = redis_keys.token_log(prefix, "r")
    ids = [await redis.xadd(log, {EVENT_FIELD: f'{{"type":"token","index":{i},"token_id":0,"text":"x"}}'})
           for i in range(3)]
    assert [e for e, _ in await store.events("r")] == ids
    assert [e for e, _ in await store.events("r", ids[0])] == ids[1:]


async def test_a_retried_claim_by_the_same_worker_still_holds(redis, prefix):
    store = RequestStore(redis, prefix)
    payload = _payload()
    await store.submit(payload)
    assert await store.claim(payload.id, "w1") is True
    assert await store.claim(payload.id, "w1") is True  # its first answer was lost: still ours
    assert await store.claim(payload.id, "w2") is False
