"""Redis killed (SIGKILL) and restarted under a running `streamq scheduler`: the scheduler
waits for it and carries on, and its jobs still do their work after the restart."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from redis.asyncio import Redis

from shared.messages import RequestPayload, now
from shared.redis_server import RedisServer
from shared.sampling import SamplingParams
from shared.store import RequestStore
from tests.stack import ROOT
from tests.waiting import until

MODEL = "m"


async def _expired_in_queue(store: RequestStore) -> str:
    """A queued request already past its queue timeout: the scheduler's expire job ends it."""
    payload = RequestPayload(id=str(uuid.uuid4()), model=MODEL, prompt_token_ids=[1, 2],
                             params=SamplingParams(max_tokens=2), expires_at=now() - 1)
    await store.submit(payload)
    return payload.id


async def _expired_by_the_scheduler(store: RequestStore, rid: str) -> None:
    async def expired() -> bool:
        return (await store.record(rid)).status == "expired"
    await until(expired, 60, f"request {rid} expired by the scheduler")


async def test_the_scheduler_survives_a_redis_restart(tmp_path: Path):
    server = RedisServer(tmp_path / "redis", appendonly=True, appendfsync="always")
    url = server.start()
    prefix = f"e2e{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "REDIS_URL": url, "STREAMQ_PREFIX": prefix, "STREAMQ_SERVED_MODEL_NAME": MODEL,
           "STREAMQ_RECLAIM_INTERVAL_S": "1"}
    log_path = tmp_path / "scheduler.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "streamq.cli", "scheduler"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    redis = Redis.from_url(url, decode_responses=True)
    store = RequestStore(redis, prefix)
    try:
        await _expired_by_the_scheduler(store, await _expired_in_queue(store))  # it runs

        server.kill()

        async def noticed() -> bool:  # it saw Redis go (or it died of it)
            return proc.poll() is not None or "redis unavailable" in log_path.read_text(errors="replace")
        await until(noticed, 60, "the scheduler noticing that Redis is down")
        assert proc.poll() is None, f"the scheduler died with Redis:\n{log_path.read_text()[-3000:]}"

        server.start()  # same port, same files
        await redis.connection_pool.disconnect()
        await _expired_by_the_scheduler(store, await _expired_in_queue(store))  # its jobs run again
        assert proc.poll() is None, f"the scheduler exited:\n{log_path.read_text()[-3000:]}"
        proc.terminate()
        assert proc.wait(15) == 0  # and SIGTERM still stops it cleanly
    finally:
        await redis.aclose()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()
