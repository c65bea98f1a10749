"""Entry point of one worker process: load the model, then serve requests until stopped."""
from __future__ import annotations

import asyncio
import logging
import signal

from redis.asyncio import Redis

from shared.models import prepare_model, served_name, weights_dir
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from worker.engine import Engine
from worker.runner import BatchRunner, load_model, pick_device, pick_dtype
from worker.service import WorkerService

log = logging.getLogger("streamq.worker")


def build_engine(settings: WorkerSettings) -> Engine:
    tokenizer = Tokenizer(prepare_model(settings))
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    model = load_model(weights_dir(settings), device, dtype)
    pad = next(iter(tokenizer.eos_token_ids), 0)
    log.info("loaded %s on %s as %s", settings.model, device, dtype)
    return Engine(BatchRunner(model, device, pad_id=pad), tokenizer, settings.batch_size)


async def serve(settings: WorkerSettings) -> None:
    engine = await asyncio.to_thread(build_engine, settings)
    redis = Redis.from_url(settings.redis_url, decode_responses=True)
    service = WorkerService(redis, engine, settings, served_name(settings))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    log.info("worker %s serving %s (batch_size=%d)", settings.worker_name, served_name(settings), settings.batch_size)
    try:
        await service.run()
    finally:
        await redis.aclose()


def main(settings: WorkerSettings | None = None) -> None:
    asyncio.run(serve(settings or WorkerSettings()))
