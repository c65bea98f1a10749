"""A private redis-server, one worker and one api replica for a benchmark run, torn down after."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.redis_server import RedisServer, free_port  # noqa: E402
from streamq.serve import wait_ready  # noqa: E402


@contextmanager
def local_stack(name: str, settings: dict[str, str], timeout_s: float = 180,
                env_out: dict[str, str] | None = None, worker_python: str | None = None,
                pids_out: dict[str, int] | None = None, workers: int = 1) -> Iterator[str]:
    """Yield the api's URL once it is ready; `settings` are STREAMQ_* variables for every process.
    `env_out`, when given, receives the processes' environment (REDIS_URL included), and
    `pids_out` the process ids of the (first) worker and the api;
    `worker_python` runs the workers with another Python (the vLLM virtualenv's)."""
    folder = Path(tempfile.mkdtemp(prefix=f"streamq-{name}-"))
    redis = RedisServer(folder / "redis")
    env = {**os.environ, "REDIS_URL": redis.start(), **settings}
    if env_out is not None:
        env_out.update(env)
    port = free_port()
    cli = [sys.executable, "-m", "streamq.cli", "--log-level", "warning"]
    subprocess.run(cli + ["prepare-model"], env=env, check=True, capture_output=True)
    worker_cli = [worker_python or sys.executable, *cli[1:]]
    procs = [subprocess.Popen(worker_cli + ["worker"], env={**env, "STREAMQ_WORKER_NAME": f"{name}-worker{i}"},
                              cwd=ROOT) for i in range(workers)]
    procs.append(subprocess.Popen(cli + ["api"], env={**env, "STREAMQ_PORT": str(port)}, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    if pids_out is not None:
        pids_out.update(worker=procs[0].pid, api=procs[-1].pid)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_ready(url, timeout_s):
            raise SystemExit("the stack did not become ready")
        yield url
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        redis.stop()
