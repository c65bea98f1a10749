"""Tenant B's time to first token with and without tenant A's flood, through the whole stack.

    .venv/bin/python benchmarks/fairness.py [--flood 200] [--requests 10]

One private stack (redis, one worker with the default model, one api with keys on). Three
phases in one run: B alone; B while A has `--flood` requests queued; and the same flood with
B's requests sent under A's key, which is what one shared FIFO queue gives (they queue behind
A's backlog). B streams `--requests` chat requests at once; A submits detached requests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamq.stack import local_stack
from benchmarks.report import print_table
from shared.api_keys import KeyStore
from shared.redis_client import connect


async def first_token(client: httpx.AsyncClient, url: str, key: str, i: int, max_tokens: int) -> float:
    body = {"messages": [{"role": "user", "content": f"Name a colour. ({i})"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/requests", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("event: token"):
                return time.perf_counter() - start  # leaving cancels the rest: only TTFT matters here
    raise RuntimeError("the stream ended without a token")


async def b_ttft(client, url, key, n, max_tokens) -> dict:
    ttft = sorted(await asyncio.gather(*(first_token(client, url, key, i, max_tokens) for i in range(n))))
    return {"p50_s": round(statistics.median(ttft), 2), "max_s": round(ttft[-1], 2)}


async def flood(client, url, key, n, max_tokens) -> list[str]:
    ids = []
    for i in range(n):
        reply = await client.post(f"{url}/v1/requests", headers={"Authorization": f"Bearer {key}"}, json={
            "prompt": f"Count slowly from one. ({i})", "max_tokens": max_tokens, "ignore_eos": True})
        reply.raise_for_status()
        ids.append(reply.json()["id"])
    return ids


async def drain(client, url, key, ids) -> None:
    for rid in ids:
        await client.delete(f"{url}/v1/requests/{rid}", headers={"Authorization": f"Bearer {key}"})


async def run(url: str, keys: dict[str, str], args) -> dict:
    async with httpx.AsyncClient(timeout=None) as client:
        await b_ttft(client, url, keys["b"], 2, 4)  # warm up
        results = {"b alone": await b_ttft(client, url, keys["b"], args.requests, args.max_tokens)}
        for phase, b_key in (("b during a's flood (fair)", keys["b"]), ("b's requests under a's key (fifo)", keys["a"])):
            ids = await flood(client, url, keys["a"], args.flood, args.flood_tokens)
            started = time.perf_counter()
            results[phase] = await b_ttft(client, url, b_key, args.requests, args.max_tokens)
            results[phase]["a_waiting_when_b_came"] = args.flood
            await drain(client, url, keys["a"], ids)
            results[phase]["phase_s"] = round(time.perf_counter() - started, 1)
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=200, help="requests tenant A queues")
    parser.add_argument("--flood-tokens", type=int, default=16, help="max_tokens of A's requests")
    parser.add_argument("--requests", type=int, default=10, help="requests tenant B streams at once")
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of B's requests")
    args = parser.parse_args()
    env: dict[str, str] = {}
    with local_stack("fair", {"STREAMQ_AUTH": "on", "STREAMQ_MAX_QUEUED_REQUESTS": "100000"}, env_out=env) as url:
        async def make_keys():
            redis = connect(env["REDIS_URL"])
            store = KeyStore(redis, env.get("STREAMQ_PREFIX", "streamq"))
            made = {t: await store.create(t) for t in ("a", "b")}
            await redis.aclose()
            return made
        keys = asyncio.run(make_keys())
        results = asyncio.run(run(url, keys, args))
    print(json.dumps(results, indent=2))
    print_table(["phase", "B TTFT p50 (s)", "B TTFT max (s)"],
                [(phase, r["p50_s"], r["max_s"]) for phase, r in results.items()])


if __name__ == "__main__":
    main()
