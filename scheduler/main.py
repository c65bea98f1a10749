"""Entry point of the scheduler: an arq worker whose cron jobs reclaim the requests of dead
workers and keep Redis tidy, run under a loop that outlives Redis restarts and, on a Redis
Cluster, follows the master of arq's slot (shared/arq_cluster.py)."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections import Counter
from collections.abc import Awaitable
from typing import Any, TypeVar

from arq import cron, func
from arq.connections import ArqRedis, create_pool
from arq.worker import Worker, create_worker
from redis.exceptions import RedisError
from shared.arq_cluster import ArqSlot, parse_cluster_url, redis_settings
from shared.redis_client import BACKOFF, connect, until_redis_answers

from scheduler.batches import run_batch as run_batch_job
from scheduler.jobs import ModelQueues, expire_waiting, keep_responses, trim_request_stream
from shared.reclaim import reclaim_dead_workers
from shared import redis_keys
from shared.model_source import served_name
from shared.settings import SchedulerSettings

log = logging.getLogger(__name__)
T = TypeVar("T")
# A worker that ran this long before its error counts as healthy: the next failure restarts at once.
HEALTHY_RUN_S = 60.0


async def trim(ctx: dict[str, Any]) -> int:
    settings: SchedulerSettings = ctx["settings"]
    redis = ctx["streamq_redis"]
    return sum([await trim_request_stream(redis, settings.prefix, model)
                for model in await ctx["queues"].models(redis, settings.prefix)])


async def reclaim(ctx: dict[str, Any]) -> dict[str, int]:
    settings: SchedulerSettings = ctx["settings"]
    redis, outcomes = ctx["streamq_redis"], Counter()
    for model in await ctx["queues"].models(redis, settings.prefix):
        outcomes.update(await reclaim_dead_workers(redis, settings.prefix, model, settings.heartbeat_ttl_s,
                                                   settings.max_attempts))
    return dict(outcomes)


async def expire(ctx: dict[str, Any]) -> int:
    settings: SchedulerSettings = ctx["settings"]
    redis = ctx["streamq_redis"]
    return sum([await expire_waiting(redis, settings.prefix, model)
                for model in await ctx["queues"].models(redis, settings.prefix)])


async def keep(ctx: dict[str, Any]) -> int:
    settings: SchedulerSettings = ctx["settings"]
    return await keep_responses(ctx["streamq_redis"], settings.prefix)


async def run_batch(ctx: dict[str, Any], batch_id: str) -> dict[str, Any]:
    settings: SchedulerSettings = ctx["settings"]
    return await run_batch_job(ctx["streamq_redis"], settings.prefix, served_name(settings), batch_id,
                               settings.batch_concurrency, settings.files_ttl_s, max(settings.queue_timeout_s, settings.flex_queue_timeout_s) + 3600)


def worker_settings(settings: SchedulerSettings) -> type:
    """arq reads its settings from a class; build one around our settings object."""

    async def on_startup(ctx: dict[str, Any]) -> None:
        ctx["settings"] = settings
        ctx["streamq_redis"] = connect(settings.redis_url)
        # arq hands each job a copy of ctx: the models found are kept in this one object.
        ctx["queues"] = ModelQueues(served_name(settings), settings.trim_interval_s)

    async def on_shutdown(ctx: dict[str, Any]) -> None:
        await ctx["streamq_redis"].aclose()

    def every(coroutine, seconds: int):
        # arq builds a cron run's job id from its name: the name carries arq's slot tag
        return cron(coroutine, name=redis_keys.arq_job_id(settings.prefix, f"cron:{coroutine.__name__}"),
                    second=set(range(0, 60, seconds)), run_at_startup=True, unique=True, timeout=60, keep_result=0)

    return type("StreamqScheduler", (), {
        "redis_settings": redis_settings(settings.redis_url),  # None on a cluster: supervise() gives a pool
        "queue_name": redis_keys.arq_queue(settings.prefix),
        # An hour past the longest completion window (24h): the job itself ends the batch at its window's end.
        "functions": [func(run_batch, timeout=25 * 3600, max_tries=3, keep_result=3600)],
        "cron_jobs": [every(trim, settings.trim_interval_s), every(reclaim, settings.reclaim_interval_s),
                      every(expire, settings.reclaim_interval_s), every(keep, settings.trim_interval_s)],
        "on_startup": on_startup,
        "on_shutdown": on_shutdown,
        "handle_signals": True,
    })


# arq's formats of a job's start and end lines, in arq/worker.py (tests/unit/test_scheduler_logs.py checks them there).
ARQ_RUN_LINES = ("%6.2fs → %s(%s)%s", "%6.2fs ← %s ● %s")


class QuietCron(logging.Filter):
    """arq logs each run of a job at INFO as it starts and as it ends. The cron jobs run every few
    seconds (four lines each time, thousands an hour) and log themselves what they did (trimmed,
    expired, reclaimed): their start and end lines are dropped, unless arq's log is at DEBUG.
    A batch job's lines, a retry, and every warning and error of any job still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or logging.getLogger("arq.worker").isEnabledFor(logging.DEBUG):
            return True
        return not (record.msg in ARQ_RUN_LINES and ":cron:" in record.getMessage())


