"""Load spread over workers: k requests at once on 1 and on 2 workers, through the whole stack.

    .venv/bin/python benchmarks/spread.py [--backend null|hf] [--bursts 4 16 64] [--rounds 2]

Each run is one stack (a private Redis, M workers, one api replica) that takes bursts of k
requests sent together over HTTP (the native api), each asking for `--tokens` tokens with
`ignore_eos`. For every burst: TTFT p50 and p99 (from each request's timings), throughput
(tokens over the burst's wall time, first send to last end), how many requests each worker
took, and how long requests waited for their first step beyond what the free slots imply; and
throughput against one worker's, measured in the same run.

The null backend (default) emits tokens at a set rate per request with no model, so the figures
are those of the distribution itself: with `--batch` slots a worker, M workers start M x batch
requests at once and the rest in later waves, and a wait in Redis while a slot is free shows
as a TTFT above the wave's. `--backend hf` runs the tiny-or-default model instead, where M
workers on this machine share its cores. Runs alternate the order of M; medians of the rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamq.stack import local_stack
from benchmarks.report import machine, print_machine, print_table


async def burst(url: str, k: int, tokens: int) -> dict:
    """Send k requests together, wait for every one to end; their timings and workers."""
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.time()
        replies = await asyncio.gather(*[client.post(f"{url}/v1/requests", json={
            "prompt": f"request {i} of a burst", "max_tokens": tokens, "ignore_eos": True, "temperature": 0})
            for i in range(k)])
        ids = [r.json()["id"] for r in replies]

        async def done(rid: str) -> dict:
            while True:
                state = (await client.get(f"{url}/v1/requests/{rid}", params={"wait": 10})).json()
                if state["status"] in ("done", "failed", "cancelled", "expired"):
                    return state
        states = await asyncio.gather(*[done(rid) for rid in ids])
    assert all(s["status"] == "done" and s["completion_tokens"] == tokens for s in states), states[0]
    ended = max(s["timings"]["created_at"] + s["timings"]["total_s"] for s in states)
    ttfts = sorted(s["timings"]["ttft_s"] for s in states)
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "tok_per_s": k * tokens / (ended - started),
            "per_worker": sorted(Counter(s["worker"] for s in states).values()),
            "scheduled_s": sorted(s["timings"]["scheduled_s"] for s in states)}


def wait_for_workers(url: str, count: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(httpx.get(f"{url}/readyz", timeout=5).json().get("workers", [])) >= count:
            return
        time.sleep(0.5)  # start-up polling only
    raise SystemExit(f"fewer than {count} live workers after {timeout_s} s")


def late(slots: int, seconds: float, scheduled: list[float]) -> int:
    """Requests that started in a later wave than the free slots allow (`slots` at once, each
    running `seconds`; `scheduled`: each request's wait for its first step, sorted): those whose
    first step came more than half a request's time after their wave began. 0: every request
    started as soon as a slot was free."""
    return sum(1 for i, s in enumerate(scheduled) if s > (i // slots) * seconds + seconds / 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="null", choices=["null", "hf"])
    parser.add_argument("--bursts", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=16, help="slots a worker")
    parser.add_argument("--tokens", type=int, default=20, help="tokens a request")
    parser.add_argument("--rate", type=float, default=20.0, help="the null backend's tokens/s a request")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = {"STREAMQ_BACKEND": args.backend, "STREAMQ_BATCH_SIZE": str(args.batch),
                "STREAMQ_NULL_TOKENS_PER_S": str(args.rate), "STREAMQ_PREFIX": "spread"}
    results: dict[tuple[int, int], list[dict]] = {}
    for r in range(args.rounds):
        for m in (args.workers if r % 2 == 0 else list(reversed(args.workers))):
            with local_stack(f"spread{m}", settings, workers=m) as url:
                wait_for_workers(url, m)
                asyncio.run(burst(url, 2, 2))  # warm-up
                for k in args.bursts:
                    results.setdefault((m, k), []).append(asyncio.run(burst(url, k, args.tokens)))
                    print(f"# round {r + 1}: {m} worker(s), {k} at once: {results[(m, k)][-1]['tok_per_s']:.1f} tok/s",
                          file=sys.stderr)
    seconds = args.tokens / args.rate if args.backend == "null" else None
    rows = []
    for (m, k), runs in sorted(results.items(), key=lambda item: (item[0][1], item[0][0])):
        row = {"workers": m, "at_once": k, "ttft_p50_s": round(statistics.median(x["ttft_p50_s"] for x in runs), 3),
               "ttft_p99_s": round(statistics.median(x["ttft_p99_s"] for x in runs), 3),
               "tok_per_s": round(statistics.median(x["tok_per_s"] for x in runs), 1),
               "per_worker": " / ".join("+".join(map(str, x["per_worker"])) for x in runs)}
        alone = results.get((1, k))
        one = statistics.median(x["tok_per_s"] for x in alone) if alone else None
        row["vs_1_worker"] = round(row["tok_per_s"] / one, 2) if one else None
        if seconds is not None:
            row["late"] = " / ".join(str(late(m * args.batch, seconds, x["scheduled_s"])) for x in runs)
        rows.append(row)
    report = {"machine": machine("n/a" if args.backend == "null" else "auto", 0), "args": vars(args), "rows": rows}
    print(json.dumps(report, indent=1))
    print_table(list(rows[0]), [list(row.values()) for row in rows])
    print_machine(report["machine"])


if __name__ == "__main__":
    main()
