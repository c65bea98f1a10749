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
                pids_out: dict[str, int] | None = None, workers: int = 1,
                apis: list[dict[str, str]] | None = None, urls_out: list[str] | None = None) -> Iterator[str]:
    """Yield the api's URL once it is ready; `settings` are STREAMQ_* variables for every process.
    `env_out`, when given, receives the processes' environment (REDIS_URL included), and
    `pids_out` the process ids of the (first) worker and the api;
    `worker_python` runs the workers with another Python (the vLLM virtualenv's).
    `apis`: one api replica per entry, with these settings on top (default: one, with none);
    `urls_out` receives every replica's URL, in that order (the first is the one yielded)."""
    folder = Path(tempfile.mkdtemp(prefix=f"streamq-{name}-"))
    redis = RedisServer(folder / "redis")
    env = {**os.environ, "REDIS_URL": redis.start(), **settings}
    if env_out is not None:
        env_out.update(env)
    cli = [sys.executable, "-m", "streamq.cli", "--log-level", "warning"]
    subprocess.run(cli + ["prepare-model"], env=env, check=True, capture_output=True)
    worker_cli = [worker_python or sys.executable, *cli[1:]]
    procs = [subprocess.Popen(worker_cli + ["worker"], env={**env, "STREAMQ_WORKER_NAME": f"{name}-worker{i}"},
                              cwd=ROOT) for i in range(workers)]
    urls = []
    for extra in apis or [{}]:
        port = free_port()
        procs.append(subprocess.Popen(cli + ["api"], env={**env, **extra, "STREAMQ_PORT": str(port)}, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    if pids_out is not None:
        pids_out.update(worker=procs[0].pid, api=procs[workers].pid)
    if urls_out is not None:
        urls_out.extend(urls)
    try:
        for url in urls:
            if not wait_ready(url, timeout_s):
                raise SystemExit("the stack did not become ready")
        yield urls[0]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        redis.stop()
