"""A hostile tenant against a victim, on one stack with keys on, in ONE run.

    .venv/bin/python benchmarks/abuse.py [--model PATH] [--seconds 20] [--streams 2] [--rounds 1] [--attacks 'NAME;...']

One stack (its own Redis, one worker, the scheduler, one api replica; the default model unless
--model) with two tenants: the victim, unlimited, and the attacker, limited to 60 requests a
minute, 2 at once and 20,000 tokens a minute, with at most 8 open streams. The victim runs a
steady chat load (`--streams` clients, each streaming one short chat after another), and each
attack in turn runs (in a process of its own) beside that load, right after the same load alone:

- rerank amplification: a rerank with a 2 KB query and 64 short documents (under the per-request
  token cap; the victim's key, as the attacker's tokens per minute refuse it), and the issue's 30 KB
  query with 256 documents (past the cap: 413); per body byte, the bytes written to Redis for it
  (MONITOR's write commands naming its request id) and the bytes Redis holds for its keys after,
  the victim not running;
- batch flood: a batch of 40 chats of 32 tokens each, run by the scheduler inside the attacker's limits;
- over-limit costly requests: 50 chats at once with a large JSON schema, n=4 and top_logprobs=20,
  the attacker already at its requests per minute; their 429 time, and /healthz's p99 meanwhile;
- stream flood: 40 streams opened at once (past the cap of 8: 429);
- flex flood against priority: another tenant keeps 40 flex chats of 64 tokens in flight (more
  than the batch holds), while the victim's chats ask for the priority tier; compared with the
  victim's priority chats alone (and, for scale, its flex chats beside it against its flex chats alone);
- mis-spelled ids: poll and SSE of a real id in upper case and padded (404, and how fast);
- cached tokens across tenants: the attacker sends the victim's last prompt; its cached_tokens.

Per attack (`--rounds` times over, alone then beside, each side's TTFTs pooled): the victim's TTFT
p50/p99 beside it, its p99 alone just before and the ratio,
/healthz p99 beside it, and the attack's own figure. Requests lost or answered twice: every victim request must end done with
its whole text once. The machine (lscpu model and flags) under the table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, print_machine, print_table
from streamq.stack import Stack

STREAM_CAP = 8


def keys(stack: Stack, tenant: str) -> str:
    return subprocess.run([sys.executable, "-m", "streamq.cli", "keys", "create", "--tenant", tenant], cwd=ROOT,
                          env=stack.env, capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def limit(stack: Stack, tenant: str, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "streamq.cli", "keys", "limits", "--tenant", tenant, *args], cwd=ROOT,
                   env=stack.env,
                   capture_output=True, text=True, check=True, timeout=60)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Victim:
    """`streams` clients streaming short chats one after another; TTFTs (s) and lost or doubled answers."""

    def __init__(self, url: str, key: str, streams: int):
        self.url, self.headers, self.streams = url, {"Authorization": f"Bearer {key}"}, streams
        self.tier: str | None = None  # the service_tier its chats ask for (None: the field left out)
        self.ttfts: list[float] = []
        self.bad = 0
        self.last_prompt = ""
        self._stop = threading.Event()

    def run(self, seconds: float) -> tuple[list[float], int]:
        self.ttfts, self.bad, self._stop = [], 0, threading.Event()
        threads = [threading.Thread(target=self._client, args=(i,)) for i in range(self.streams)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        self._stop.set()
        for t in threads:
            t.join()
        return self.ttfts, self.bad

    def _client(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                n += 1
                prompt = (f"Customer {i}-{n} of the support desk asks how to change the delivery address of an "
                          "order that has shipped already, and whether a refund is possible. Answer briefly.")
                self.last_prompt = prompt
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                if self.tier is not None:
                    body["service_tier"] = self.tier
                start, first, tokens, done = time.perf_counter(), None, 0, False
                with client.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                                   headers=self.headers) as reply:
                    if reply.status_code != 200:
                        self.bad += 1
                        continue
                    for line in reply.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            done = done or line == "data: [DONE]"
                            continue
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        if delta.get("content"):
                            tokens += 1
                            first = first or time.perf_counter()
                if first is None or not done:
                    self.bad += 1
                else:
                    self.ttfts.append(first - start)


class Prober:
    """/healthz every 20 ms while running: its latencies (s)."""

    def __init__(self, url: str):
        self.url = url
        self.times: list[float] = []
        self._stop = threading.Event()

    def __enter__(self) -> Prober:
        self.times, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._probe)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _probe(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                client.get(f"{self.url}/healthz")
                self.times.append(time.perf_counter() - start)
                time.sleep(0.02)


READS = {"GET", "HGET", "HMGET", "HGETALL", "XRANGE", "XREVRANGE", "XREAD", "XREADGROUP", "XLEN", "EXISTS", "TTL",
         "EVALSHA", "EVAL", "SPUBLISH", "PUBLISH", "SSUBSCRIBE", "SUNSUBSCRIBE", "SUBSCRIBE", "UNSUBSCRIBE"}


def _watch(monitor, commands: list[dict]) -> None:
    with contextlib.suppress(Exception):  # ends when the monitor's connection closes
        for command in monitor.listen():
            commands.append(command)


def rerank_bytes(stack: Stack, url: str, headers: dict, query_chars: int, documents: int) -> tuple[int, float, float]:
    """A rerank's status, and per body byte: the bytes written to Redis for it (MONITOR's view of
    every write command naming its request id, the scripts' own writes included: its record, queue
    entry, status changes, final event, expiries and ack; no script call, read or publish), and the
    bytes Redis holds for it after (MEMORY USAGE of the keys it made: its record and token log, and
    its lane's stream where the lane is new, with the stream's preallocation). The victim is not running."""
    body = {"query": ("where is my parcel " * (query_chars // 19 + 1))[:query_chars],
            "documents": [f"document {i} about parcels" for i in range(documents)]}
    size = len(json.dumps(body).encode())
    commands: list[dict] = []
    with stack.redis() as client, client.monitor() as monitor:
        watching = threading.Thread(target=_watch, args=(monitor, commands), daemon=True)
        watching.start()
        before = set(client.scan_iter(count=1000))
        reply = httpx.post(f"{url}/v1/rerank", json=body, headers=headers, timeout=600)
        made = set(client.scan_iter(count=1000)) - before
        held = sum(client.memory_usage(key) or 0 for key in made if ":kv:" not in key)
        client.ping()
    # The request's id: the one its queue entry (written by the submit script) carries.
    entry = next((c["command"] for c in commands if c["command"].startswith("XADD") and '"pool":' in c["command"]), "")
    rid = found.group(1) if (found := re.search(r'"id":"([^"]+)"', entry)) else None
    written = sum(len(c["command"]) for c in list(commands)
                  if rid and rid in c["command"] and c["command"].split(" ", 1)[0].upper() not in READS)
    return reply.status_code, written / size, held / size


def batch_flood(url: str, headers: dict) -> str:
    lines = [{"custom_id": f"b{i}", "body": {"messages": [{"role": "user", "content": f"Write item {i}."}],
                                              "max_tokens": 32, "ignore_eos": True}} for i in range(40)]
    reply = httpx.post(f"{url}/v1/batches", json={"endpoint": "/v1/chat/completions", "requests": lines},
                       headers=headers, timeout=120)
    return f"batch {reply.status_code}"


def costly_flood(url: str, headers: dict) -> str:
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 9 + 1}}}$"}
                                               for i in range(300)}}
    body = {"messages": [{"role": "user", "content": "x " * 2000}], "n": 4, "logprobs": True, "top_logprobs": 20,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    # At its requests per minute first: 60 light ones.
    with httpx.Client(timeout=60) as client:
        for _ in range(60):
            client.post(f"{url}/v1/requests", json={"prompt": "a", "max_tokens": 1}, headers=headers)

        def one(_):
            start = time.perf_counter()
            reply = client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
            return reply.status_code, time.perf_counter() - start
        with ThreadPoolExecutor(50) as pool:
            results = list(pool.map(one, range(50)))
    codes = sorted({c for c, _ in results})
    return f"statuses {codes}, slowest answer {max(t for _, t in results) * 1000:.0f} ms"


def stream_flood(url: str, headers: dict) -> str:
    """40 SSE streams at once on one long request of the attacker's (a stream of an existing request
    charges no request: only the stream cap stops them)."""
    rid = httpx.post(f"{url}/v1/requests", json={"prompt": "a story", "max_tokens": 200, "ignore_eos": True},
                     headers=headers, timeout=60).json()["id"]

    def one(_):
        with httpx.Client(timeout=120) as client, client.stream(
                "GET", f"{url}/v1/requests/{rid}/events", headers=headers) as reply:
            for _ in reply.iter_lines():
                pass
            return reply.status_code
    with ThreadPoolExecutor(40) as pool:
        codes = list(pool.map(one, range(40)))
    return f"{codes.count(200)} streams, {codes.count(429)} refused 429 (cap {STREAM_CAP})"


def flex_flood(url: str, headers: dict, seconds: float, clients: int = 40) -> str:
    """`clients` threads, each sending one flex chat of 64 tokens after another for `seconds`."""
    stop, counts = threading.Event(), {"done": 0, "bad": 0}

    def one(i: int) -> None:
        with httpx.Client(timeout=600) as client:
            n = 0
            while not stop.is_set():
                n += 1
                body = {"messages": [{"role": "user", "content": f"Write report {i}-{n} on the warehouse."}],
                        "max_tokens": 64, "ignore_eos": True, "service_tier": "flex"}
                reply = client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
                ok = reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 64
                counts["done" if ok else "bad"] += 1
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return f"{counts['done']} flex chats done whole, {counts['bad']} not"


def misspelled(url: str, headers: dict) -> str:
    with httpx.Client(timeout=60) as client:
        rid = client.post(f"{url}/v1/requests", json={"prompt": "a", "max_tokens": 2}, headers=headers).json()["id"]
        worst, codes = 0.0, set()
        for other in (rid.upper(), f" {rid}", f"{rid} ", "{" + rid + "}"):
            for path in (f"/v1/requests/{other}", f"/v1/requests/{other}/events"):
                start = time.perf_counter()
                codes.add(client.get(f"{url}{path}", headers=headers).status_code)
                worst = max(worst, time.perf_counter() - start)
    return f"statuses {sorted(codes)}, slowest {worst * 1000:.0f} ms"


def cross_tenant_cache(url: str, headers: dict, prompt: str) -> str:
    """A tenant that has sent nothing before sends the victim's last prompt (so no block of it, not
    even the chat template's opening, is its own)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120).json()
    return f"cached_tokens {reply['usage']['prompt_tokens_details']['cached_tokens']}"


