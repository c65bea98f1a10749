"""The scheduler's batch job against a real Redis: it keeps a batch inside its tenant's limits and
ends it at its completion window, with its output and error files. The test plays the worker: it
reads the lanes with the workers' consumer group and moves the records, between the job's polls
(the job's `sleep`), with the job's clock in its hands."""
import json
import uuid

from api.core.limits import Limits
from scheduler.batches import EXPIRED_MESSAGE, BatchJob
from shared import redis_keys
from shared.batch_record import BatchEntry, BatchRecord
from shared.files import FileStore
from shared.messages import RequestPayload, RequestStatus
from shared.queue import RequestQueue
from shared.request_record import RecordField
from shared.sampling import SamplingParams
from shared.store import RequestStore

MODEL = "tiny"
NOW = 1_800_000_000.0


class Worker:
    """Takes every queued request (the lanes' lag back to 0) and runs it until told to finish it."""

    def __init__(self, redis, prefix: str, ids: list[str]):
        self.redis, self.prefix, self.ids = redis, prefix, ids
        self.store = RequestStore(redis, prefix)
        self.most_running = 0

    async def take(self) -> None:
        for stream in await RequestQueue(self.redis, self.prefix, MODEL).streams():
            await self.redis.xreadgroup(redis_keys.WORKER_GROUP, "w1", {stream: ">"})
        for rid in self.ids:
            await self.store.claim(rid, "w1")  # only a queued record becomes running
        self.most_running = max(self.most_running, len(await self.running()))

    async def running(self) -> list[str]:
        return [rid for rid in self.ids
                if await self.redis.hget(redis_keys.request_record(self.prefix, rid), RecordField.STATUS)
                == RequestStatus.RUNNING]

    async def finish(self, rid: str) -> None:
        await self.redis.hset(redis_keys.request_record(self.prefix, rid), mapping={
            RecordField.STATUS: RequestStatus.DONE, RecordField.FINISH_REASON: "stop",
            RecordField.COMPLETION_TOKENS: 1})


async def _batch(redis, prefix: str, tenant: str, n: int, window: str = "24h") -> tuple[str, list[str]]:
    batch_id = f"batch_{uuid.uuid4().hex}"
    payloads = [RequestPayload(id=str(uuid.uuid4()), model=MODEL, prompt_token_ids=[1, 2, 3], tenant=tenant,
                               params=SamplingParams(max_tokens=7)) for _ in range(n)]
    items = [BatchEntry(custom_id=f"q{i}", endpoint="/v1/completions", payload=p).encode()
             for i, p in enumerate(payloads)]
    await redis.rpush(redis_keys.batch_items(prefix, batch_id), *items)
    record = BatchRecord.created("/v1/completions", tenant, int(NOW), n, None, window)
    await redis.hset(redis_keys.batch_record(prefix, batch_id), mapping=record.fields())
    return batch_id, [p.id for p in payloads]


def _job(redis, prefix: str, batch_id: str, clock, sleep) -> BatchJob:
    return BatchJob(redis, prefix, MODEL, batch_id, 4, FileStore(redis, prefix, 3600), Limits(redis, prefix, 600),
                    clock=clock, sleep=sleep)


async def _lines(files: FileStore, tenant: str, file_id: str) -> list[dict]:
    return [json.loads(line) for line in (await files.content(tenant, file_id)).decode().splitlines()]


