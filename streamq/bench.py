"""`streamq bench`: load a running streamq (or any OpenAI-compatible server) and measure it,
in the manner of `vllm bench serve`.

Each request streams; the client notes when every token (or text chunk) arrives. Requests arrive
all at once, or at `--request-rate` per second with gamma-distributed gaps (`--burstiness` 1:
a Poisson process; below 1 burstier, above 1 more even), as vllm bench serve sends them. At
the end it prints request throughput, output tokens/s, TTFT, TPOT, ITL and end-to-end latency
(mean, p50, p90, p99), errors by kind and, with `--goodput ttft:MS tpot:MS e2el:MS`, goodput:
the requests per second that completed within every stated target (DistServe's measure, as vLLM
reports it); `--json FILE` keeps the raw numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ENDPOINTS = ("native", "openai-chat", "openai-completions", "seed-stream")
SLO_METRICS = ("ttft", "tpot", "e2el")  # the targets --goodput takes, in ms, as vllm bench serve names them
PERCENTILES = (0.5, 0.9, 0.99)
BUILTIN_PROMPTS = [
    "Explain how a bicycle works.", "Write a short poem about the sea.", "What is the capital of France?",
    "Describe a busy market in the morning.", "Give three facts about the Moon.", "How do bees make honey?",
    "What makes a good cup of tea?", "Tell me about the history of maps.",
]


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0  # as the server counted them (usage), where it says
    received_tokens: int = 0  # token events (native) or non-empty chunks received
    end: float = 0.0


def load_prompts(path: str | None, count: int) -> list:
    if path:
        data = json.loads(Path(path).read_text())
        items = data["messages"] if isinstance(data, dict) and "messages" in data else data
    else:
        items = BUILTIN_PROMPTS
    return [items[i % len(items)] for i in range(count)]


def _as_text(item) -> str:
    if isinstance(item, str):
        return item
    return "\n".join(m["content"] for m in item)


def _as_messages(item) -> list[dict]:
    return item if isinstance(item, list) else [{"role": "user", "content": item}]


def _request(endpoint: str, item, args) -> tuple[str, dict]:
    common = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.ignore_eos:
        common["ignore_eos"] = True
    if endpoint == "native":
        return "/v1/requests", {"messages": _as_messages(item), "stream": True, **common}
    if endpoint == "openai-chat":
        return "/v1/chat/completions", {"model": args.model, "messages": _as_messages(item), "stream": True,
                                        "stream_options": {"include_usage": True}, **common}
    if endpoint == "openai-completions":
        return "/v1/completions", {"model": args.model, "prompt": _as_text(item), "stream": True,
                                   "stream_options": {"include_usage": True}, **common}
    return "/generate_stream", {"prompt": _as_text(item)}


async def one(client: httpx.AsyncClient, endpoint: str, item, args) -> Result:
    path, body = _request(endpoint, item, args)
    r = Result(start=time.perf_counter())
    event = None
    try:
        async with client.stream("POST", args.url.rstrip("/") + path, json=body) as reply:
            if reply.status_code != 200:
                r.error = f"http {reply.status_code}"
                await reply.aread()
                return r
            async for line in reply.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                    continue
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                now = time.perf_counter()
                if endpoint == "native":
                    if event == "token":
                        r.received_tokens += 1
                        r.token_times.append(now)
                    elif event == "final":
                        r.output_tokens = payload["usage"]["completion_tokens"]
                        if payload.get("error"):
                            r.error = "generation error"
                        break
                elif endpoint == "seed-stream":
                    r.received_tokens += 1
                    r.token_times.append(now)
                else:
                    if payload.get("usage"):
                        r.output_tokens = payload["usage"]["completion_tokens"]
                    for choice in payload.get("choices", []):
                        piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        if piece:
                            r.received_tokens += 1
                            r.token_times.append(now)
                event = None
        r.ok = r.error is None
        if endpoint == "seed-stream":
            r.output_tokens = r.received_tokens
    except httpx.HTTPError as exc:
        r.error = type(exc).__name__
    finally:
        r.end = time.perf_counter()
    return r


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    names = [f"p{round(100 * q)}" for q in PERCENTILES]
    if not values:
        return {"mean": None, **dict.fromkeys(names)}
    ordered = sorted(values)

    def pick(q: float) -> float:  # linear between the nearest ranks, as numpy's (and vllm bench serve's) percentile
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return round(scale * (ordered[low] + (ordered[high] - ordered[low]) * (position - low)), 2)
    return {"mean": round(scale * statistics.fmean(values), 2), **{n: pick(q) for n, q in zip(names, PERCENTILES)}}


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:150` -> {"ttft": 0.5, "tpot": 0.15} (seconds); a clear error for anything else."""
    slo: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_METRICS)}; got {spec!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is no number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {spec!r}: a target must be above 0 ms")
        slo[name] = ms / 1000
    return slo


def request_latencies(r: Result) -> dict[str, float | None]:
    """A completed request's TTFT, TPOT and end-to-end latency in seconds (None where it has none:
    no token seen, or one token only for TPOT)."""
    ttft = r.token_times[0] - r.start if r.token_times else None
    tpot = (r.end - r.token_times[0]) / (r.output_tokens - 1) if r.token_times and r.output_tokens > 1 else None
    return {"ttft": ttft, "tpot": tpot, "e2el": r.end - r.start}


def meets(r: Result, slo: dict[str, float]) -> bool:
    """Whether the request completed within every target of `slo` (one with no TPOT meets a TPOT target)."""
    if not r.ok:
        return False
    latency = request_latencies(r)
    for name, limit in slo.items():
        value = latency[name]
        if value is None and name == "tpot":
            continue
        if value is None or value > limit:
            return False
    return True


def arrival_gaps(rate: float, burstiness: float, count: int, seed: int) -> list[float]:
    """Seconds between one request and the next: gamma-distributed with shape `burstiness` and
    mean 1/rate (burstiness 1: exponential, a Poisson process); zeros for an infinite rate."""
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count)]


