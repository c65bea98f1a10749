"""`streamq serve`: everything on one machine, supervised.

Starts a private redis-server unless REDIS_URL is set, converts the model if needed, then one
worker, the scheduler and one api process. A child that dies is restarted with backoff. Ctrl-C (or SIGTERM)
stops every child and Redis; children also get SIGTERM if this process dies (PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.models import served_name
from shared.redis_server import RedisServer
from shared.settings import CommonSettings

log = logging.getLogger("streamq.serve")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str
    args: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = field(default=0.0)

    def start(self) -> None:
        # Own process group: the terminal's Ctrl-C reaches only the supervisor, which stops us in order.
        self.process = subprocess.Popen(self.args, env=self.env, start_new_session=True, preexec_fn=_die_with_parent)
        self.started_at = time.monotonic()

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s; killing it", self.name, timeout_s)
            self.process.kill()
            self.process.wait()


class _Stop(Exception):
    pass


def _raise_stop(signum, _frame) -> None:
    raise _Stop(signum)


def wait_ready(url: str, timeout_s: float, children: list[Child] | tuple = ()) -> bool:
    """Poll `url`/readyz until it answers 200 (True), a child exits, or time runs out (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in children:
            if child.process and child.process.poll() is not None:
                log.error("%s exited with code %s before the service was ready", child.name, child.process.returncode)
                return False
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as reply:
                if reply.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def serve(host: str, port: int) -> int:
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    settings = CommonSettings()
    redis: RedisServer | None = None
    children: list[Child] = []
    try:
        env = dict(os.environ)
        if not (os.environ.get("REDIS_URL") or os.environ.get("STREAMQ_REDIS_URL")):
            redis = RedisServer(Path(tempfile.mkdtemp(prefix="streamq-redis-")), appendonly=True)
            env["REDIS_URL"] = redis.start()
            log.info("started a private redis-server at %s", env["REDIS_URL"])
        log.info("preparing model %s (the first run converts it; later runs reuse the cache)", settings.model)
        subprocess.run([sys.executable, "-m", "shared.cli", "prepare-model"], env=env, check=True)
        cli = [sys.executable, "-m", "shared.cli"]
        children = [
            Child("worker", cli + ["worker"], env),
            Child("scheduler", cli + ["scheduler"], env),
            Child("api", cli + ["api"], {**env, "STREAMQ_HOST": host, "STREAMQ_PORT": str(port)}),
        ]
        for child in children:
            child.start()
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        if not wait_ready(url, 600, children):
            log.error("streamq did not become ready; stopping")
            return 1
        _banner(url, served_name(settings))
        _supervise(children)
        return 0
    except _Stop:
        log.info("stopping")
        return 0
    except subprocess.CalledProcessError as exc:
        log.error("model preparation failed (exit code %s)", exc.returncode)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for child in reversed(children):
            child.stop()
        if redis is not None:
            redis.stop()
        log.info("all stopped")


def _supervise(children: list[Child]) -> None:
    """Restart a child that exits, waiting 1, 2, 4 ... 30 s between tries."""
    while True:
        now = time.monotonic()
        for child in children:
            if child.process is None or child.process.poll() is None:
                continue
            if child.next_start == 0.0:
                if now - child.started_at > 60:
                    child.restarts = 0  # it ran a good while: start over with a short backoff
                delay = min(30.0, 2.0 ** child.restarts)
                log.error("%s exited with code %s; restarting it in %.0f s", child.name,
                          child.process.returncode, delay)
                child.next_start = now + delay
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                child.start()
        time.sleep(0.5)


def _banner(url: str, model: str) -> None:
    print(f"""
streamq is ready: serving {model} at {url}

  Submit:  curl -s {url}/v1/requests -H 'Content-Type: application/json' \\
             -d '{{"messages": [{{"role": "user", "content": "What is the capital of France?"}}], "temperature": 0, "max_tokens": 32}}'
  Stream:  curl -sN {url}/v1/requests -H 'Content-Type: application/json' \\
             -d '{{"prompt": "Once upon a time", "max_tokens": 48, "stream": true}}'
  Docs:    {url}/docs

Press Ctrl-C to stop.
""", flush=True)