def main(settings: SchedulerSettings | None = None) -> None:
    logging.getLogger("arq.worker").addFilter(QuietCron())
    asyncio.run(supervise(settings or SchedulerSettings()))


async def supervise(settings: SchedulerSettings) -> None:
    """Run the arq worker until SIGINT or SIGTERM. arq's loop ends with an error when Redis
    goes away (a restart), so then wait until Redis answers and run a fresh worker: its cron
    jobs start again, and run at once (run_at_startup). On a cluster the worker runs on the
    master of arq's slot, found anew for each worker: a failover or a MOVED ends the old one."""
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    cls = worker_settings(settings)
    cluster = parse_cluster_url(settings.redis_url)
    slot = ArqSlot(cluster, cls.queue_name) if cluster else None

    async def open_pool() -> ArqRedis:
        if slot is None:
            return await create_pool(cls.redis_settings, default_queue_name=cls.queue_name)
        return await slot.pool(cls.queue_name)

    failures = 0  # in a row, each within HEALTHY_RUN_S of its start: they back off, 0.1 s doubling to 5 s
    while not stop.is_set():
        pool = await _unless(stop, until_redis_answers("scheduler start", open_pool, log))
        if pool is None:
            return
        worker = create_worker(cls, redis_pool=pool, handle_signals=False)
        started = asyncio.get_running_loop().time()
        try:
            await _unless(stop, worker.main())
        except RedisError as exc:
            # Any Redis error ends this arq worker, never the scheduler: during an outage arq's
            # paths fail in many ways (ConnectionError, TimeoutError, a WatchError wrapping a lost
            # connection in start_jobs, MOVED or CLUSTERDOWN on a cluster), and a fresh worker,
            # started once Redis answers, runs its cron jobs again (each is safe to run twice).
            log.warning("redis unavailable (%s: %s), the scheduler's jobs stopped; they start again when it answers%s",
                        type(exc).__name__, exc, "" if slot is None else ", on the master that serves arq's slot")
            running_s = asyncio.get_running_loop().time() - started
            failures = 0 if running_s >= HEALTHY_RUN_S else failures + 1
            if failures:  # an error that outlives the outage must not spin
                await _unless(stop, asyncio.sleep(BACKOFF.compute(failures)))
        finally:
            await _close(worker, pool)


async def _unless(stop: asyncio.Event, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (with `work` cancelled) if `stop` is set first."""
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


async def _close(worker: Worker, pool: ArqRedis) -> None:
    """arq's Worker.close without its Redis calls, which would fail while Redis is away."""
    for task in worker.tasks.values():
        task.cancel()
    await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
    if "streamq_redis" in worker.ctx:  # on_startup ran
        await worker.on_shutdown(worker.ctx)
    await pool.close(close_connection_pool=True)
