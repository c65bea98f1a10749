"""How many SSE events per second one api replica relays, and how late they arrive.

    .venv/bin/python benchmarks/relay.py --streams 1000 --tokens 100 --rate 20

Starts its own redis-server, one worker on the null backend (no model: every running request
gets a token per tick, at --rate tokens/s, and each token's text is the time it was emitted)
and ONE api replica; then opens --streams native streaming requests at once from --clients
client processes (a bare asyncio HTTP client, lighter than httpx) and measures, per event, the
delay from the worker's emit to the client's read. Everything runs on this machine, so the
client, Redis and the worker share the CPUs with the replica under test. The replica's own CPU
time per relayed event (`api_cpu_us_per_event`, from /proc) compares two versions of the replica
even at an offered load it keeps up with, where events/s is set by the load and the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamq.stack import local_stack


async def _stream(host: str, port: int, body: bytes, out: list, counts: list, firsts: list) -> None:
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    writer.write(b"POST /v1/requests HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    is_token = False
    first = True
    while True:
        line = await reader.readline()
        if not line:
            break
        if line.startswith(b"event: token"):
            is_token = True
        elif line.startswith(b"event: final"):
            break
        elif is_token and line.startswith(b"data: "):
            now = time.time()
            text = json.loads(line[6:])["text"]
            out.append(now - float(text))
            counts.append(now)
            if first:
                firsts.append(now)
                first = False
            is_token = False
    writer.close()


def _client(port: int, streams: int, tokens: int, queue) -> None:
    body = json.dumps({"prompt": "relay", "max_tokens": tokens, "stream": True}).encode()
    lat: list[float] = []
    times: list[float] = []
    firsts: list[float] = []

    async def main():
        await asyncio.gather(*(_stream("127.0.0.1", port, body, lat, times, firsts) for _ in range(streams)))
    asyncio.run(main())
    queue.put((lat, times, firsts))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    parser.add_argument("--rate", type=float, default=20.0, help="tokens per second per stream")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    args = parser.parse_args()

    settings = {"STREAMQ_BACKEND": "null", "STREAMQ_NULL_TOKENS_PER_S": str(args.rate),
                "STREAMQ_BATCH_SIZE": str(min(1024, args.streams)),
                "STREAMQ_MAX_NUM_BATCHED_TOKENS": str(max(1024, args.streams))}
    pids: dict[str, int] = {}
    with local_stack("relay", settings, timeout_s=120, pids_out=pids) as url:
        port = int(url.rsplit(":", 1)[1])
        api_cpu = _cpu_s(pids["api"])
        queue: mp.Queue = mp.Queue()
        per = [args.streams // args.clients + (i < args.streams % args.clients) for i in range(args.clients)]
        start = time.time()
        clients = [mp.Process(target=_client, args=(port, n, args.tokens, queue)) for n in per]
        for c in clients:
            c.start()
        latencies, times, firsts = [], [], []
        for _ in clients:
            lat, ts, fs = queue.get()
            latencies += lat
            times += ts
            firsts += fs
        for c in clients:
            c.join()
        end = max(times)
        api_cpu = _cpu_s(pids["api"]) - api_cpu
        # Steady state: events emitted once every stream had started (the ramp of opening
        # 1,000 streams at once is reported separately, in the totals).
        all_open = max(firsts)
        steady = sorted(lat for lat, t in zip(latencies, times) if t - lat >= all_open)
        steady_end = max(t for lat, t in zip(latencies, times) if t - lat >= all_open) if steady else end
        latencies.sort()
        expected = args.streams * args.tokens
        report = {
            "streams": args.streams, "tokens_per_stream": args.tokens, "rate_per_stream": args.rate,
            "events_expected": expected, "events_received": len(latencies),
            "offered_events_per_s": args.streams * args.rate,
            "events_per_s": round(len(latencies) / (end - start), 1),
            "latency_ms": {"p50": round(1000 * latencies[len(latencies) // 2], 1),
                           "p99": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 1),
                           "max": round(1000 * latencies[-1], 1),
                           "mean": round(1000 * statistics.fmean(latencies), 1)},
            "wall_s": round(end - start, 2),
            "api_cpu_us_per_event": round(1e6 * api_cpu / max(1, len(latencies)), 1),
            "all_streams_open_after_s": round(all_open - start, 2),
            "steady": {"events": len(steady),
                       "events_per_s": round(len(steady) / max(1e-9, steady_end - all_open), 1),
                       "latency_ms": {"p50": round(1000 * steady[len(steady) // 2], 1) if steady else None,
                                      "p99": round(1000 * steady[int(0.99 * (len(steady) - 1))], 1) if steady else None}},
        }
        print(json.dumps(report, indent=1))

if __name__ == "__main__":
    main()
