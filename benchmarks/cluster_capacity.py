"""The null backend through 2 api replicas and 4 workers: a 3-master Redis Cluster against one Redis.

    .venv/bin/python benchmarks/cluster_capacity.py [--rounds 3] [--requests 1152] [--concurrency 192] [--rate 40]

Each round starts each setup afresh, one after the other (single, cluster, single, cluster...):
a private redis-server, or a 3-master cluster without replicas (streamq/testing/redis_cluster.py); then
4 null-backend workers (batch 64, --rate tokens/s a request) and 2 api replicas, all given the
same REDIS_URL. --clients load processes (async httpx) submit --requests requests of --tokens
tokens over both replicas and follow each over SSE to its end, --concurrency at a time (the first
ones spread over one request's length, so streams start and end out of phase). Measured at the
clients: token events/s delivered while every stream is in flight (offered: concurrency x rate),
TTFT, the gap between a stream's consecutive tokens (nominal 1/rate) and the delivery delay (the
null backend's tokens carry their emit time).
Measured on each Redis master before and after (INFO commandstats, INFO cpu): commands/s and
main-thread CPU, to show the load spreading; and the CPU the workers and apis spent per token.

Redis, the workers, the apis and the load generator share this machine's cores, so this measures
what the cluster adds on the path, not its scale-out: in production each shard has its own core.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.redis_cost import counters
from benchmarks.report import cores, cpu_flags, cpu_model, print_table
from shared.redis_server import RedisServer
from streamq.stack import Stack
from streamq.testing.redis_cluster import RedisCluster

SETUPS = ("single", "cluster")


@contextmanager
def redis_setup(kind: str, folder: Path) -> Iterator[tuple[str, list[int]]]:
    """Yield the URL every process takes and the masters' ports."""
    server = RedisServer(folder / "redis") if kind == "single" else RedisCluster(folder / "cluster", masters=3)
    try:
        url = server.start()
        yield url, [node.port for node in getattr(server, "nodes", [server])]
    finally:
        server.stop()


@dataclass
class Load:
    """What one load process sends: requests `ids` (request i to replica (i // 2) % len(urls)),
    `concurrency` at a time. The first wave starts `stagger_s` apart, so that streams run out of
    phase as in steady traffic, not in waves that end and start together."""
    urls: list[str]
    ids: list[int]
    tokens: int
    concurrency: int
    stagger_s: float = 0.0
    deadline_s: float = 60.0  # a stream not ended by then is an error (a lost event), not a hang


