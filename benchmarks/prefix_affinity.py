"""Prefix-aware vs prefix-blind work: 2 workers, 8 system prompts, 64 requests, in ONE run.

    .venv/bin/python benchmarks/prefix_affinity.py [--backend hf|null] [--rounds 6] [--rate 2] [--kv-blocks N]

One stack: a private Redis, 2 workers and two api replicas, one routing by prefix
(STREAMQ_PREFIX_AFFINITY=true) and one not (false); the workers are the same for both and
announce what they take either way, so the only difference is the api's choice of lane. Rounds
alternate between the two replicas (aware, blind, blind, aware, ...). Each round has its own 8
system prompts of about `--prompt-tokens` tokens (so no round finds another's in a cache), and
sends `--requests` chat requests, each a system prompt and a short question, `--tokens` tokens
each (greedy, ignore_eos), in a shuffled order at `--rate` requests/s (0: all at once).

Per round: the prefix cache's hit rate from the workers' /metrics (prefix_cache_hits /
prefix_cache_queries, blocks looked up; a lookup stops at the first miss, so this rate flatters
both), the share of prompt tokens served from the cache (hits x block size / prompt tokens),
TTFT p50 and p99 (from each request's timings: accepted by the api to first token), throughput
(tokens over first send to last end), and how many requests each worker ran. Medians over the
rounds of each mode, and aware/blind ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
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
from benchmarks.spread import wait_for_workers
from shared.model_paths import prepare_model
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer

WORDS = ("the service keeps every request in order and answers with care while the model reads "
         "a long instruction about tone format safety sources dates names numbers tables lists "
         "code errors users tenants billing support refunds orders shipping accounts passwords "
         "privacy logs metrics alerts deploys rollbacks queues workers caches tokens prompts").split()
QUESTIONS = ["What is the refund policy?", "How do I reset my password?", "Where is my order?",
             "Can I change the shipping address?", "Why was I billed twice?", "How do I close my account?",
             "What data do you keep about me?", "Who do I call for urgent help?"]
METRICS = ("prefix_cache_hits_total", "prefix_cache_queries_total", "prompt_tokens_total")


def system_prompts(tok: Tokenizer, seed: int, count: int, tokens: int) -> list[str]:
    """`count` distinct system prompts of about `tokens` tokens each (as the chat template renders them)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = [f"Assistant {seed}-{i}:"]
        while len(tok.encode_chat([{"role": "system", "content": " ".join(words)}])) < tokens:
            words.extend(rng.choice(WORDS) for _ in range(16))
        prompts.append(" ".join(words))
    return prompts


async def worker_counters(client: httpx.AsyncClient, url: str) -> dict[str, dict[str, float]]:
    """Each live worker's prefix-cache and prompt-token counters, from its /metrics."""
    beats = (await client.get(f"{url}/readyz")).json()["workers"]
    counters = {}
    for beat in beats:
        text = (await client.get(f"http://127.0.0.1:{beat['metrics_port']}/metrics")).text
        counters[beat["worker"]] = {name: float(m.group(1)) if (m := re.search(
            rf"^streamq:{name} (\S+)$", text, re.MULTILINE)) else 0.0 for name in METRICS}
    return counters


