"""What one generated token and one request cost Redis, and what one Redis here can carry.

    .venv/bin/python benchmarks/redis_cost.py [--requests 64] [--tokens 100] [--clients 16]

1. A private Redis, one null-backend worker and one api replica. `--requests` requests of
   `--tokens` tokens each, followed by SSE clients (`--clients` at a time) as real ones would
   be. Redis's own counters (INFO commandstats, INFO stats) are read before and after: the
   commands and the bytes in and out, per request and per generated token, by command.
   Redis's main-thread CPU time over the workload gives its cost per token, and so the tokens/s
   one Redis (one shard, one core) carries.
2. redis-benchmark against the same server: the ops/s of the two commands each token costs
   (XADD and SPUBLISH, pipelined as the worker sends them), without subscribers: an upper bound.

The figures feed docs/scaling.md. The api and the worker share the machine's cores with Redis,
as they would not in production; the commands and bytes per token do not depend on that.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamq.stack import local_stack
from benchmarks.report import cpu_flags, cpu_model, print_table


def counters(client: redis.Redis) -> dict[str, float]:
    """Calls per command, and the bytes in and out, as Redis counts them."""
    out = {f"cmd:{name.removeprefix('cmdstat_')}": float(stats["calls"])
           for name, stats in client.info("commandstats").items()}
    stats = client.info("stats")
    out["bytes_in"], out["bytes_out"] = float(stats["total_net_input_bytes"]), float(stats["total_net_output_bytes"])
    cpu = client.info("cpu")  # Redis's main thread: the one that runs every command
    out["cpu_s"] = float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])
    return out


async def workload(url: str, requests: int, tokens: int, clients: int) -> int:
    """Submit every request, follow each over SSE to its end (`clients` at a time); the tokens read."""
    gate = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i: int) -> int:
            async with gate:
                reply = await client.post(f"{url}/v1/requests", json={"prompt": f"request {i}", "max_tokens": tokens,
                                                                        "ignore_eos": True})
                rid, seen = reply.json()["id"], 0
                async with client.stream("GET", f"{url}/v1/requests/{rid}/events") as events:
                    async for line in events.aiter_lines():
                        seen += line.startswith("event: token")
                        if line.startswith("event: final"):
                            break
                return seen
        return sum(await asyncio.gather(*[one(i) for i in range(requests)]))


def redis_benchmark(port: int, pipeline: int, requests: int = 200_000) -> dict[str, float]:
    """ops/s of the per-token commands, from redis-benchmark (its own client, `pipeline` deep)."""
    commands = {"XADD": ["XADD", "bench:{r}:events", "MAXLEN", "~", "1000", "*", "e", "x" * 80],
                "SPUBLISH": ["SPUBLISH", "bench:{r}:channel", "x" * 80]}
    out = {}
    for name, args in commands.items():
        run = subprocess.run(["redis-benchmark", "-p", str(port), "-n", str(requests), "-P", str(pipeline), "-c", "8",
                              "-q", *args], capture_output=True, text=True, check=True)
        found = re.findall(r"([\d.]+) requests per second", run.stdout)
        out[name] = float(found[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--pipeline", type=int, default=32, help="redis-benchmark's pipeline depth")
    args = parser.parse_args()
    env: dict[str, str] = {}
    settings = {"STREAMQ_BACKEND": "null", "STREAMQ_NULL_TOKENS_PER_S": "200", "STREAMQ_BATCH_SIZE": "64",
                "STREAMQ_PREFIX": "cost"}
    with local_stack("redis-cost", settings, env_out=env) as url:
        client = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
        asyncio.run(workload(url, 2, 2, 2))  # warm-up: lanes, groups, connections
        before, kept_before = counters(client), client.info("memory")["used_memory_dataset"]
        started = time.perf_counter()
        seen = asyncio.run(workload(url, args.requests, args.tokens, args.clients))
        wall = time.perf_counter() - started
        after, kept = counters(client), client.info("memory")["used_memory_dataset"] - kept_before
        port = int(env["REDIS_URL"].rsplit(":", 1)[1].split("/")[0])
        bench = redis_benchmark(port, args.pipeline)
    generated = args.requests * args.tokens
    assert seen == generated, f"the clients read {seen} of {generated} tokens"
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    commands = {k.removeprefix("cmd:"): v for k, v in delta.items() if k.startswith("cmd:") and v > 0}
    rows = [[name, int(calls), round(calls / generated, 3), round(calls / args.requests, 2)]
            for name, calls in sorted(commands.items(), key=lambda item: -item[1])]
    total = sum(commands.values())
    rows.append(["all", int(total), round(total / generated, 3), round(total / args.requests, 2)])
    per_token = {"commands": total / generated, "bytes_in": delta["bytes_in"] / generated,
                 "bytes_out": delta["bytes_out"] / generated, "redis_cpu_us": 1e6 * delta["cpu_s"] / generated,
                 # What the finished requests keep in Redis (records, token logs, queue entries) until
                 # their results expire (RESULT_TTL_S): docs/deployment.md's sizing of Redis.
                 "bytes_kept": kept / generated}
    # What one shard carries, two ways: from Redis's own CPU time per token in the workload (every
    # command, the subscribers' deliveries and the requests' own costs included; one core), and
    # from redis-benchmark's rate of the two per-token commands alone (no subscriber: an upper bound).
    shard_tokens = {"from the workload's Redis CPU": generated / delta["cpu_s"],
                    "from redis-benchmark (XADD + SPUBLISH)": 1 / sum(1 / bench[name] for name in bench)}
    report = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "args": vars(args), "wall_s": wall, "commands": commands,
              "bytes_kept_per_request": kept / args.requests,
              "per_token": per_token, "bytes": {k: delta[k] for k in ("bytes_in", "bytes_out")},
              "redis_benchmark_ops_per_s": bench, "tokens_per_s_one_shard": shard_tokens}
    print(json.dumps(report, indent=1))
    print_table(["command", "calls", "per token", "per request"], rows)
    print_table(["per token", "value"], [[k, round(v, 2)] for k, v in per_token.items()])
    print_table(["redis-benchmark", "ops/s"], [[k, round(v)] for k, v in bench.items()])
    print_table(["tokens/s one shard carries", "value"], [[k, round(v)] for k, v in shard_tokens.items()])
    print(f"\nMachine: {cpu_model()} (flags: {' '.join(cpu_flags())})")


if __name__ == "__main__":
    main()