async def _load(load: Load) -> dict:
    """Submit each request, follow it over SSE to its end; the time of every token event."""
    gate = asyncio.Semaphore(load.concurrency)
    out: dict = {"ttft": [], "gap": [], "delivery": [], "arrivals": [], "ended": 0, "start": time.time()}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one(n: int, i: int) -> None:
            url = load.urls[(i // 2) % len(load.urls)]
            async with gate:
                if n < load.concurrency:
                    await asyncio.sleep(i * load.stagger_s)
                sent = time.time()
                reply = await client.post(f"{url}/v1/requests", json={"prompt": f"request {i}",
                                                                       "max_tokens": load.tokens, "ignore_eos": True})
                reply.raise_for_status()
                last, token = None, False
                async with client.stream("GET", f"{url}/v1/requests/{reply.json()['id']}/events") as events:
                    async for line in events.aiter_lines():
                        if line.startswith("event: "):
                            token = line == "event: token"
                            if line == "event: final":
                                break
                        elif token and line.startswith("data: "):
                            now = time.time()
                            out["delivery"].append(now - float(json.loads(line[6:])["text"]))
                            out["ttft" if last is None else "gap"].append(now - (sent if last is None else last))
                            out["arrivals"].append(now)
                            last = now
                out["ended"] += 1
        try:
            await asyncio.wait_for(asyncio.gather(*(one(n, i) for n, i in enumerate(load.ids))), load.deadline_s)
        except TimeoutError:
            left = f"{len(load.ids) - out['ended']} of {len(load.ids)}"
            raise RuntimeError(f"{left} streams had not ended after {load.deadline_s:.0f} s") from None
    out["end"] = time.time()
    return out


def _client(load: Load, queue) -> None:
    cpu = time.process_time()
    try:
        out = asyncio.run(_load(load))
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        queue.put({"error": f"{type(exc).__name__}: {exc}"})
        return
    queue.put({**out, "cpu_s": time.process_time() - cpu})


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def run_round(kind: str, args: argparse.Namespace) -> dict:
    folder = Path(tempfile.mkdtemp(prefix=f"streamq-capacity-{kind}-"))
    settings = {"STREAMQ_BACKEND": "null", "STREAMQ_NULL_TOKENS_PER_S": str(args.rate),
                "STREAMQ_BATCH_SIZE": str(args.batch_size), "STREAMQ_PREFIX": "cap"}
    with redis_setup(kind, folder) as (url, ports), Stack(
            folder, settings, redis_url=url, workers=args.workers, replicas=args.replicas, name="cap",
            options=["--log-level", "warning"]) as stack:
        stack.wait_workers(args.workers, 60)  # every replica sees every worker
        urls = stack.urls
        pids = {"worker": [w.process.pid for w in stack.workers.values()], "api": [a.process.pid for a in stack.apis]}
        asyncio.run(_load(Load(urls, list(range(8)), 4, 8)))  # warm-up: lanes, groups, pub/sub connections
        nodes = [redis.Redis(port=p, decode_responses=True) for p in ports]
        before = [counters(n) for n in nodes]
        cpu_before = {role: sum(map(_cpu_s, ps)) for role, ps in pids.items()}
        queue: mp.Queue = mp.Queue()
        length = args.tokens / args.rate  # one request's seconds
        deadline = 60 + 3 * (args.requests / args.concurrency + 1) * length
        clients = [mp.Process(target=_client, args=(Load(urls, list(range(c, args.requests, args.clients)), args.tokens,
                                                         args.concurrency // args.clients, length / args.concurrency,
                                                         deadline), queue)) for c in range(args.clients)]
        for c in clients:
            c.start()
        parts = [queue.get(timeout=deadline + 60) for _ in clients]
        for c in clients:
            c.join()
        if errors := [p["error"] for p in parts if "error" in p]:
            raise SystemExit(f"{kind}: {'; '.join(errors)}; logs in {folder}")
        cpu = {role: sum(map(_cpu_s, ps)) - cpu_before[role] for role, ps in pids.items()}
        after = [counters(n) for n in nodes]
        for n in nodes:
            n.close()
    shutil.rmtree(folder, ignore_errors=True)  # the processes' logs: kept only when a round fails
    arrivals = [t for p in parts for t in p["arrivals"]]
    events = len(arrivals)
    assert events == args.requests * args.tokens, f"the clients read {events} of {args.requests * args.tokens} tokens"
    start, end = min(p["start"] for p in parts), max(p["end"] for p in parts)
    wall = end - start
    # Steady: from the last first-wave start to the first end of the drain, every stream in flight.
    steady = (start + length, end - length)
    steady_events = sum(steady[0] <= t < steady[1] for t in arrivals)
    per_node = []
    for port, b, a in zip(ports, before, after):
        calls, cpu_s = sum(a[k] - b.get(k, 0) for k in a if k.startswith("cmd:")), a["cpu_s"] - b["cpu_s"]
        per_node.append({"port": port, "commands_per_s": calls / wall, "cpu_pct": 100 * cpu_s / wall, "cpu_s": cpu_s})
    merged = {k: [x for p in parts for x in p[k]] for k in ("ttft", "gap", "delivery")}
    return {"setup": kind, "events": events, "wall_s": wall, "events_per_s_all": events / wall,
            "events_per_s": steady_events / (steady[1] - steady[0]),
            "ttft_p50_s": pct(merged["ttft"], 0.5), "ttft_p99_s": pct(merged["ttft"], 0.99),
            "gap_p50_s": pct(merged["gap"], 0.5), "gap_p99_s": pct(merged["gap"], 0.99),
            "delivery_p50_s": pct(merged["delivery"], 0.5), "delivery_p99_s": pct(merged["delivery"], 0.99),
            "redis_us_per_token": 1e6 * sum(n["cpu_s"] for n in per_node) / events,
            "worker_us_per_token": 1e6 * cpu["worker"] / events, "api_us_per_token": 1e6 * cpu["api"] / events,
            "client_us_per_token": 1e6 * sum(p["cpu_s"] for p in parts) / events, "nodes": per_node}


def _row(r: dict) -> list[object]:
    nodes = " / ".join(f"{n['commands_per_s'] / 1000:.1f}k, {n['cpu_pct']:.0f} %" for n in r["nodes"])
    return [r["setup"], f"{r['events_per_s']:,.0f}", f"{1000 * r['ttft_p50_s']:.0f} / {1000 * r['ttft_p99_s']:.0f}",
            f"{1000 * r['gap_p50_s']:.1f} / {1000 * r['gap_p99_s']:.1f}",
            f"{1000 * r['delivery_p50_s']:.1f} / {1000 * r['delivery_p99_s']:.1f}",
            f"{r['redis_us_per_token']:.1f}", f"{r['worker_us_per_token']:.1f}", f"{r['api_us_per_token']:.1f}", nodes]


HEADERS = ["setup", "events/s", "TTFT p50 / p99 ms", "gap p50 / p99 ms", "delivery p50 / p99 ms",
           "Redis µs/token", "workers µs/token", "apis µs/token", "per master: commands/s, CPU"]
MEDIANS = ("events_per_s", "ttft_p50_s", "ttft_p99_s", "gap_p50_s", "gap_p99_s", "delivery_p50_s", "delivery_p99_s",
           "redis_us_per_token", "worker_us_per_token", "api_us_per_token", "client_us_per_token")


def median_of(rounds: list[dict], kind: str) -> dict:
    mine = [r for r in rounds if r["setup"] == kind]
    out = {k: statistics.median(r[k] for r in mine) for k in MEDIANS}
    out["nodes"] = [{k: statistics.median(r["nodes"][i][k] for r in mine) for k in ("commands_per_s", "cpu_pct")}
                    for i in range(len(mine[0]["nodes"]))]
    return {"setup": f"{kind} (median)", **out}


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each setup, interleaved")
    parser.add_argument("--requests", type=int, default=1152)
    parser.add_argument("--tokens", type=int, default=100, help="tokens a request")
    parser.add_argument("--concurrency", type=int, default=192, help="requests in flight at once, over all clients")
    parser.add_argument("--rate", type=float, default=40.0, help="tokens/s a request (the null backend's)")
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2, help="api replicas")
    parser.add_argument("--batch-size", type=int, default=64, help="each worker's slots")
    parser.add_argument("--setups", default=",".join(SETUPS), help="which setups, in each round's order")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _stop)  # tear the stacks down on a kill too
    rounds = []
    for i in range(args.rounds):
        for kind in args.setups.split(","):
            rounds.append(run_round(kind, args))
            print(f"round {i + 1} {kind}: {json.dumps(_row(rounds[-1]), ensure_ascii=False)}", flush=True)
    medians = {kind: median_of(rounds, kind) for kind in SETUPS}
    ratios = {k: medians["cluster"][k] / medians["single"][k] for k in MEDIANS}
    offered = min(args.concurrency, args.workers * args.batch_size) * args.rate
    machine = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": len(cores())}
    print(json.dumps({"machine": machine, "args": vars(args), "offered_events_per_s": offered, "rounds": rounds,
                      "medians": medians, "cluster_over_single": ratios}, indent=1))
    print_table(HEADERS, [_row(r) for r in rounds] + [_row(medians[k]) for k in SETUPS])
    print_table(["cluster / single", "ratio"], [[k, f"{v:.2f}"] for k, v in ratios.items()])
    print(f"\nOffered: {offered:,.0f} token events/s ({args.concurrency} streams at {args.rate:g} tokens/s; "
          f"nominal gap {1000 / args.rate:.1f} ms). Machine: {machine['cpu']}, {machine['cores']} cores "
          f"(flags: {' '.join(machine['cpu_flags'])}). Redis, the workers, the apis and the load generator share "
          "these cores: this measures what the cluster adds on the path, not its scale-out.")


if __name__ == "__main__":
    main()