async def one_round(url: str, prompts: list[str], order: list[int], tokens: int, rate: float, block: int) -> dict:
    """Send the requests (prompt `order[i]` i-th), wait for every one to end; the round's figures."""
    async with httpx.AsyncClient(timeout=600) as client:
        before = await worker_counters(client, url)
        started = time.time()

        async def send(i: int, p: int) -> dict:
            if rate > 0:
                await asyncio.sleep(max(0.0, started + i / rate - time.time()))
            messages = [{"role": "system", "content": prompts[p]}, {"role": "user", "content": QUESTIONS[i % 8]}]
            reply = await client.post(f"{url}/v1/requests", json={
                "messages": messages, "max_tokens": tokens, "ignore_eos": True, "temperature": 0})
            rid = reply.json()["id"]
            while True:
                state = (await client.get(f"{url}/v1/requests/{rid}", params={"wait": 10})).json()
                if state["status"] in ("done", "failed", "cancelled", "expired"):
                    return state
        states = await asyncio.gather(*[send(i, p) for i, p in enumerate(order)])
        after = await worker_counters(client, url)
    assert all(s["status"] == "done" and s["completion_tokens"] == tokens for s in states), states[0]
    delta = {name: sum(after[w][name] - before.get(w, {}).get(name, 0.0) for w in after) for name in METRICS}
    ended = max(s["timings"]["created_at"] + s["timings"]["total_s"] for s in states)
    ttfts = sorted(s["timings"]["ttft_s"] for s in states)
    return {"hit_rate": delta["prefix_cache_hits_total"] / max(1.0, delta["prefix_cache_queries_total"]),
            "cached_share": delta["prefix_cache_hits_total"] * block / max(1.0, delta["prompt_tokens_total"]),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "tok_per_s": len(states) * tokens / (ended - started),
            "per_worker": "+".join(map(str, sorted(Counter(s["worker"] for s in states).values())))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="hf", choices=["hf", "null"])
    parser.add_argument("--rounds", type=int, default=6, help="rounds in all, alternating aware and blind")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="distinct system prompts a round")
    parser.add_argument("--prompt-tokens", type=int, default=500, help="tokens of each system prompt")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated a request")
    parser.add_argument("--rate", type=float, default=2.0, help="requests sent a second (0: all at once)")
    parser.add_argument("--wait-ms", type=int, default=1000,
                        help="the affinity bound (STREAMQ_PREFIX_AFFINITY_WAIT_MS)")
    parser.add_argument("--batch", type=int, default=16, help="slots a worker")
    parser.add_argument("--kv-blocks", type=int, default=0,
                        help="KV-cache blocks a worker (0: sized from STREAMQ_KV_CACHE_GB, room for every prompt)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads of each worker")
    parser.add_argument("--null-rate", type=float, default=50.0, help="the null backend's tokens/s a request")
    args = parser.parse_args()
    block = WorkerSettings().block_size
    tok = Tokenizer(prepare_model(WorkerSettings()))
    settings = {"STREAMQ_BACKEND": args.backend, "STREAMQ_BATCH_SIZE": str(args.batch),
                "STREAMQ_NULL_TOKENS_PER_S": str(args.null_rate),
                "STREAMQ_PREFIX": "affinity", "STREAMQ_PREFIX_AFFINITY_WAIT_MS": str(args.wait_ms),
                "OMP_NUM_THREADS": str(args.threads), **({"STREAMQ_NUM_KV_BLOCKS": str(args.kv_blocks)}
                                                         if args.kv_blocks else {})}
    urls: list[str] = []
    results: dict[str, list[dict]] = {"aware": [], "blind": []}
    with local_stack("affinity", settings, workers=2, urls_out=urls,
                     apis=[{"STREAMQ_PREFIX_AFFINITY": "true"}, {"STREAMQ_PREFIX_AFFINITY": "false"}]):
        wait_for_workers(urls[0], 2)
        api = {"aware": urls[0], "blind": urls[1]}
        warm = system_prompts(tok, 10_000, 2, args.prompt_tokens)
        for url in urls:
            asyncio.run(one_round(url, warm, [0, 1, 0, 1], 2, 0, block))
        for r in range(args.rounds):
            # aware, blind, blind, aware, ...: each mode goes first in every other pair
            mode = ("aware", "blind")[(r + r // 2) % 2]
            order = [i % args.prompts for i in range(args.requests)]
            random.Random(r // 2).shuffle(order)  # the same order in both rounds of a pair
            prompts = system_prompts(tok, r, args.prompts, args.prompt_tokens)  # new ones: no cache helps
            results[mode].append(asyncio.run(one_round(api[mode], prompts, order, args.tokens, args.rate, block)))
            row = results[mode][-1]
            print(f"# round {r + 1} ({mode}): hit rate {row['hit_rate']:.3f}, cached {row['cached_share']:.3f}, "
                  f"TTFT p50 {row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.3f} s, {row['tok_per_s']:.1f} tok/s, "
                  f"workers {row['per_worker']}", file=sys.stderr)
    rows = []
    for mode in ("aware", "blind"):
        runs = results[mode]
        rows.append({"mode": mode, **{key: round(statistics.median(x[key] for x in runs), 3)
                                      for key in ("hit_rate", "cached_share", "ttft_p50_s", "ttft_p99_s", "tok_per_s")},
                     "ttft_p50_by_round": " / ".join(f"{x['ttft_p50_s']:.2f}" for x in runs),
                     "per_worker": " / ".join(x["per_worker"] for x in runs)})
    aware, blind = rows
    rows.append({"mode": "aware / blind", **{key: round(aware[key] / blind[key], 2) if blind[key] else None
                                             for key in ("hit_rate", "cached_share", "ttft_p50_s", "ttft_p99_s",
                                                         "tok_per_s")}, "ttft_p50_by_round": "", "per_worker": ""})
    facts = machine("n/a" if args.backend == "null" else "auto", args.threads, workers=2)
    report = {"machine": facts, "args": vars(args), "rows": rows, "rounds": results}
    print(json.dumps(report, indent=1))
    print_table(list(rows[0]), [list(row.values()) for row in rows])
    print_machine(facts)


if __name__ == "__main__":
    main()
