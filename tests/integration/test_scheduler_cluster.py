"""The scheduler on a real Redis Cluster (streamq/testing/redis_cluster.py): the requeue of a dead
worker's request in its two one-slot steps, arq's jobs in their one slot, and the scheduler's
arq worker following that slot to the replica promoted when its master dies."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis
from arq.worker import create_worker

from shared.reclaim import reclaim_dead_workers
from scheduler.main import supervise, worker_settings
from shared.requeue import Requeue
from shared import redis_keys
from shared.arq_cluster import ArqSlot, arq_pool, parse_cluster_url
from shared.batch_record import BatchField, BatchRecord, BatchStatus
from shared.messages import RequestPayload, RequestStatus
from shared.redis_client import connect
from shared.request_record import RecordField, RequestRecord
from shared.sampling import SamplingParams
from shared.settings import SchedulerSettings
from streamq.testing.redis_cluster import RedisCluster
from tests.waiting import until

LANE = "0:-"
RID = "7d1c2a8e-1111-4222-8333-444455556666"


def _url(cluster: RedisCluster) -> str:
    """Every node as a seed: the test kills a master, which may be the first."""
    return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in cluster.nodes)


@pytest.fixture
def cluster(tmp_path):
    running = RedisCluster(tmp_path, masters=3)
    running.start()
    yield running
    running.stop()


@pytest.fixture
async def client(cluster):
    on_cluster = connect(_url(cluster))
    yield on_cluster
    await on_cluster.aclose()


async def _taken_by_a_dead_worker(client, stream: str, prefix: str) -> tuple[RequestPayload, str]:
    """A running request whose entry a worker read and died with (it has no heartbeat)."""
    payload = RequestPayload(id=RID, model="m", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=8))
    await client.xgroup_create(stream, redis_keys.WORKER_GROUP, id="0", mkstream=True)
    await client.hset(redis_keys.request_record(prefix, RID), mapping={RecordField.STATUS: RequestStatus.RUNNING,
                                                                         RecordField.WORKER: "w-dead"})
    await client.xadd(stream, {"payload": payload.model_dump_json()})
    [(_, [(entry_id, _)])] = await client.xreadgroup(redis_keys.WORKER_GROUP, "w-dead", {stream: ">"})
    return payload, entry_id


async def test_the_requeue_runs_on_a_cluster_once_across_two_schedulers_and_a_death(client, prefix):
    stream = redis_keys.request_stream(prefix, "m", LANE)
    record = redis_keys.request_record(prefix, RID)
    assert client.keyslot(stream) != client.keyslot(record)  # one script over both would fail here
    payload, entry_id = await _taken_by_a_dead_worker(client, stream, prefix)
    first, second = Requeue(client, prefix, 3), Requeue(client, prefix, 3)
    assert await first.decide(entry_id, payload) == ("requeued", True)  # then this scheduler dies
    assert await second.decide(entry_id, payload) == ("requeued", False)
    assert await second.release(stream, entry_id, "requeued", payload) == "requeued"
    assert await first(stream, entry_id, {"payload": payload.model_dump_json()}) == "gone"  # its next round
    assert RequestRecord.of(await client.hgetall(record)).attempts == 1
    entries = await client.xrange(stream)
    assert [e for e, _ in entries][0] == entry_id and len(entries) == 2
    assert RequestPayload.model_validate_json(entries[1][1]["payload"]) == payload
    assert (await client.xpending(stream, redis_keys.WORKER_GROUP))["pending"] == 0


async def test_reclaim_runs_on_a_cluster_and_a_poison_request_reaches_the_dead_letter_stream(client, prefix):
    stream = redis_keys.request_stream(prefix, "m", LANE)
    await client.sadd(redis_keys.request_lanes(prefix, "m"), LANE)
    payload, _ = await _taken_by_a_dead_worker(client, stream, prefix)
    await client.hset(redis_keys.request_record(prefix, RID), RecordField.ATTEMPTS, 2)
    outcomes = await asyncio.gather(*(reclaim_dead_workers(client, prefix, "m", 0.0, 3) for _ in range(3)))
    assert sum(o.get("dead", 0) for o in outcomes) == 1
    record = RequestRecord.of(await client.hgetall(redis_keys.request_record(prefix, RID)))
    assert (record.status, record.attempts) == (RequestStatus.FAILED, 3)
    [(_, dead)] = await client.xrange(redis_keys.dead_letter_stream(prefix))
    assert dead["id"] == payload.id
    assert len(await client.xrange(redis_keys.token_log(prefix, RID))) == 1  # one final event


async def _empty_batch(client, prefix: str, batch_id: str) -> None:
    """A batch with no requests: its job only marks it in progress, then completed."""
    record = BatchRecord.created("/v1/completions", "", int(time.time()), 0, None)
    await client.hset(redis_keys.batch_record(prefix, batch_id), mapping=record.fields())


async def _batch_status(client, prefix: str, batch_id: str) -> str | None:
    return await client.hget(redis_keys.batch_record(prefix, batch_id), BatchField.STATUS)


async def test_a_batch_job_and_the_cron_jobs_run_on_a_cluster(cluster, client, prefix):
    settings = SchedulerSettings(redis_url=_url(cluster), prefix=prefix, served_model_name="m")
    cls = worker_settings(settings)
    await _empty_batch(client, prefix, "batch_1")
    api_pool = await arq_pool(settings.redis_url, cls.queue_name)  # as the api's lifespan builds it
    try:
        await api_pool.enqueue_job("run_batch", "batch_1", _job_id=redis_keys.arq_job_id(prefix, "batch_1"),
                                   _queue_name=cls.queue_name)
    finally:
        await api_pool.aclose()
    pool = await ArqSlot(parse_cluster_url(settings.redis_url), cls.queue_name).pool(cls.queue_name)
    # The batch job and the four cron jobs that run at startup (trim, reclaim, expire, keep): each
    # finishes in a MULTI with the queue and arq:abort, which fails (CROSSSLOT) unless all lie in
    # one slot. All five are awaited: cancelling the worker while one finishes fails it.
    worker = create_worker(cls, redis_pool=pool, handle_signals=False)
    running = asyncio.create_task(worker.main())

    async def five_done() -> bool:
        assert not running.done() and worker.jobs_failed == 0, running
        return worker.jobs_complete >= 5
    try:
        await until(five_done, 60, "the batch job and the startup cron jobs done")
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        # A periodic cron job (reclaim runs every 2 s) may be finishing when the worker is stopped:
        # arq's close then re-raises its cancellation. What is checked is the five done above.
        with contextlib.suppress(asyncio.CancelledError):
            await worker.close()
    assert await _batch_status(client, prefix, "batch_1") == BatchStatus.COMPLETED
    assert await client.exists(f"arq:result:{redis_keys.arq_job_id(prefix, 'batch_1')}") == 1


async def _follows_the_slot(tmp_path, prefix: str, move) -> None:
    """A batch job runs before and after `move(cluster, queue)` moves arq's slot to another master."""
    cluster = RedisCluster(tmp_path, masters=3, replicas=1)
    try:
        cluster.start()
        settings = SchedulerSettings(redis_url=_url(cluster), prefix=prefix, served_model_name="m")
        queue = redis_keys.arq_queue(prefix)
        client = connect(settings.redis_url)
        api_pool = await arq_pool(settings.redis_url, queue)
        running = asyncio.create_task(supervise(settings))
        try:
            async def run(batch_id: str) -> None:
                await _empty_batch(client, prefix, batch_id)
                await api_pool.enqueue_job("run_batch", batch_id, _job_id=redis_keys.arq_job_id(prefix, batch_id),
                                           _queue_name=queue)

                async def completed() -> bool:
                    return await _batch_status(client, prefix, batch_id) == BatchStatus.COMPLETED
                await until(completed, 60, f"{batch_id} completed")

            await run("batch_before")
            old = cluster.master_of(queue)
            await asyncio.to_thread(move, cluster, queue)
            assert cluster.master_of(queue) is not old
            await run("batch_after")  # enqueued on the new master; run by a fresh arq worker there
            assert not running.done()
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            await api_pool.aclose()
            await client.aclose()
    finally:
        cluster.stop()


async def test_the_scheduler_follows_arqs_slot_to_the_promoted_replica(tmp_path, prefix):
    """The master of arq's slot dies (SIGKILL): its connections drop, a replica takes over."""
    await _follows_the_slot(tmp_path, prefix, lambda cluster, key: cluster.kill_master_of(key))


def _manual_failover(cluster: RedisCluster, key: str) -> None:
    """CLUSTER FAILOVER on the replica of `key`'s master: the old master lives on as a replica
    and answers MOVED for the slot."""
    master = cluster.master_of(key)
    with redis.Redis(port=master.port, decode_responses=True) as client:
        replica_port = int(client.info("replication")["slave0"]["port"])
    with redis.Redis(port=replica_port, decode_responses=True) as client:
        client.execute_command("CLUSTER", "FAILOVER")
    deadline = time.monotonic() + 30
    while cluster.master_of(key) is master:
        assert time.monotonic() < deadline, "the replica did not take over"
        time.sleep(0.1)  # polling the cluster's own failover
    cluster.wait_ok()


async def test_the_scheduler_follows_arqs_slot_when_its_old_master_answers_moved(tmp_path, prefix):
    await _follows_the_slot(tmp_path, prefix, _manual_failover)
