"""The failure scenarios on the default model, with a table of what clients saw.

    .venv/bin/python benchmarks/chaos.py

For each scenario: 8 greedy streams (48 tokens each, ignore_eos) through real processes, a
failure injected once tokens flow, and every client resuming with Last-Event-ID on another
replica if its connection breaks. Each client's token ids are compared with an undisturbed run:
lost = reference tokens missing, duplicated = indices received twice, max pause = the longest
gap between two tokens a client saw.

Scenarios: worker SIGKILL (two workers, the scheduler requeues), api replica SIGKILL (two
replicas), Redis SIGKILL and restart from its AOF (appendfsync always).
"""
from __future__ import annotations

import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import print_table
from shared.messages import RequestStatus
from shared.redis_server import RedisServer
from streamq.stack import Stack
from streamq.testing.sse import parse_sse

PROMPTS = ["Tell me about the sea.", "What is a cat?", "Name a colour.", "Describe rain.",
           "What is bread?", "Why is the sky blue?", "Count to five.", "What is Paris?"]
TOKENS = 48
# As the end-to-end tests run it: fp32 on the CPU (tokens compared exactly), batches of 8.
SETTINGS = {"STREAMQ_MODEL": "default", "STREAMQ_DTYPE": "float32", "STREAMQ_DEVICE": "cpu",
            "STREAMQ_BATCH_SIZE": "8", "STREAMQ_SSE_KEEPALIVE_S": "1"}
FAST_FAILOVER = {"STREAMQ_HEARTBEAT_INTERVAL_S": "1", "STREAMQ_HEARTBEAT_TTL_S": "3", "STREAMQ_RECLAIM_INTERVAL_S": "1"}


def client_run(urls: list[str], prompt: str, flowing: threading.Event) -> tuple[list[tuple[int, int]], list[float]]:
    """Stream one request; on a broken connection resume on the next replica. Returns
    [(index, token id)] in arrival order and the arrival times."""
    received, times = [], []
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as client:
        rid = None
        for attempt in range(10):
            url = urls[attempt % len(urls)]
            try:
                if rid is None:
                    rid = client.post(f"{url}/v1/requests", json=body).json()["id"]
                headers = {"Last-Event-ID": str(received[-1][0])} if received else {}
                with client.stream("GET", f"{url}/v1/requests/{rid}/events", headers=headers) as stream:
                    lines = []
                    for line in stream.iter_lines():
                        lines.append(line)
                        if line != "":
                            continue
                        for event in parse_sse(lines):
                            if event["event"] == "token":
                                received.append((int(event["id"]), event["data"]["token_id"]))
                                times.append(time.monotonic())
                                if len(received) >= 3:
                                    flowing.set()
                            elif event["event"] == "final":
                                return received, times
                        lines = []
            except httpx.HTTPError:
                time.sleep(0.2)  # the replica (or Redis) went away: try again, elsewhere
    return received, times


def scenario(name: str, stack_kwargs: dict, inject, redis: RedisServer | None = None) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"streamq-chaos-{name.split()[0]}-"))
    own = redis or RedisServer(folder / "redis")
    url = own.url if redis else own.start()
    try:
        settings = {**SETTINGS, **stack_kwargs.pop("env", {})}  # the default model, from the user's model cache
        with Stack(folder / "stack", settings, redis_url=url, **stack_kwargs) as stack:
            flowing = threading.Event()
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                futures = [pool.submit(client_run, stack.urls, p, flowing) for p in PROMPTS]
                if inject is not None:
                    flowing.wait(120)
                    inject(stack, own)
                return {"results": [f.result() for f in futures]}
    finally:
        own.stop()


def kill_a_busy_worker(stack: Stack, redis: RedisServer) -> None:
    """SIGKILL the worker that runs the first running request found (not an idle one)."""
    record = stack.wait_for_record(lambda r: r.status == RequestStatus.RUNNING)
    stack.kill_worker(record.worker)


def kill_replica(stack: Stack, redis: RedisServer) -> None:
    stack.kill_replica(0)


def restart_redis(stack: Stack, redis: RedisServer) -> None:
    redis.crash_and_restart()


def main() -> None:
    print("# undisturbed reference run", file=sys.stderr)
    reference = [[t for _, t in r] for r, _ in scenario("reference", {}, None)["results"]]
    assert all(len(r) == TOKENS for r in reference), "the undisturbed run must complete"
    rows = []
    for name, kwargs, inject, redis in [
        ("worker SIGKILL", {"workers": 2, "scheduler": True, "env": FAST_FAILOVER}, kill_a_busy_worker, None),
        ("api replica SIGKILL", {"replicas": 2}, kill_replica, None),
        ("Redis SIGKILL + restart (AOF always)", {}, restart_redis, "aof"),
    ]:
        print(f"# {name}", file=sys.stderr)
        server = None
        if redis == "aof":
            server = RedisServer(Path(tempfile.mkdtemp(prefix="streamq-chaos-redis-")), appendonly=True,
                                 appendfsync="always")
            server.start()
        out = scenario(name, kwargs, inject, server)
        lost = dup = completed = 0
        pause = 0.0
        for (received, times), ref in zip(out["results"], reference):
            indices = [i for i, _ in received]
            dup += len(indices) - len(set(indices))
            got = dict(received)
            lost += sum(1 for i, t in enumerate(ref) if got.get(i) != t)
            completed += len(set(indices)) == TOKENS and all(got.get(i) == t for i, t in enumerate(ref))
            pause = max([pause] + [b - a for a, b in zip(times, times[1:])])
        rows.append((name, len(PROMPTS), completed, lost, dup, round(pause, 2)))
    print_table(["scenario", "requests", "completed exactly", "lost tokens", "duplicated tokens", "max pause (s)"],
                rows)


if __name__ == "__main__":
    main()
