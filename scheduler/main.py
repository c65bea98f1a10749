"""Entry point of the scheduler: an arq worker whose cron jobs reclaim the requests of dead
workers and keep Redis tidy."""
from __future__ import annotations

from typing import Any

from arq import cron, func
from arq.worker import run_worker
from shared.redis_client import arq_settings, connect

from scheduler.batches import run_batch as run_batch_job
from scheduler.jobs import expire_waiting, reclaim_dead_workers, trim_request_stream
from shared import keys
from shared.models import served_name
from shared.settings import SchedulerSettings


async def trim(ctx: dict[str, Any]) -> int:
    settings: SchedulerSettings = ctx["settings"]
    return await trim_request_stream(ctx["streamq_redis"], settings.prefix, served_name(settings))


async def reclaim(ctx: dict[str, Any]) -> dict[str, int]:
    settings: SchedulerSettings = ctx["settings"]
    return await reclaim_dead_workers(ctx["streamq_redis"], settings.prefix, served_name(settings),
                                      settings.heartbeat_ttl_s, settings.max_attempts)


async def expire(ctx: dict[str, Any]) -> int:
    settings: SchedulerSettings = ctx["settings"]
    return await expire_waiting(ctx["streamq_redis"], settings.prefix, served_name(settings))


async def run_batch(ctx: dict[str, Any], batch_id: str) -> dict[str, Any]:
    settings: SchedulerSettings = ctx["settings"]
    return await run_batch_job(ctx["streamq_redis"], settings.prefix, served_name(settings), batch_id,
                               settings.batch_concurrency)


def worker_settings(settings: SchedulerSettings) -> type:
    """arq reads its settings from a class; build one around our settings object."""

    async def on_startup(ctx: dict[str, Any]) -> None:
        ctx["settings"] = settings
        ctx["streamq_redis"] = connect(settings.redis_url)

    async def on_shutdown(ctx: dict[str, Any]) -> None:
        await ctx["streamq_redis"].aclose()

    return type("StreamqScheduler", (), {
        "redis_settings": arq_settings(settings.redis_url),
        "queue_name": keys.arq_queue(settings.prefix),
        "functions": [func(run_batch, timeout=24 * 3600, max_tries=3, keep_result=3600)],
        "cron_jobs": [cron(trim, second=set(range(0, 60, settings.trim_interval_s)), run_at_startup=True,
                           unique=True, timeout=60, keep_result=0),
                      cron(reclaim, second=set(range(0, 60, settings.reclaim_interval_s)), run_at_startup=True,
                           unique=True, timeout=60, keep_result=0),
                      cron(expire, second=set(range(0, 60, settings.reclaim_interval_s)), run_at_startup=True,
                           unique=True, timeout=60, keep_result=0)],
        "on_startup": on_startup,
        "on_shutdown": on_shutdown,
        "handle_signals": True,
    })


def main(settings: SchedulerSettings | None = None) -> None:
    run_worker(worker_settings(settings or SchedulerSettings()))
