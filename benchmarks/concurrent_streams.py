"""Aggregate generation throughput through the whole stack, N streams at once vs one at a time.

    python benchmarks/concurrent_streams.py --url http://127.0.0.1:8000 --streams 8 --max-tokens 64

Each stream is a native `POST /v1/requests` with `stream: true` and ignore_eos, so every
request generates exactly max_tokens tokens. Prints absolute figures and the ratio, measured
in one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
           "List some facts about the Moon.", "Describe a busy market in the morning.",
           "What makes a good cup of tea?", "Tell me about the history of maps.",
           "How do bees make honey?", "Describe the water cycle."]


async def one_stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    start = time.perf_counter()
    first, tokens = None, 0
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{url}/v1/requests", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("event: token"):
                tokens += 1
                first = first or time.perf_counter()
            elif line.startswith("event: final"):
                break
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens


async def run(url: str, streams: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, PROMPTS[i % len(PROMPTS)], max_tokens)
                                         for i in range(streams)))
        wall = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    return {"streams": streams, "tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "ttft_median_s": round(statistics.median(r[0] for r in results), 3)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    await run(args.url, 1, 4)  # warm-up
    single = await run(args.url, 1, args.max_tokens)
    concurrent = await run(args.url, args.streams, args.max_tokens)
    print(json.dumps({"single": single, "concurrent": concurrent,
                      "speedup": round(concurrent["tokens_per_s"] / single["tokens_per_s"], 2)}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
