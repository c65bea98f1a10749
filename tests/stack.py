"""Real streamq processes for end-to-end tests: workers and api replicas as subprocesses."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared import redis_keys
from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent


class Stack:
    def __init__(self, redis_url: str, model: Path | None, folder: Path, replicas: int = 1, batch_size: int = 8,
                 workers: int = 1, env: dict[str, str] | None = None, scheduler: bool = False,
                 worker_envs: list[dict[str, str]] | None = None, worker_python: list[str | None] | None = None):
        """`worker_envs` and `worker_python`, when given, are per worker: extra environment, and
        the Python to run it with (e.g. the vLLM virtualenv's)."""
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.prefix = f"e2e{uuid.uuid4().hex[:8]}"
        self.env = {**os.environ, "REDIS_URL": redis_url, "STREAMQ_PREFIX": self.prefix,
                    "STREAMQ_MODEL": str(model) if model else "default", "STREAMQ_DTYPE": "float32",
                    "STREAMQ_DEVICE": "cpu", "STREAMQ_BATCH_SIZE": str(batch_size),
                    "STREAMQ_MODEL_CACHE_DIR": str(folder / "cache"), "STREAMQ_SSE_KEEPALIVE_S": "1", **(env or {})}
        # An empty value means "the user's default", as in a real deployment (the default model's cache).
        self.env = {k: v for k, v in self.env.items() if v != ""}
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.urls: list[str] = []
        self.n_replicas, self.n_workers, self.with_scheduler = replicas, workers, scheduler
        self.worker_envs = worker_envs or [{} for _ in range(workers)]
        self.worker_python = worker_python or [None] * workers
        self.model_name = model.name if model else "SmolLM2-135M-Instruct"

    def _spawn(self, name: str, args: list[str], env: dict[str, str], python: str | None = None) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "wb")
        # Own process group: tearing down (or killing) a process also ends what it started.
        proc = subprocess.Popen([python or sys.executable, "-m", "streamq.cli", *args], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append((name, proc))
        return proc

    def __enter__(self) -> "Stack":
        try:
            # As `streamq serve` does: convert the model (if needed) before any process reads it.
            subprocess.run([sys.executable, "-m", "streamq.cli", "prepare-model"], cwd=ROOT, env=self.env,
                           check=True, capture_output=True)
            for i in range(self.n_workers):
                self._spawn(f"worker{i}", ["worker"],
                            {**self.env, "STREAMQ_WORKER_NAME": self.worker_name(i), **self.worker_envs[i]},
                            self.worker_python[i])
            if self.with_scheduler:
                self._spawn("scheduler", ["scheduler"], self.env)
            for i in range(self.n_replicas):
                port = free_port()
                self._spawn(f"api{i}", ["api"], {**self.env, "STREAMQ_PORT": str(port)})
                self.urls.append(f"http://127.0.0.1:{port}")
            self.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Poll /readyz on every replica until it reports a live worker (or a process dies)."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.urls)
        while pending:
            for name, proc in self.processes:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout_s} s:\n{self.logs()}")
            try:
                if httpx.get(f"{pending[0]}/readyz", timeout=2).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # readiness polling only, never used to order events

    def worker_name(self, i: int) -> str:
        return f"{self.prefix}-worker{i}"

    def kill_worker(self, name: str) -> None:
        """SIGKILL the worker process with this consumer name, as a crash would."""
        i = next(i for i in range(self.n_workers) if self.worker_name(i) == name)
        proc = dict(self.processes)[f"worker{i}"]
        proc.kill()
        proc.wait()
        _kill_group(proc)  # the machine went: vLLM's engine process with it

    def start_worker(self, i: int, name: str) -> None:
        """Start worker i again (after kill_worker), with its own environment and Python."""
        self._spawn(name, ["worker"], {**self.env, "STREAMQ_WORKER_NAME": f"{self.worker_name(i)}-{name}",
                                       **self.worker_envs[i]}, self.worker_python[i])

    def pause_worker(self, i: int = 0) -> None:
        """SIGSTOP worker i (and what it started): it takes no request and runs no step until
        resume_worker. Tests use it to hold a request where it is, not to wait for time to pass."""
        os.killpg(dict(self.processes)[f"worker{i}"].pid, signal.SIGSTOP)

    def resume_worker(self, i: int = 0) -> None:
        os.killpg(dict(self.processes)[f"worker{i}"].pid, signal.SIGCONT)

    def pause_workers(self) -> None:
        """SIGSTOP every worker: whatever each runs stays where it is (see pause_worker)."""
        for i in range(self.n_workers):
            self.pause_worker(i)

    def resume_workers(self) -> None:
        """SIGCONT every worker (after pause_workers)."""
        for i in range(self.n_workers):
            self.resume_worker(i)

    def kill_paused_worker(self, name: str) -> None:
        """After pause_workers: SIGKILL the worker `name`, mid-request for certain, and resume the others."""
        self.kill_worker(name)
        for i in range(self.n_workers):
            if self.worker_name(i) != name:
                self.resume_worker(i)

    def kill_replica(self, i: int) -> None:
        """SIGKILL api replica i, as a crash would."""
        proc = dict(self.processes)[f"api{i}"]
        proc.kill()
        proc.wait()

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

    def queued(self) -> int:
        """How many requests were ever written to the model's request streams (all lanes)."""
        with self.redis() as client:
            lanes = client.smembers(redis_keys.request_lanes(self.prefix, self.model_name))
            streams = [redis_keys.request_stream(self.prefix, self.model_name, lane) for lane in lanes]
            return sum(int(client.xinfo_stream(stream)["entries-added"]) for stream in streams)

    def wait_for_record(self, match, timeout_s: float = 60.0) -> dict:
        """The first request record (a dict) for which `match(record)` holds, re-read until one does."""
        deadline = time.monotonic() + timeout_s
        with self.redis() as client:
            while time.monotonic() < deadline:
                for key in client.scan_iter(match=f"{self.prefix}:req:{{*}}", count=1000):
                    if client.type(key) == "hash" and match(record := client.hgetall(key)):
                        return record
                time.sleep(0.05)  # re-read Redis; the worker's progress is not ours to order
        raise AssertionError(f"no matching request record within {timeout_s} s")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                         for p in sorted(self.folder.glob("*.log")))

    def __exit__(self, *exc) -> None:
        for _name, proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
                proc.send_signal(signal.SIGCONT)  # a paused worker (a test that failed mid-pause) hears it
        for _name, proc in self.processes:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            _kill_group(proc)


