"""A stack of real streamq processes on this machine: the one launcher of `streamq serve`, the
end-to-end tests (tests/stack.py) and the benchmarks.

Each process is a `streamq` subcommand (Child) in its own process group, so stopping or killing
it also ends what it started (vLLM's engine process). A Stack starts a private redis-server
unless given a Redis URL, converts the model once (prepare-model) before any process reads it,
then the workers, the scheduler and the api replicas, each with its log in the stack's folder,
and waits until every replica's /readyz answers. It can kill, pause, restart and replace workers
(each known by its consumer name, a replacement too) and kill replicas, as a crash or a test would.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import json
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator

from shared import redis_keys
from shared.children import die_with_parent, terminate
from shared.redis_server import RedisServer, free_port
from shared.request_record import RequestRecord

log = logging.getLogger("streamq.stack")
ROOT = Path(__file__).resolve().parent.parent  # the checkout, where `-m streamq.cli` runs without an install


def cli(python: str | None = None) -> list[str]:
    """The `streamq` command, run by `python` (default: this one)."""
    return [python or sys.executable, "-m", "streamq.cli"]


@dataclass
class Child:
    """One process of a stack, in its own process group (a Ctrl-C meant for the launcher reaches
    only the launcher, which stops its children in order). `log`: where its output goes (default:
    the launcher's own); `with_parent`: it gets SIGTERM if the launcher dies (`streamq serve`)."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path | None = None
    with_parent: bool = False
    cwd: Path | None = None
    process: subprocess.Popen | None = None
    restarts: int = 0  # restart bookkeeping, for `streamq serve`'s supervisor
    next_start: float = 0.0
    started_at: float = field(default=0.0)

    def start(self) -> subprocess.Popen:
        out = open(self.log, "wb") if self.log else None
        try:
            self.process = subprocess.Popen(self.args, env=self.env, cwd=self.cwd, stdout=out,
                                            stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                            preexec_fn=die_with_parent if self.with_parent else None)
        finally:
            if out:
                out.close()  # the child holds its own copy
        self.started_at = time.monotonic()
        return self.process

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> bool:
        """SIGTERM, SIGKILL after timeout_s, then what it left in its group; True if it had to be killed."""
        killed = terminate(self.process, timeout_s) if self.running else False
        self.reap()
        return killed

    def kill(self) -> None:
        """SIGKILL it and what it started, as a crash of its machine would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        self.reap()

    def reap(self) -> None:
        """Kill what the child left behind in its process group (e.g. vLLM's engine process)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def signal_group(self, signum: int) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signum)


def ready(url: str) -> bool:
    """Whether `url`/readyz answers 200 now."""
    return live_workers(url) is not None


def live_workers(url: str) -> list[dict] | None:
    """The live workers `url`/readyz lists now; None while it does not answer 200."""
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as reply:
            return json.loads(reply.read()).get("workers", []) if reply.status == 200 else None
    except (OSError, ValueError):  # 503 while no heartbeat is fresh; a reply cut short
        return None


def wait_ready(url: str, timeout_s: float, children: list[Child] | tuple = ()) -> bool:
    """Poll `url`/readyz until it answers 200 (True), a child exits, or time runs out (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in children:
            if child.process is not None and child.process.poll() is not None:
                log.error("%s exited with code %s before the service was ready", child.name, child.process.returncode)
                return False
        if ready(url):
            return True
        time.sleep(0.2)  # readiness polling only, never used to order events
    return False


def prepare_model(env: dict[str, str], cwd: Path | None = None, quiet: bool = True) -> None:
    """Convert the model once (if needed) before any process reads it, as every launcher does."""
    subprocess.run(cli() + ["prepare-model"], cwd=cwd, env=env, check=True, capture_output=quiet)


class Stack:
    """Real processes: a private redis-server (unless `redis_url`), `workers` workers, the
    scheduler (if `scheduler`) and one api replica per entry of `replicas` (a count, or each
    replica's own settings), all with `settings` (STREAMQ_* variables, REDIS_URL) over this
    process's environment; an empty value unsets a variable. `worker_settings` and
    `worker_python`, when given, are per worker: more settings, and the Python to run it with
    (e.g. the vLLM virtualenv's). `options` go before every subcommand (e.g. --log-level).

    Worker i runs in slot i, first as `{name}-worker{i}` (its consumer name, in request records
    and heartbeats); a worker started again in a slot has the slot's settings and a name of its
    own, and every worker method takes that name (or, where it says so, the slot)."""

    def __init__(self, folder: Path, settings: dict[str, str] | None = None, *, redis_url: str | None = None,
                 workers: int = 1, replicas: int | list[dict[str, str]] = 1, scheduler: bool = False,
                 worker_settings: list[dict[str, str]] | None = None,
                 worker_python: list[str | None] | None = None, name: str | None = None,
                 options: list[str] | tuple = (), ready_timeout_s: float = 180.0):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.redis_server = None if redis_url else RedisServer(folder / "redis")
        if self.redis_server:
            self.redis_server.port = free_port()
            redis_url = self.redis_server.url
        env = {**os.environ, "REDIS_URL": redis_url, **(settings or {})}
        # An empty value means "the user's default", as in a real deployment (the default model's cache).
        self.env = {k: v for k, v in env.items() if v != ""}
        self.prefix = self.env.get("STREAMQ_PREFIX", "streamq")
        self.model_name: str | None = None  # the served model's name, where the caller knows it (queued)
        self.name = name or self.prefix  # a worker's consumer name is {name}-{its child's name}
        self.n_workers, self.with_scheduler = workers, scheduler
        self.replica_settings = [{} for _ in range(replicas)] if isinstance(replicas, int) else replicas
        self.n_replicas = len(self.replica_settings)
        self.worker_settings = worker_settings or [{} for _ in range(workers)]
        self.worker_python = worker_python or [None] * workers
        self.options = list(options)
        self.ready_timeout_s = ready_timeout_s
        self.children: list[Child] = []
        self.workers: dict[str, Child] = {}  # consumer name -> process, every worker started (a replaced one's too)
        self.slots = [f"{self.name}-worker{i}" for i in range(workers)]  # the name of the worker now in each slot
        self.apis: list[Child] = []
        self.urls: list[str] = []
        self.killed: list[Child] = []  # the children killed on purpose: their exit is no failure

    @property
    def url(self) -> str:
        """The first api replica's address."""
        return self.urls[0]

    @property
    def processes(self) -> list[tuple[str, subprocess.Popen]]:
        """(name, process) of every child started, in order (a restarted worker's too)."""
        return [(child.name, child.process) for child in self.children]

    def child(self, name: str) -> Child:
        return next(child for child in reversed(self.children) if child.name == name)

    def _spawn(self, name: str, args: list[str], env: dict[str, str], python: str | None = None) -> Child:
        child = Child(name, [*cli(python), *self.options, *args], env, log=self.folder / f"{name}.log", cwd=ROOT)
        self.children.append(child)
        child.start()
        return child

    def __enter__(self) -> Stack:
        try:
            if self.redis_server:
                self.redis_server.start()
            prepare_model(self.env, ROOT)
            for i in range(self.n_workers):
                self.start_worker(i, f"worker{i}")
            if self.with_scheduler:
                self._spawn("scheduler", ["scheduler"], self.env)
            for i, extra in enumerate(self.replica_settings):
                port = free_port()
                self.apis.append(self._spawn(f"api{i}", ["api"], {**self.env, **extra, "STREAMQ_PORT": str(port)}))
                self.urls.append(f"http://127.0.0.1:{port}")
            self.wait_ready(self.ready_timeout_s)
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Wait until every replica's /readyz answers (it has a live worker); fail, with the logs,
        if a process dies first or time runs out."""
        deadline = time.monotonic() + timeout_s
        for url in self.urls:
            if not wait_ready(url, max(0.0, deadline - time.monotonic()), self._watched()):
                self._fail(f"not ready after {timeout_s} s")

    def wait_workers(self, count: int, timeout_s: float = 180.0) -> None:
        """Wait until every replica's /readyz lists at least `count` live workers (their heartbeats);
        fail, with the logs, if a process dies first (one not killed on purpose) or time runs out."""
        deadline = time.monotonic() + timeout_s
        for url in self.urls:
            while (seen := live_workers(url)) is None or len(seen) < count:
                if self._dead() or time.monotonic() > deadline:
                    self._fail(f"fewer than {count} live workers after {timeout_s} s")
                time.sleep(0.2)  # polling the workers' heartbeats

    def _watched(self) -> list[Child]:
        """The children whose exit is a failure: all but those killed on purpose."""
        return [c for c in self.children if not any(c is k for k in self.killed)]

    def _dead(self) -> list[Child]:
        return [c for c in self._watched() if not c.running]

    def _fail(self, why: str) -> None:
        if dead := self._dead():
            why = f"{dead[0].name} exited with {dead[0].process.returncode}"
        raise RuntimeError(f"{why}:\n{self.logs()}")

    def worker_name(self, i: int) -> str:
        """The name of the worker now in slot i."""
        return self.slots[i]

    def start_worker(self, i: int, name: str) -> str:
        """Start a worker in slot i (after kill_worker), as the child `name`, with the slot's
        settings and Python; its consumer name, `{stack's name}-{name}`, is returned."""
        worker = f"{self.name}-{name}"
        env = {**self.env, "STREAMQ_WORKER_NAME": worker, **self.worker_settings[i]}
        self.workers[worker] = self._spawn(name, ["worker"], env, self.worker_python[i])
        self.slots[i] = worker
        return worker

    def replace_worker(self, name: str) -> str:
        """SIGKILL the worker `name` if it still runs and start a new one in its slot; the new one's
        name. Wait for it with wait_workers."""
        self.kill_worker(name)
        i = self.slots.index(name)
        return self.start_worker(i, f"worker{i}-{len(self.workers)}")  # a name no worker of the stack had

    def kill_worker(self, name: str) -> None:
        """SIGKILL the worker process with this consumer name, as a crash would (vLLM's engine
        process with it: the machine went)."""
        self.killed.append(self.workers[name])
        self.workers[name].kill()

    def pause_worker(self, which: int | str = 0) -> None:
        """SIGSTOP a worker (and what it started), by name or slot: it takes no request and runs no
        step until resume_worker. Tests use it to hold a request where it is, not to wait for time to pass."""
        self._worker(which).signal_group(signal.SIGSTOP)

    def resume_worker(self, which: int | str = 0) -> None:
        self._worker(which).signal_group(signal.SIGCONT)

    def _worker(self, which: int | str) -> Child:
        return self.workers[self.slots[which] if isinstance(which, int) else which]

    def pause_workers(self) -> None:
        """SIGSTOP every running worker: whatever each runs stays where it is (see pause_worker)."""
        for name in self.slots:
            if self.workers[name].running:
                self.pause_worker(name)

    def resume_workers(self) -> None:
        """SIGCONT every running worker (after pause_workers)."""
        for name in self.slots:
            if self.workers[name].running:
                self.resume_worker(name)

    def kill_paused_worker(self, name: str) -> None:
        """After pause_workers: SIGKILL the worker `name`, mid-request for certain, and resume the others."""
        self.kill_worker(name)
        self.resume_workers()

    def kill_replica(self, i: int) -> None:
        """SIGKILL api replica i, as a crash would."""
        self.killed.append(self.apis[i])
        self.apis[i].kill()

    def redis(self):
        """A synchronous client on the stack's Redis (a cluster client for a redis+cluster:// URL)."""
        import redis
        from redis.cluster import ClusterNode, RedisCluster

        from shared.redis_client import cluster_nodes, is_cluster_url

        url = self.env["REDIS_URL"]
        if is_cluster_url(url):
            return RedisCluster(startup_nodes=[ClusterNode(n["host"], n["port"]) for n in cluster_nodes(url)],
                                decode_responses=True)
        return redis.Redis.from_url(url, decode_responses=True)

    def queued(self, model: str | None = None) -> int:
        """How many requests were ever written to the request streams (all lanes) of `model`
        (default: model_name)."""
        model = model or self.model_name
        with self.redis() as client:
            lanes = client.smembers(redis_keys.request_lanes(self.prefix, model))
            streams = [redis_keys.request_stream(self.prefix, model, lane) for lane in lanes]
            return sum(int(client.xinfo_stream(stream)["entries-added"]) for stream in streams)

    def record(self, request_id: str) -> RequestRecord | None:
        """The request's record as it is now (None: it has none)."""
        with self.redis() as client:
            return RequestRecord.of(client.hgetall(redis_keys.request_record(self.prefix, request_id)))

    def records(self) -> list[RequestRecord]:
        """Every request record of the stack's prefix, as it is now."""
        with self.redis() as client:
            found = [RequestRecord.of(client.hgetall(key))
                     for key in client.scan_iter(match=redis_keys.request_record(self.prefix, "*"), count=1000)
                     if client.type(key) == "hash"]  # the token logs beside them are streams
        return [r for r in found if r is not None]

    def wait_for_record(self, match, timeout_s: float = 60.0) -> RequestRecord:
        """The first request record for which `match(record)` holds, re-read until one does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for record in self.records():
                if match(record):
                    return record
            time.sleep(0.05)  # re-read Redis; the worker's progress is not ours to order
        raise AssertionError(f"no matching request record within {timeout_s} s")

    def logs(self) -> str:
        """The tail of every process's log."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted(self.folder.glob("*.log")))

    def __exit__(self, *exc) -> None:
        for child in self.children:
            if child.running:
                child.process.terminate()
                child.process.send_signal(signal.SIGCONT)  # a paused worker (a test that failed mid-pause) hears it
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(15)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
            child.reap()
        if self.redis_server:
            self.redis_server.stop()


@contextmanager
def local_stack(name: str, settings: dict[str, str], timeout_s: float = 180,
                env_out: dict[str, str] | None = None, worker_python: str | None = None,
                pids_out: dict[str, int] | None = None, workers: int = 1,
                apis: list[dict[str, str]] | None = None, urls_out: list[str] | None = None) -> Iterator[str]:
    """A benchmark's stack: a private redis-server, `workers` workers and the api replicas in a
    fresh temporary folder (their logs there), at log level warning; yields the first replica's
    URL once every one is ready. `settings` are STREAMQ_* variables for every process.
    `env_out`, when given, receives the processes' environment (REDIS_URL included), and
    `pids_out` the process ids of the (first) worker and the api;
    `worker_python` runs the workers with another Python (the vLLM virtualenv's).
    `apis`: one api replica per entry, with these settings on top (default: one, with none);
    `urls_out` receives every replica's URL, in that order (the first is the one yielded)."""
    folder = Path(tempfile.mkdtemp(prefix=f"streamq-{name}-"))
    stack = Stack(folder, settings, workers=workers, replicas=apis or [{}], name=name,
                  worker_python=[worker_python] * workers, options=["--log-level", "warning"],
                  ready_timeout_s=timeout_s)
    if env_out is not None:
        env_out.update(stack.env)
    with stack:
        if pids_out is not None:
            pids_out.update(worker=stack.child("worker0").process.pid, api=stack.child("api0").process.pid)
        if urls_out is not None:
            urls_out.extend(stack.urls)
        yield stack.url
