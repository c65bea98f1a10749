"""The shared KV tier against the same stack without it, on the default model, in ONE run.

    .venv/bin/python benchmarks/kv_tier.py [--rounds 3] [--history 1500] [--streams 16]

Three stacks, each with its own Redis, started once: ON (2 workers, the tier on: the default),
OFF (2 workers, STREAMQ_KV_TIER=false) and REF (1 worker, no tier and no prefix cache: every
request computed from scratch, undisturbed, for the reference texts). The api routes without
prefix affinity, so where a request runs is decided by which worker is held (SIGSTOP) meanwhile.
Each round, in turns:

- turn 2 of a chat whose history is about `--history` tokens (its own words each round and
  mode): turn 1 runs on a worker, then turn 2 runs on the OTHER worker (the first held) with the
  tier (ON), without it (OFF: recomputed), or on the SAME worker without the tier (OFF, the other
  held: what prefix-aware routing gives at best). TTFT = the record's accepted → first token.
- a takeover: a stream with a prompt of `--history` tokens, its worker SIGKILLed at its 8th
  token; the other worker (at its heartbeat, every 0.25 s) or the scheduler (every 1 s) puts it
  back once the dead one's heartbeat expired (TTL 1 s), and the other worker continues. gap = kill → next token at the client; detect = kill → claimed again (the record's
  started_at); resume = claimed → next token: the continuation's prefill, which the tier cuts.
  Reused = the continuation's tokens taken from a cache. Its text is compared with REF's. A new
  worker replaces the dead one before the next round.
- W: `--streams` requests at once, each a prompt of its own (nothing to reuse), 48 tokens each;
  output tokens / wall time, ON and OFF.

Medians over the rounds, ON/OFF ratios next to the absolute figures, and the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, print_machine, print_table
from shared import redis_keys
from shared.request_record import RecordField
from streamq.stack import Stack

WORDS = ("the service keeps every request in order and answers with care while the model reads a long "
         "instruction about tone format safety sources dates names numbers tables lists code errors users "
         "tenants billing support refunds orders shipping accounts privacy logs metrics alerts deploys").split()
FAILOVER = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1", "STREAMQ_RECLAIM_INTERVAL_S": "1"}
KILL_AT = 8
TAKEOVER_TOKENS = 48


def tier_stack(name: str, settings: dict[str, str], workers: int) -> Stack:
    """A private Redis, `workers` workers, the scheduler and one api replica routing without prefix
    affinity, with the quick failover above; entered, it waits until every worker is live."""
    return Stack(Path(tempfile.mkdtemp(prefix=f"streamq-kvtier-{name}-")),
                 {"STREAMQ_PREFIX_AFFINITY": "false", **FAILOVER, **settings}, workers=workers, scheduler=True,
                 name=name, options=["--log-level", "warning"], ready_timeout_s=300)


def other(stack: Stack, name: str) -> str:
    """The other worker of a two-worker stack."""
    return next(w for w in stack.slots if w != name)


def words(seed: str, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def history(seed: str, tokens: int) -> str:
    return f"Conversation {seed}. " + words(seed, int(tokens * 0.95))  # about one token a word here


def record(client: httpx.Client, url: str, rid: str) -> dict:
    return client.get(f"{url}/v1/requests/{rid}").json()


def run(client: httpx.Client, url: str, body: dict) -> dict:
    """Submit a request, wait for its end; its record."""
    rid = client.post(f"{url}/v1/requests", json=body).json()["id"]
    while (rec := client.get(f"{url}/v1/requests/{rid}?wait=30").json())["status"] in ("queued", "running"):
        pass
    return rec


def turn2(client: httpx.Client, stack: Stack, seed: str, tokens: int, same_worker: bool) -> tuple[float, int]:
    """TTFT (s) of turn 2 and its tokens taken from a cache, turn 1 on one worker and turn 2 on the
    other (or the same)."""
    first = history(seed, tokens)
    one = run(client, stack.url, {"prompt": first, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    held = other(stack, one["worker"]) if same_worker else one["worker"]
    stack.pause_worker(held)
    try:
        two = run(client, stack.url, {"prompt": first + one["text"] + " And then?", "max_tokens": 8,
                                      "temperature": 0, "ignore_eos": True})
    finally:
        stack.resume_worker(held)
    assert (two["worker"] == one["worker"]) == same_worker, (one["worker"], two["worker"])
    return two["timings"]["ttft_s"], _reused(stack, two["id"])


def _reused(stack: Stack, rid: str) -> int:
    with stack.redis() as client:
        value = client.hget(redis_keys.request_record(stack.prefix, rid), RecordField.REUSED_TOKENS)
    return int(value or 0)


def takeover(client: httpx.Client, stack: Stack, prompt: str) -> dict:
    """Kill the worker of a stream at its KILL_AT-th token; the gap, its parts, and the tokens."""
    body = {"prompt": prompt, "max_tokens": TAKEOVER_TOKENS, "temperature": 0, "ignore_eos": True}
    rid = client.post(f"{stack.url}/v1/requests", json=body).json()["id"]
    tokens, arrivals, killed = [], [], None
    with client.stream("GET", f"{stack.url}/v1/requests/{rid}/events") as events:
        name = None
        for line in events.iter_lines():
            if line.startswith("event: final"):
                break
            if line.startswith("data: ") and '"token_id"' in line:
                tokens.append(json.loads(line[6:])["token_id"])
                arrivals.append(time.time())
                if len(tokens) == KILL_AT and killed is None:
                    name = record(client, stack.url, rid)["worker"]
                    stack.kill_worker(name)
                    killed = time.time()
    after = next(t for t in arrivals if t > killed)
    rec = record(client, stack.url, rid)
    stack.replace_worker(name)
    stack.wait_workers(len(stack.slots), 300)
    claimed = rec["timings"]["created_at"] + rec["timings"]["queue_s"]  # the last claim's started_at
    return {"gap": after - killed, "detect": claimed - killed, "resume": after - claimed, "tokens": tokens,
            "reused": _reused(stack, rid), "worker": rec["worker"], "victim": name}


def throughput(client: httpx.Client, stack: Stack, seed: str, streams: int, tokens: int) -> float:
    bodies = [{"prompt": words(f"{seed}-{i}", 300), "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
              for i in range(streams)]
    began = time.monotonic()
    with ThreadPoolExecutor(streams) as pool:
        records = list(pool.map(lambda b: run(httpx.Client(timeout=600), stack.url, b), bodies))
    wall = time.monotonic() - began
    return sum(r["completion_tokens"] for r in records) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--history", type=int, default=1500)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--w-tokens", type=int, default=48, help="output tokens of each W request")
    parser.add_argument("--parts", nargs="+", default=["turn2", "takeover", "w"], choices=["turn2", "takeover", "w"])
    args = parser.parse_args()
    settings = {"STREAMQ_MODEL_CACHE_DIR": os.environ.get("STREAMQ_MODEL_CACHE_DIR", "")}
    settings = {k: v for k, v in settings.items() if v}
    stacks: dict[str, Stack] = {}
    plan = {"on": (settings, 2), "off": ({**settings, "STREAMQ_KV_TIER": "false"}, 2),
            "ref": ({**settings, "STREAMQ_KV_TIER": "false", "STREAMQ_PREFIX_CACHING": "false"}, 1)}
    ttft: dict[str, list[float]] = {"tier, other worker": [], "recompute, other worker": [],
                                    "local cache, same worker": []}
    reused: dict[str, list[int]] = {k: [] for k in ttft}
    takeovers: dict[str, list[dict]] = {"on": [], "off": []}
    exact = {"on": 0, "off": 0}
    w: dict[str, list[float]] = {"on": [], "off": []}
    with ExitStack() as running:
        for name, (extra, count) in plan.items():
            if name != "ref" or "takeover" in args.parts:
                stacks[name] = running.enter_context(tier_stack(name, extra, count))
                stacks[name].wait_workers(count, 300)
        with httpx.Client(timeout=600) as client:
            for r in range(args.rounds):
                modes = [("tier, other worker", "on", False), ("recompute, other worker", "off", False),
                         ("local cache, same worker", "off", True)]
                for label, name, same in (modes if r % 2 == 0 else modes[::-1]) if "turn2" in args.parts else ():
                    seconds, hits = turn2(client, stacks[name], f"{r}-{label}", args.history, same)
                    ttft[label].append(seconds)
                    reused[label].append(hits)
                if "takeover" in args.parts:
                    _takeovers(client, stacks, r, args.history, takeovers, exact)
                for name in (["on", "off"] if r % 2 == 0 else ["off", "on"]) if "w" in args.parts else ():
                    w[name].append(throughput(client, stacks[name], f"w-{r}-{name}", args.streams, args.w_tokens))
                print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in ttft.items() if v)
                      + "; " + ", ".join(f"takeover {k} gap {v[-1]['gap']:.2f} s resume {v[-1]['resume']:.2f} s"
                                         for k, v in takeovers.items() if v)
                      + "; " + ", ".join(f"W {k} {v[-1]:.1f} tok/s" for k, v in w.items() if v), flush=True)
    report(args, ttft, reused, takeovers, exact, w)


def _takeovers(client: httpx.Client, stacks: dict, r: int, tokens: int, takeovers: dict, exact: dict) -> None:
    """One takeover on each of ON and OFF (in turns), and REF's undisturbed text of the same prompt."""
    prompt = history(f"takeover-{r}", tokens)
    reference = run(client, stacks["ref"].url, {"prompt": prompt, "max_tokens": TAKEOVER_TOKENS,
                                                "temperature": 0, "ignore_eos": True})
    ref_ids = _token_ids(client, stacks["ref"].url, reference["id"])
    for name in (["on", "off"] if r % 2 == 0 else ["off", "on"]):
        result = takeover(client, stacks[name], prompt)
        takeovers[name].append(result)
        exact[name] += result["tokens"] == ref_ids