def summarise(results: list[Result], wall: float, slo: dict[str, float] | None = None) -> dict:
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    latencies = [request_latencies(r) for r in done]
    ttft, tpot, e2e = ([x[name] for x in latencies if x[name] is not None] for name in SLO_METRICS)
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    output = sum(r.output_tokens for r in done)
    goodput = {}
    if slo:
        good = sum(meets(r, slo) for r in results)
        goodput = {"goodput": {"slo_ms": {k: round(1000 * v, 3) for k, v in slo.items()}, "requests_met": good,
                               "requests_per_s": round(good / wall, 3)}}
    return {
        "completed": len(done), "failed": len(results) - len(done), "errors": errors, "duration_s": round(wall, 3),
        "request_throughput": round(len(done) / wall, 3), "output_tokens": output,
        "received_tokens": sum(r.received_tokens for r in done),
        "output_tokens_per_s": round(output / wall, 2),
        "ttft_ms": _stats(ttft), "tpot_ms": _stats(tpot), "itl_ms": _stats(itl), "e2e_ms": _stats(e2e),
        **goodput,
    }


async def run(args) -> dict:
    prompts = load_prompts(args.prompts, args.num_prompts)
    slo = parse_goodput(args.goodput or [])
    gaps = arrival_gaps(args.request_rate, args.burstiness, len(prompts), args.seed)
    limit = asyncio.Semaphore(args.concurrency or len(prompts))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request at INFO: noise in a load test
    done = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async def guarded(client, item):
        nonlocal done
        async with limit:
            result = await one(client, args.endpoint, item, args)
        done += 1
        if not args.quiet:
            bar = "#" * (30 * done // len(prompts))
            print(f"\r[{bar:<30}] {done}/{len(prompts)}", end="", file=sys.stderr, flush=True)
        return result

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, headers=headers) as client:
        start = time.perf_counter()
        tasks = []
        for item, gap in zip(prompts, gaps):
            tasks.append(asyncio.create_task(guarded(client, item)))
            if gap:
                await asyncio.sleep(gap)  # the arrival process, not synchronisation
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    if not args.quiet:
        print(file=sys.stderr)
    report = summarise(results, wall, slo)
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "quiet")}
    if args.json:
        raw = [{**asdict(r), "token_times": [t - r.start for t in r.token_times]} for r in results]
        Path(args.json).write_text(json.dumps({"summary": report, "requests": raw}, indent=1))
    return report


def print_report(report: dict) -> None:
    print(f"completed {report['completed']}  failed {report['failed']}  errors {report['errors'] or '{}'}")
    print(f"duration {report['duration_s']} s   request throughput {report['request_throughput']} req/s")
    print(f"output tokens {report['output_tokens']} (received {report['received_tokens']})   "
          f"output throughput {report['output_tokens_per_s']} tok/s")
    columns = ["mean"] + [f"p{round(100 * q)}" for q in PERCENTILES]
    print(f"{'ms':<6}" + "".join(f"{c:>10}" for c in columns))
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = report[f"{name}_ms"]
        print(f"{name.upper():<6}" + "".join(f"{s[c] if s[c] is not None else '-':>10}" for c in columns))
    if "goodput" in report:
        g = report["goodput"]
        targets = ", ".join(f"{k} <= {v:g} ms" for k, v in g["slo_ms"].items())
        print(f"goodput {g['requests_per_s']} req/s ({g['requests_met']} of {report['completed'] + report['failed']} "
              f"requests within {targets})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=os.environ.get("STREAMQ_API_KEY"),
                        help="sent as a Bearer token (a server with keys on needs one); default $STREAMQ_API_KEY")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="native")
    parser.add_argument("--model", default=None, help="model name for the OpenAI endpoints")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompts", help="JSON file: a list of prompts, or {'messages': [...]} like workload_w.json")
    parser.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: all)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, arriving at random (default: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="shape of the gamma-distributed gaps between arrivals: 1 a Poisson process, "
                             "below 1 burstier, above 1 more even")
    parser.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                        help=f"latency targets ({', '.join(SLO_METRICS)}) a request must meet to count as goodput, "
                             "e.g. ttft:1000 tpot:150")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="write the summary and every request's timings here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    if not args.burstiness > 0:
        raise SystemExit("--burstiness must be above 0")
    if not args.request_rate > 0:
        raise SystemExit("--request-rate must be above 0")
    try:
        parse_goodput(args.goodput or [])
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    report = asyncio.run(run(args))
    print_report(report)
    return 0 if report["failed"] == 0 else 1
