"""Scheduler jobs against a real Redis stream and consumer group."""
from scheduler.jobs import trim_request_stream
from scheduler.main import trim, worker_settings
from shared import keys
from shared.settings import SchedulerSettings


async def _setup(redis, prefix):
    stream = keys.request_stream(prefix, "m")
    await redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    ids = [await redis.xadd(stream, {"payload": str(i)}) for i in range(5)]
    await redis.xreadgroup(keys.WORKER_GROUP, "w1", {stream: ">"}, count=3)
    await redis.xack(stream, keys.WORKER_GROUP, ids[0], ids[1])
    return stream, ids


async def test_trim_keeps_pending_and_unread_entries(redis, prefix):
    stream, ids = await _setup(redis, prefix)
    assert await trim_request_stream(redis, prefix, "m") == 2
    assert [e for e, _ in await redis.xrange(stream)] == ids[2:]
    assert await trim_request_stream(redis, prefix, "m") == 0  # safe to run again


async def test_trim_of_a_missing_stream_does_nothing(redis, prefix):
    assert await trim_request_stream(redis, prefix, "nobody") == 0


async def test_cron_job_reads_settings_from_the_context(redis, redis_url, prefix):
    settings = SchedulerSettings(redis_url=redis_url, prefix=prefix, served_model_name="m")
    stream, ids = await _setup(redis, prefix)
    assert await trim({"settings": settings, "streamq_redis": redis}) == 2
    cls = worker_settings(settings)
    assert cls.queue_name == f"{prefix}:arq" and len(cls.cron_jobs) == 1