def report(args, ttft: dict, reused: dict, takeovers: dict, exact: dict, w: dict) -> None:
    med = statistics.median
    if "turn2" in args.parts:
        base = med(ttft["recompute, other worker"])
        print(f"\nTurn 2 of a chat, {args.history}-token history ({args.rounds} rounds, medians):\n")
        print_table(["turn 2", "TTFT p50 (s)", "each round (s)", "reused tokens", "vs recompute"],
                    [[k, f"{med(v):.3f}", " ".join(f"{x:.3f}" for x in v), int(med(reused[k])),
                      f"{med(v) / base:.2f}x"] for k, v in ttft.items()])
    if "takeover" in args.parts:
        print(f"\nTakeover after kill -9 at token {KILL_AT}, {args.history}-token prompt:\n")
        rows = []
        for name in ("on", "off"):
            runs = takeovers[name]
            rows.append([f"tier {name}", *(f"{med([t[k] for t in runs]):.2f}" for k in ("gap", "detect", "resume")),
                         " ".join(f"{t['gap']:.2f}" for t in runs), int(med([t["reused"] for t in runs])),
                         f"{exact[name]}/{len(runs)}"])
        print_table(["", "gap (s)", "detect (s)", "resume (s)", "each gap (s)", "reused tokens", "text = undisturbed"],
                    rows)
        ratio = {k: med([t[k] for t in takeovers["on"]]) / med([t[k] for t in takeovers["off"]])
                 for k in ("gap", "resume")}
        print(f"\non/off: gap {ratio['gap']:.2f}x, resume {ratio['resume']:.2f}x")
    if "w" in args.parts:
        print(f"\nW, {args.streams} streams of their own prompts, {args.w_tokens} tokens each (nothing to reuse):\n")
        print_table(["tier", "tok/s p50", "each round"],
                    [[k, f"{med(v):.1f}", " ".join(f"{x:.1f}" for x in v)] for k, v in w.items()])
        rounds = [on / off for on, off in zip(w["on"], w["off"])]
        print(f"\non/off: {med(w['on']) / med(w['off']):.3f}x (medians); each round's ratio "
              f"{' '.join(f'{x:.2f}' for x in rounds)}, median {med(rounds):.3f}x")
    print_machine(machine("auto (the workers')", len(os.sched_getaffinity(0)), model="default (as served)"))


def _token_ids(client: httpx.Client, url: str, rid: str) -> list[int]:
    events = client.get(f"{url}/v1/requests/{rid}/events")
    return [json.loads(line[6:])["token_id"] for line in events.text.splitlines()
            if line.startswith("data: ") and '"token_id"' in line]


if __name__ == "__main__":
    main()
