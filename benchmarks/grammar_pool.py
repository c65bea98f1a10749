"""The api's event loop while large-schema requests arrive: grammars compiled on the loop (as
before api/core/grammar_pool.py) against compiled in the grammar pool.

    .venv/bin/python benchmarks/grammar_pool.py [--requests 32] [--rounds 3]

One api (the real app, uvicorn, keys off) in this process on a private redis-server, with a
tiny model's tokenizer (no worker: each request is queued and answered 202). `--requests` native
submits at once, each under its own JSON schema of 700 properties with a pattern each (about
45,000 characters; distinct, so no verdict is answered from the pool's cache). Meanwhile a task
on the api's loop sleeps 1 ms at a time and notes how late it wakes: the loop's longest stall.
A client polls /healthz every 5 ms: its slowest answer. Rounds alternate the order of the two
modes; each mode's worst figure over the rounds is reported, after lscpu's model and flags
(docs/benchmarks.md, "The api's loop under grammar compiles").
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx
import uvicorn

from api.app import create_app
from api.core.grammar_pool import GrammarPool
from benchmarks.report import cpu_flags, cpu_model, print_table
from shared.redis_server import RedisServer
from shared.settings import ApiSettings
from shared.structured import verdict
from streamq.testing.tiny_models import build_model


class Inline:
    """The grammar pool's interface, compiling on the caller's event loop: the api as it was."""

    compiles = 0

    async def verdict(self, constraint: str, tenant: str = "") -> str:
        self.compiles += 1
        return verdict(constraint)

    async def close(self) -> None:
        pass


def schema(seed: int) -> dict:
    rng = random.Random(seed)
    return {"type": "object", "properties": {
        "".join(rng.choice("abcdefghij") for _ in range(12)): {"type": "string", "pattern": "(a|b)*a(a|b){8}c"}
        for _ in range(700)}}


async def stalls(stop: asyncio.Event, gaps: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        before = loop.time()
        await asyncio.sleep(0.001)
        gaps.append(loop.time() - before - 0.001)


async def health(http: httpx.AsyncClient, stop: asyncio.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        began = time.perf_counter()
        assert (await http.get("/healthz")).status_code == 200
        latencies.append(time.perf_counter() - began)
        await asyncio.sleep(0.005)


async def one_round(settings: ApiSettings, grammars, requests: int, seed: int) -> dict:
    """One api up with `grammars`, `requests` constrained submits at once; the loop's figures."""
    settings = settings.model_copy(update={"port": 0})
    server = uvicorn.Server(uvicorn.Config(create_app(settings, grammars=grammars), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="on"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
        if isinstance(grammars, GrammarPool):  # its processes up first, as on a replica that has served
            await grammars.ready()
        warm = await http.post("/v1/requests", json={"prompt": "a", "max_tokens": 1,
                                                     "structured_outputs": {"json_object": True}})
        assert warm.status_code == 202, warm.text
        bodies = [{"prompt": "a b c", "max_tokens": 4, "structured_outputs": {"json": schema(seed * 10_000 + i)}}
                  for i in range(requests)]
        stop, gaps, latencies = asyncio.Event(), [], []
        probes = [asyncio.create_task(stalls(stop, gaps)), asyncio.create_task(health(http, stop, latencies))]
        began = time.perf_counter()
        answers = await asyncio.gather(*(http.post("/v1/requests", json=body) for body in bodies))
        wall = time.perf_counter() - began
        stop.set()
        await asyncio.gather(*probes)
    assert all(a.status_code == 202 for a in answers), [a.text for a in answers if a.status_code != 202][:1]
    server.should_exit = True
    await serving
    return {"stall_ms": 1e3 * max(gaps), "stall_p99_ms": 1e3 * statistics.quantiles(gaps, n=100, method="inclusive")[98],
            "healthz_max_ms": 1e3 * max(latencies), "all_202_s": wall}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="the pool's processes (STREAMQ_API_CPU_WORKERS)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        redis = RedisServer(Path(folder) / "redis")
        url = redis.start()
        try:
            model = build_model(Path(folder) / "model", "llama")
            settings = ApiSettings(_env_file=None, redis_url=url, prefix="bench", model=str(model),
                                   served_model_name="m", auth="off", max_queued_requests=1_000_000)
            results: dict[str, list[dict]] = {"inline": [], "pool": []}
            for r in range(args.rounds):
                for mode in (["inline", "pool"] if r % 2 == 0 else ["pool", "inline"]):
                    grammars = Inline() if mode == "inline" else GrammarPool(args.workers, 60)
                    results[mode].append(await one_round(settings, grammars, args.requests, r))
                    print(f"# round {r + 1}: {mode} {results[mode][-1]}", file=sys.stderr)
        finally:
            redis.stop()
    print(f"Model name: {cpu_model()}\nFlags: {' '.join(cpu_flags())}")
    print(f"{args.requests} constrained requests at once, {args.rounds} rounds; pool of {args.workers} processes")
    print_table(["compiles", "longest loop stall ms", "stall p99 ms", "slowest /healthz ms", "all 202 in s"],
                [[mode, f"{max(r['stall_ms'] for r in rs):.1f}", f"{max(r['stall_p99_ms'] for r in rs):.1f}",
                  f"{max(r['healthz_max_ms'] for r in rs):.1f}", f"{statistics.median(r['all_202_s'] for r in rs):.2f}"]
                 for mode, rs in results.items()])


if __name__ == "__main__":
    asyncio.run(main())
