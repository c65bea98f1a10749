"""The end-to-end tests' stack (streamq/stack.py's launcher, with the tests' defaults: a key
prefix of its own, fp32 on the CPU, a tiny model) and helpers to read and hold its streams."""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path

import httpx

from shared import redis_keys
from shared.messages import RequestStatus
from shared.request_record import RequestRecord
from streamq import stack as launcher
from streamq.stack import ROOT  # noqa: F401 - tests run the command from the checkout too
from streamq.testing.sse import parse_sse


class Stack(launcher.Stack):
    """`model`: a model folder (None: the default model). Every process runs in fp32 on the CPU
    with the stack's own key prefix and model cache in `folder`; `env` goes on top (an empty value
    unsets). `worker_envs` and `worker_python`, when given, are per worker: extra environment, and
    the Python to run it with (e.g. the vLLM virtualenv's)."""

    def __init__(self, redis_url: str, model: Path | None, folder: Path, replicas: int = 1, batch_size: int = 8,
                 workers: int = 1, env: dict[str, str] | None = None, scheduler: bool = False,
                 worker_envs: list[dict[str, str]] | None = None, worker_python: list[str | None] | None = None):
        settings = {"STREAMQ_PREFIX": f"e2e{uuid.uuid4().hex[:8]}",
                    "STREAMQ_MODEL": str(model) if model else "default", "STREAMQ_DTYPE": "float32",
                    "STREAMQ_DEVICE": "cpu", "STREAMQ_BATCH_SIZE": str(batch_size),
                    "STREAMQ_MODEL_CACHE_DIR": str(folder / "cache"), "STREAMQ_SSE_KEEPALIVE_S": "1", **(env or {})}
        super().__init__(folder, settings, redis_url=redis_url, workers=workers, replicas=replicas,
                         scheduler=scheduler, worker_settings=worker_envs, worker_python=worker_python)
        self.model_name = model.name if model else "SmolLM2-135M-Instruct"

    @contextmanager
    def cancel_published(self, timeout_s: float = 60.0) -> Iterator[SimpleNamespace]:
        """Listen on the workers' cancel channel while the block runs, then wait until a cancel
        was published there (unless the block set the `expected` of what it is given to False: no
        cancel is due after all). A paused worker has it in its connection by then: resumed, it
        stops the request within a step, before the tiny model can run it to its end. (A record's
        cancel_requested flag is set a round trip before the api publishes, so it is no such sign.)"""
        with self.redis() as client, client.pubsub() as pubsub:
            pubsub.ssubscribe(redis_keys.cancel_channel(self.prefix))
            self._next_message(pubsub, "ssubscribe", timeout_s)  # subscribed before the block asks
            watch = SimpleNamespace(expected=True)
            yield watch
            if watch.expected:
                self._next_message(pubsub, "smessage", timeout_s)

    @staticmethod
    def _next_message(pubsub, kind: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = pubsub.get_sharded_message(ignore_subscribe_messages=False, timeout=1.0)
            if message is not None and message["type"] == kind:
                return message
        raise AssertionError(f"no {kind} on the cancel channel within {timeout_s} s")


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
    record: RequestRecord  # the request's record at the pause: running, on its worker

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

        def watch(request_id: str, held=held, seen=seen) -> None:
            if not held.is_set():
                stack.pause_workers()
                seen.append(request_id)
                held.set()

        def stream(sent=sent, result=result, watch=watch) -> None:
            with httpx.Client(timeout=120, headers=sent) as client:
                result.append(stream_posted(client, url, body, at_token, watch))

        runner = threading.Thread(target=stream)
        runner.start()
        if not held.wait(120):
            raise AssertionError(f"no token {at_token} within 120 s:\n{stack.logs()}")
        record = stack.record(seen[0])
        if record is not None and record.status == RequestStatus.RUNNING:
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
    stack.kill_paused_worker(held.record.worker)
    return held.events(), held.headers, held.request_id, held.record.worker