def attacker_process() -> ProcessPoolExecutor:
    """The attack runs in a process of its own, as another tenant's clients would: its threads
    never hold this process's interpreter lock while the victim's clients time their first tokens."""
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="alone, then beside the attack, this many times over; each side's TTFTs pooled")
    parser.add_argument("--attacks", default="all",
                        help="the attacks to run, their rows' names separated by ';' (e.g. 'flex flood, victim priority'), or all")
    args = parser.parse_args()
    settings = {"STREAMQ_MODEL": args.model, "STREAMQ_AUTH": "on", "STREAMQ_MAX_STREAMS_PER_TENANT": str(STREAM_CAP),
                "STREAMQ_BATCH_SIZE": "16"}
    with Stack(Path(tempfile.mkdtemp(prefix="streamq-abuse-")), settings, scheduler=True, name="abuse",
               options=["--log-level", "warning"], ready_timeout_s=300) as stack:
        url = stack.url
        victim_key, attacker_key = keys(stack, "victim"), keys(stack, "attacker")
        limit(stack, "attacker", "--rpm", "60", "--concurrent", "2", "--tpm", "20000")
        limit(stack, "victim", "--tiers", "priority,default,flex")
        flexer = {"Authorization": f"Bearer {keys(stack, 'flexer')}"}  # unlimited; flex is every tenant's
        attacker = {"Authorization": f"Bearer {attacker_key}"}
        victim = Victim(url, victim_key, args.streams)
        prober = {"Authorization": f"Bearer {keys(stack, 'newcomer')}"}
        victim.run(30)  # warm up
        rows = []
        # Bytes per body byte, with the victim's key (its limits would refuse the first: 429).
        small = rerank_bytes(stack, url, {"Authorization": f"Bearer {victim_key}"}, 2_000, 64)
        big = rerank_bytes(stack, url, attacker, 30_000, 256)
        rows.append(["rerank bytes (alone)", "-", "-", "-", "-", "-", 0,
                     f"2 KB x 64: {small[0]}, written {small[1]:.2f} B/B, held {small[2]:.2f} B/B; "
                     f"30 KB x 256: {big[0]}, written {big[1]:.2f} B/B"])
        attacks = {"batch flood": (batch_flood, url, attacker),
                   "50 over-limit costly": (costly_flood, url, attacker),
                   "stream flood": (stream_flood, url, attacker),
                   "mis-spelled ids": (misspelled, url, attacker),
                   "cross-tenant prompt": (cross_tenant_cache, url, prober, victim.last_prompt),
                   "flex flood, victim priority": (flex_flood, url, flexer, args.seconds + 10),
                   "flex flood, victim flex": (flex_flood, url, flexer, args.seconds + 10)}
        if args.attacks != "all":
            chosen = [a.strip() for a in args.attacks.split(";")]
            if unknown := set(chosen) - set(attacks):
                parser.error(f"no attack named {sorted(unknown)}; the attacks: {sorted(attacks)}")
            attacks = {name: attacks[name] for name in chosen}
        for name, (attack, *attack_args) in attacks.items():
            # Each attack beside the victim's chats right after the same chats alone, `--rounds` times
            # over, the TTFTs of each side pooled: the machine's drift over the run (other work on a
            # shared host) falls on both sides of the ratio.
            victim.tier = name.rsplit(" ", 1)[1] if name.startswith("flex flood") else None
            alone, beside, lost, probes, figures, each = [], [], 0, [], [], []
            for _ in range(args.rounds):
                before, lost_before = victim.run(args.seconds)
                with Prober(url) as probe, attacker_process() as pool:
                    result = pool.submit(attack, *attack_args)
                    if name.startswith("flex flood"):
                        time.sleep(5)  # the flood fills the batch first
                    during, lost_during = victim.run(args.seconds)
                    figures.append(result.result())  # a flood's threads end their requests in flight first
                alone, beside, probes = alone + before, beside + during, probes + probe.times
                lost += lost_before + lost_during
                each.append(f"{pct(before, .99) * 1000:.0f} / {pct(during, .99) * 1000:.0f}")
            if args.rounds > 1:
                figures.append(f"p99 alone / beside in each round (ms): {', '.join(each)}")
            rows.append([name, f"{pct(beside, .5) * 1000:.0f}", f"{pct(beside, .99) * 1000:.0f}",
                         f"{pct(alone, .99) * 1000:.0f}", f"{pct(beside, .99) / pct(alone, .99):.2f}",
                         f"{pct(probes, .99) * 1000:.1f}", lost, "; ".join(figures)])
        victim.tier = None
    print_table(["attack", "victim TTFT p50 ms", "p99 ms", "p99 alone ms", "p99 / alone", "/healthz p99 ms",
                 "victim lost", "attack's own figure"], rows)
    print_machine(machine("auto", 0, streams=args.streams, seconds=args.seconds, rounds=args.rounds))


if __name__ == "__main__":
    main()