async def test_a_batch_runs_no_more_requests_at_once_than_its_tenant_may(redis, prefix):
    await Limits(redis, prefix, 600).set("acme", concurrent=2)
    batch_id, ids = await _batch(redis, prefix, "acme", 4)
    worker, clock = Worker(redis, prefix, ids), [NOW]

    async def sleep(_: float) -> None:
        await worker.take()
        clock[0] += 1  # past the Retry-After of a refused charge
        running = await worker.running()
        if running and clock[0] % 3 == 0:  # two polls of the job with its slots taken, then one ends
            await worker.finish(running[0])

    result = await _job(redis, prefix, batch_id, lambda: clock[0], sleep).run()
    assert result == {"requests": 4, "status": "completed"}
    assert worker.most_running == 2  # the batch's own concurrency is 4: the tenant's 2 held it
    record = BatchRecord.of(await redis.hgetall(redis_keys.batch_record(prefix, batch_id)))
    assert (record.completed, record.failed, record.error_file_id) == (4, 0, "")
    files = FileStore(redis, prefix, 3600)
    assert [line["custom_id"] for line in await _lines(files, "acme", record.output_file_id)] == \
        ["q0", "q1", "q2", "q3"]
    assert await files.content("other", record.output_file_id) is None  # its tenant's file only


async def test_a_request_past_the_tenants_tokens_per_minute_fails_alone(redis, prefix):
    await Limits(redis, prefix, 600).set("acme", tpm=5)  # each request reserves 3 + 7 tokens
    batch_id, ids = await _batch(redis, prefix, "acme", 1)
    worker = Worker(redis, prefix, ids)
    result = await _job(redis, prefix, batch_id, lambda: NOW, lambda _: worker.take()).run()
    assert result["status"] == "completed"
    record = BatchRecord.of(await redis.hgetall(redis_keys.batch_record(prefix, batch_id)))
    [line] = await _lines(FileStore(redis, prefix, 3600), "acme", record.error_file_id)
    assert line["error"]["code"] == "rate_limit_exceeded"
    assert await redis.exists(redis_keys.request_record(prefix, ids[0])) == 0  # never queued


async def test_at_its_windows_end_a_batch_expires_and_its_unfinished_requests_fail(redis, prefix):
    batch_id, ids = await _batch(redis, prefix, "", 4, window="1h")
    worker, clock = Worker(redis, prefix, ids), [NOW]
    job = _job(redis, prefix, batch_id, lambda: clock[0], None)
    job.concurrency = 2

    async def sleep(_: float) -> None:
        await worker.take()
        running = await worker.running()
        if len(running) == 2 and clock[0] == NOW:
            await worker.finish(running[0])  # one ends in time; the other runs on at the window's end
            clock[0] += 1
        elif clock[0] > NOW:
            clock[0] = NOW + 3600

    job.sleep = sleep
    assert (await job.run())["status"] == "expired"
    record = BatchRecord.of(await redis.hgetall(redis_keys.batch_record(prefix, batch_id)))
    assert (record.status, record.completed, record.failed) == ("expired", 1, 3)
    files = FileStore(redis, prefix, 3600)
    errors = await _lines(files, "", record.error_file_id)
    assert errors and {line["error"]["code"] for line in errors} == {"batch_expired"}
    assert {line["error"]["message"] for line in errors} == {EXPIRED_MESSAGE}
    assert [line["custom_id"] for line in errors] == ["q1", "q2", "q3"]
    assert [line["custom_id"] for line in await _lines(files, "", record.output_file_id)] == ["q0"]
    # The one running at the window's end is cancelled (its worker stops it); the last two never ran
    assert await redis.hget(redis_keys.request_record(prefix, ids[1]), RecordField.CANCEL_REQUESTED) == "1"
    assert not any([await redis.exists(redis_keys.request_record(prefix, rid)) for rid in ids[2:]])
    assert record.expired_at is not None and record.completed_at is None


async def test_a_job_started_after_the_window_runs_nothing(redis, prefix):
    batch_id, ids = await _batch(redis, prefix, "", 2, window="1h")
    result = await _job(redis, prefix, batch_id, lambda: NOW + 3600, None).run()
    assert result["status"] == "expired"
    assert not any([await redis.exists(redis_keys.request_record(prefix, rid)) for rid in ids])
    record = BatchRecord.of(await redis.hgetall(redis_keys.batch_record(prefix, batch_id)))
    assert (record.failed, record.output_file_id) == (2, "")