def parse_sse(lines) -> list[dict]:
    """Group SSE lines into events: {'id', 'event', 'data'} (data decoded from JSON)."""
    events, current = [], {}
    for line in lines:
        if line == "":
            if "data" in current:
                current["data"] = json.loads(current["data"])
                events.append(current)
            current = {}
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            current[field] = value[1:] if value.startswith(" ") else value
    return events


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stream_events(client: httpx.Client, method: str, url: str, stop_after: int | None = None, **kwargs) -> list[dict]:
    """Read an SSE response to its final event (or stop after `stop_after` token events)."""
    events: list[dict] = []
    with client.stream(method, url, **kwargs) as response:
        response.raise_for_status()
        buffer: list[str] = []
        for line in response.iter_lines():
            buffer.append(line)
            if line == "":
                events += parse_sse(buffer)
                buffer = []
                if events and events[-1].get("event") == "final":
                    break
                if stop_after is not None and sum(e.get("event") == "token" for e in events) >= stop_after:
                    break
    return events


def stream_posted(client: httpx.Client, url: str, body: dict, at_token: int = 0, on_token=None) -> list[dict]:
    """POST a streaming request to `url` and read its events to the final one; `on_token(request
    id)` is called when its `at_token`-th token event arrives (to act mid-stream)."""
    lines: list[str] = []
    events: list[dict] = []
    with client.stream("POST", url, json=body) as reply:
        for line in reply.iter_lines():
            lines.append(line)
            if line != "":
                continue
            events += parse_sse(lines)
            lines = []
            if on_token is not None and sum(e["event"] == "token" for e in events) == at_token:
                on_token(reply.headers["X-Request-Id"])
            if events and events[-1]["event"] == "final":
                break
    return events


@dataclass
class HeldStream:
    """A stream whose workers are paused mid-request (hold_mid_stream): the client reads on in its
    thread once they go on."""

    runner: threading.Thread
    result: list[list[dict]]
    request_id: str
    headers: dict  # those sent
    record: dict  # the request's record at the pause: `running`, on `worker`

    def events(self, timeout_s: float = 120) -> list[dict]:
        """The stream's events, to its final one."""
        self.runner.join(timeout_s)
        return self.result[0]


def hold_mid_stream(stack: Stack, url: str, body: dict, at_token: int = 1, headers=dict,
                    attempts: int = 5) -> HeldStream:
    """Stream `body` (POSTed to `url` with `headers()`) and pause every worker at the client's
    `at_token`-th token, its request still running. A worker runs ahead of its client, and on a
    loaded machine may end a short request before the client saw that token: then the workers go
    on, and a new request (with new headers) is tried, so that the pause always lands mid-request."""
    for _ in range(attempts):
        held, seen, result, sent = threading.Event(), [], [], headers()

        def watch(request_id: str) -> None:
            if not held.is_set():
                stack.pause_workers()
                seen.append(request_id)
                held.set()

        def stream() -> None:
            with httpx.Client(timeout=120, headers=sent) as client:
                result.append(stream_posted(client, url, body, at_token, watch))

        runner = threading.Thread(target=stream)
        runner.start()
        if not held.wait(120):
            raise AssertionError(f"no token {at_token} within 120 s:\n{stack.logs()}")
        record = stack.redis().hgetall(redis_keys.request_record(stack.prefix, seen[0]))
        if record.get("status") == "running":
            return HeldStream(runner, result, seen[0], sent, record)
        stack.resume_workers()
        runner.join(120)
    raise AssertionError(f"the request ended before its worker was held, {attempts} times")


def kill_mid_stream(stack: Stack, url: str, body: dict, at_token: int = 1, headers=dict,
                    attempts: int = 5) -> tuple[list[dict], dict, str, str]:
    """Stream `body` (POSTed to `url` with `headers()`), hold every worker at the client's
    `at_token`-th token (hold_mid_stream) and SIGKILL the one running the request, the others
    resumed; the stream's events, the headers sent, the request's id and the killed worker's name."""
    held = hold_mid_stream(stack, url, body, at_token, headers, attempts)
    stack.kill_paused_worker(held.record["worker"])
    return held.events(), held.headers, held.request_id, held.record["worker"]
