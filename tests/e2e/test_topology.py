"""`streamq serve --api-replicas 2 --workers 2`: docker-compose.yml's topology without Docker.

Everything goes through the nginx that serve puts in front of the replicas (rendered from the
template of deploy/nginx.conf, which compose's lb runs): readiness, requests spread over both replicas and
both workers, an SSE stream and its resumption, the body limit; then SIGTERM leaves nothing running.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shared.redis_server import free_port
from shared.settings import ApiSettings
from tests.stack import parse_sse
from tests.waiting import until

ROOT = Path(__file__).resolve().parents[2]
ENDED = ("done", "failed", "cancelled", "expired")


def _descendants(pid: int) -> dict[int, bytes]:
    """Every process below `pid` (children, and theirs: nginx's workers), with its command line."""
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found: dict[int, bytes] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child in (c for c, p in parent_of.items() if p == parent and c not in found):
            try:
                found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start(model: Path, redis_url: str, folder: Path) -> tuple[subprocess.Popen, int, list[str], threading.Event]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("STREAMQ_REDIS_URL", "STREAMQ_AUTH")}
    env.update(REDIS_URL=redis_url, STREAMQ_PREFIX=f"topo{uuid.uuid4().hex[:8]}", STREAMQ_MODEL=str(model),
               STREAMQ_DTYPE="float32", STREAMQ_DEVICE="cpu", STREAMQ_MODEL_CACHE_DIR=str(folder / "cache"),
               # One request per worker at a time: while one worker runs a request, the other takes the next.
               STREAMQ_BATCH_SIZE="1")
    proc = subprocess.Popen([sys.executable, "-m", "streamq.cli", "serve", "--port", str(port),
                             "--api-replicas", "2", "--workers", "2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop" in line:
                ready.set()
        ready.set()  # serve exited before it was ready: fail now, with its output
    threading.Thread(target=read, daemon=True).start()
    return proc, port, lines, ready


async def _submit(client: httpx.AsyncClient, **body) -> str:
    reply = await client.post("/v1/requests", json=body)
    assert reply.status_code == 202, reply.text
    return reply.json()["id"]


async def _finished(client: httpx.AsyncClient, request_id: str) -> dict:
    """The request's state once it ended, long-polled through the load balancer."""
    state: dict = {}

    async def ended() -> bool:
        nonlocal state
        state = (await client.get(f"/v1/requests/{request_id}", params={"wait": 10})).json()
        return state["status"] in ENDED
    await until(ended, 120, f"request {request_id} to end")
    return state


async def _accepted_by(replica: str) -> float:
    """How many POST /v1/requests this replica answered 202, from its own /metrics."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{replica}/metrics")).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "streamq:api_requests_total"
               and sample.labels == {"endpoint": "/v1/requests", "method": "POST", "status": "202"})


async def test_two_replicas_and_two_workers_behind_nginx(redis_url, tiny_llama, tmp_path):
    proc, port, lines, ready = _start(tiny_llama, redis_url, tmp_path)
    processes: dict[int, bytes] = {}
    try:
        assert ready.wait(180) and "Press Ctrl-C to stop" in "".join(lines), "".join(lines)
        replicas = re.search(r"2 api replicas behind nginx: (\S+) (\S+);", "".join(lines)).groups()
        processes = _descendants(proc.pid)
        commands = sorted(cmd.split(b" -m streamq.cli ")[-1].strip() if b"streamq.cli" in cmd else cmd.split()[0]
                          for pid, cmd in processes.items())
        assert commands.count(b"api") == 2 and commands.count(b"worker") == 2, commands
        assert commands.count(b"scheduler") == 1 and any(b"nginx" in c for c in commands), commands

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as lb:
            assert (await lb.get("/readyz")).status_code == 200

            async def both_workers_live() -> bool:
                return len((await lb.get("/readyz")).json().get("workers", [])) == 2
            await until(both_workers_live, 60, "both workers to report to the replicas")

            # Requests spread over both replicas (nginx) and both workers (the shared request stream).
            workers: set[str] = set()
            for _round in range(5):  # a bound, not a delay: each round is 4 requests at once
                ids = await asyncio.gather(*(_submit(lb, prompt=f"Request {i}", max_tokens=8, ignore_eos=True,
                                                     temperature=0) for i in range(4)))
                states = await asyncio.gather(*(_finished(lb, i) for i in ids))
                assert all(s["status"] == "done" and s["completion_tokens"] == 8 for s in states), states
                workers |= {s["worker"] for s in states}
                accepted = [await _accepted_by(r) for r in replicas]
                if len(workers) == 2 and all(accepted):
                    break
            assert len(workers) == 2, workers
            assert all(accepted), dict(zip(replicas, accepted, strict=True))

            # One stream through nginx: every token, in order, then the final event.
            request_id = await _submit(lb, prompt="Once upon a time", max_tokens=12, ignore_eos=True, temperature=0)
            async with lb.stream("GET", f"/v1/requests/{request_id}/events") as reply:
                assert reply.headers["content-type"].startswith("text/event-stream")
                events = parse_sse([line async for line in reply.aiter_lines()])
            tokens = [e for e in events if e.get("event") == "token"]
            assert [t["data"]["index"] for t in tokens] == list(range(12))
            assert [t["id"] for t in tokens] == [str(i) for i in range(12)]
            assert events[-1]["event"] == "final" and events[-1]["data"]["status"] == "done", events[-1]
            assert events[-1]["data"]["usage"]["completion_tokens"] == 12
            state = await _finished(lb, request_id)
            assert "".join(t["data"]["text"] for t in tokens) == state["text"]

            # Last-Event-ID reaches a replica through nginx: exactly the events after token 5.
            async with lb.stream("GET", f"/v1/requests/{request_id}/events",
                                 headers={"Last-Event-ID": "5"}) as reply:
                resumed = parse_sse([line async for line in reply.aiter_lines()])
            assert [e["data"] for e in resumed if e.get("event") == "token"] == [t["data"] for t in tokens[6:]]

            # nginx takes bodies up to the api's own limit (the api judges them), and refuses larger ones.
            limit = ApiSettings.model_fields["max_body_bytes"].default
            within = await lb.post("/v1/requests", json={"prompt": "x " * (limit // 3), "max_tokens": 1})
            assert within.status_code == 400 and "context" in within.text, within.text
            over = await lb.post("/v1/requests", json={"prompt": "x " * limit, "max_tokens": 1})
            assert over.status_code == 413 and str(limit) in over.json()["detail"]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, "".join(lines)
    assert processes and not [cmd for pid, cmd in processes.items() if _alive(pid)], "processes left running"
    with socket.socket() as s:  # nothing listens on the load balancer's port any more
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
