"""streamq against llama.cpp's own llama-server on the same GGUF files, in one run, rounds interleaved.

    .venv/bin/python benchmarks/gguf_peers.py --gguf FILE [--gguf FILE ...] [--rounds 3] [--streamq-env K=V ...]
    .venv/bin/python benchmarks/gguf_peers.py --shape qwen2.5-1.5b --shape qwen2.5-3b [--type Q4_K_M]

`--shape` takes a random-weight GGUF of a real model's shape (scripts/real_gguf.py, written once).
- llama.cpp: `llama-server` built for this CPU by scripts/llama-cpp.sh (from the source the
  llama-cpp-python sdist carries), `-np 32` parallel slots with continuous batching over one
  unified KV cache of 32 x 512 tokens (`-kvu`: what it picks itself when not told the slots; a
  slot may then take a 2,000-token prompt), every core.
- streamq: `STREAMQ_MODEL=FILE` through the whole stack (a private redis-server, one worker, one
  api), batch 32.
Both are loaded by `streamq bench` over their OpenAI chat endpoints, a warm-up of W's first two
prompts first: one stream (4 prompts one after another, 128 tokens each), W
(benchmarks/workload_w.json: 32 chat prompts at once, 64 tokens each) and, with `--ttft`, a long
prompt (3 prompts of about 2,000 tokens one after another, each new to both servers' prefix
caches, 8 tokens each: its time to first token); greedy, ignore_eos.

Before any server starts, the memory bandwidth (benchmarks/bandwidth.py: STREAM's triad on every
core). Each one-stream figure gets its share of it: bytes a decode step reads (the weights as the
server holds them, streamq's `streamq:model_weight_bytes`, llama.cpp's the file's tensors; plus
the KV cache at the load's mean context) over the decode's time per token (TPOT), divided by the
triad's bandwidth. With `--agree`, each file's greedy text on 3 of W's prompts, 32 tokens, from
both servers: how many tokens are equal, and where they part each one's two best tokens and
logprobs. Prints a table per file and load (each round's figures, the median ratio), then
one table of every file: one stream, W, TTFT at 2,000 tokens, RSS of the model process over the
file's bytes, share of the bandwidth; with lscpu's model and flags, cores and the bandwidth.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bandwidth import measure as measure_bandwidth
from benchmarks.report import cpu_flags, cpu_model, print_table
from shared.redis_server import free_port
from streamq import bench
from streamq.stack import local_stack

W = ROOT / "benchmarks" / "workload_w.json"
LOADS = {"one stream": ["--num-prompts", "4", "--concurrency", "1", "--max-tokens", "128"],
         "W (32 at once)": ["--num-prompts", "32", "--max-tokens", "64"]}
LONG = "TTFT, 2,000-token prompt"
LONG_PROMPTS, LONG_WORDS = 3, 1500
WORDS = ("the river city light morning people market small house window bread winter summer garden road "
         "north stone music letter village friend station paper evening quiet mountain story teacher "
         "harbour lamp orchard bridge field table forest coat island clock school kitchen bicycle cloud").split()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def long_prompts(seed: int) -> Path:
    """LONG_PROMPTS chat prompts of LONG_WORDS words each, every one starting with its own number
    (so that no server's prefix cache holds any of it), written to a file for `streamq bench`."""
    rng = random.Random(seed)
    prompts = [[{"role": "user", "content": f"Note {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(LONG_WORDS))
                 + ". Summarise the note."}] for i in range(LONG_PROMPTS)]
    path = Path(tempfile.mkdtemp(prefix="gguf-peers-")) / "long.json"
    path.write_text(json.dumps({"messages": prompts}))
    return path


@contextmanager
def llama_server(gguf: Path, slots: int, context: int) -> Iterator[tuple[str, int]]:
    built = subprocess.run([str(ROOT / "scripts" / "llama-cpp.sh")], check=True, capture_output=True, text=True)
    binary = Path(built.stdout.strip().splitlines()[-1]) / "bin" / "llama-server"
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-np", str(slots), "-c", str(slots * context), "-kvu", "--cont-batching",
                             "-t", str(os.cpu_count()), "-tb", str(os.cpu_count()), "--no-webui"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited: see {log.name}")
            time.sleep(0.5)  # polling a server's start-up, not synchronising a test
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def load(url: str, model: str, extra: list[str], prompts: Path = W) -> dict:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    common = ["--url", url, "--endpoint", "openai-chat", "--model", model, "--ignore-eos", "--temperature", "0",
              "--quiet", "--timeout", "900"]
    warm = ["--prompts", str(W), "--num-prompts", "2", "--max-tokens", "8"]
    asyncio.run(bench.run(parser.parse_args(common + warm)))
    report = asyncio.run(bench.run(parser.parse_args(common + ["--prompts", str(prompts)] + extra)))
    if report["failed"]:
        raise SystemExit(f"{report['failed']} requests failed: {report['errors']}")
    return report


def one_round(system: str, url: str, model: str, pid: int, long: Path | None) -> dict:
    out = {name: load(url, model, extra) for name, extra in LOADS.items()}
    if long is not None:
        out[LONG] = load(url, model, ["--num-prompts", str(LONG_PROMPTS), "--concurrency", "1", "--max-tokens", "8"],
                         long)
    out["rss_mb"] = rss_mb(pid)
    print(f"# {system}: " + ", ".join(f"{k} {v['output_tokens_per_s']} tok/s" for k, v in out.items()
                                       if isinstance(v, dict)) + f", RSS {out['rss_mb']:.0f} MB", file=sys.stderr)
    return out


AGREE_PROMPTS, AGREE_TOKENS = 3, 32


def greedy(url: str, model: str) -> list[list[tuple[str, float, list[tuple[str, float]]]]]:
    """AGREE_TOKENS greedy tokens of each of W's first AGREE_PROMPTS prompts: (token, logprob, the
    two best with theirs) each."""
    prompts = json.loads(W.read_text())["messages"][:AGREE_PROMPTS]
    found = []
    for messages in prompts:
        body = {"model": model, "messages": messages, "max_tokens": AGREE_TOKENS, "temperature": 0,
                "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900).json()
        found.append([(t["token"], t["logprob"], [(a["token"], round(a["logprob"], 3)) for a in t["top_logprobs"]])
                      for t in reply["choices"][0]["logprobs"]["content"]])
    return found


def agreement(ours: list, theirs: list) -> list[str]:
    """Per prompt: the tokens equal from the start, and where the two part, each one's two best."""
    lines = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        same = 0
        while same < min(len(a), len(b)) and a[same][0] == b[same][0]:
            same += 1
        line = f"prompt {i}: {same} of {len(a)} tokens equal"
        if same < min(len(a), len(b)):
            line += f"; at token {same}: streamq's two best {a[same][2]}, llama.cpp's {b[same][2]}"
        lines.append(line)
    return lines


def worker_weight_bytes(url: str) -> float | None:
    """The worker's streamq:model_weight_bytes, from its /metrics (its port in /readyz)."""
    workers = httpx.get(f"{url}/readyz", timeout=30).json()["workers"]
    text = httpx.get(f"http://127.0.0.1:{workers[0]['metrics_port']}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("streamq:model_weight_bytes "):
            return float(line.split()[1])
    return None


def shape_of(gguf: Path) -> dict:
    """What the bytes a step reads hang on: the tensors' bytes, and the KV cache's a token."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch = reader.fields["general.architecture"].contents()

    def field(name: str) -> int:
        return int(reader.fields[f"{arch}.{name}"].contents())
    heads, hidden = field("attention.head_count"), field("embedding_length")
    kv_dims = field("attention.head_count_kv") * hidden // heads
    return {"tensor_bytes": sum(int(t.n_bytes) for t in reader.tensors),
            "kv_values_a_token": 2 * field("block_count") * kv_dims}


def share(weight_bytes: float, kv_bytes_a_token: float, context: float, tpot_ms: float, bandwidth_gbs: float) -> float:
    """One decode step's bytes over its time, as a share of the bandwidth."""
    return (weight_bytes + kv_bytes_a_token * context) / (tpot_ms / 1000) / (bandwidth_gbs * 1e9)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_file(gguf: Path, args, settings: dict[str, str], bandwidth_gbs: float) -> dict:
    rounds: dict[str, list[dict]] = {"streamq": [], "llama.cpp": []}
    weights, texts = None, {}
    for r in range(args.rounds):
        long = long_prompts(r) if args.ttft else None
        pids: dict[str, int] = {}
        with local_stack("gguf-peers", {**settings, "STREAMQ_MODEL": str(gguf.resolve())}, timeout_s=900,
                         pids_out=pids) as url:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            weights = worker_weight_bytes(url)
            rounds["streamq"].append(one_round("streamq", url, model, pids["worker"], long))
            if args.agree and r == 0:
                texts["streamq"] = greedy(url, model)
        with llama_server(gguf, args.slots, args.context) as (url, pid):
            rounds["llama.cpp"].append(one_round("llama.cpp", url, "model", pid, long))
            if args.agree and r == 0:
                texts["llama.cpp"] = greedy(url, "model")
    size = gguf.stat().st_size
    shape = shape_of(gguf)
    print(f"\n{gguf.name} ({size / 2**20:.0f} MiB), {args.rounds} rounds interleaved\n")
    agreed = agreement(texts["streamq"], texts["llama.cpp"]) if texts else []
    if agreed:
        print("Greedy text, streamq against llama.cpp:\n\n" + "\n".join(f"- {line}" for line in agreed) + "\n")
    medians: dict[str, dict[str, float]] = {s: {} for s in rounds}
    for name in [*LOADS, *([LONG] if args.ttft else [])]:
        rows = []
        for system, runs in rounds.items():
            tps = [r[name]["output_tokens_per_s"] for r in runs]
            ttft = median([r[name]["ttft_ms"]["p50"] for r in runs])
            tpot = median([r[name]["tpot_ms"]["p50"] for r in runs])
            medians[system][name] = ttft if name == LONG else median(tps)
            medians[system][name + " tpot"] = tpot
            rows.append([system, " / ".join(str(t) for t in tps), round(median(tps), 2), round(ttft, 1),
                         round(tpot, 2)])
        print(f"**{name}** (streamq / llama.cpp, median {'TTFT' if name == LONG else 'tok/s'}: "
              f"{medians['streamq'][name] / medians['llama.cpp'][name]:.2f}x)\n")
        print_table(["system", "tok/s each round", "median tok/s", "TTFT p50 ms", "TPOT p50 ms"], rows)
        print()
    # one stream's context: W's first prompts (about 30 tokens with the template) and half of 128 new
    held = {"streamq": weights if weights is not None else float("nan"), "llama.cpp": shape["tensor_bytes"]}
    kv = {"streamq": 4 * shape["kv_values_a_token"], "llama.cpp": 2 * shape["kv_values_a_token"]}  # fp32 / f16
    summary = {"file": gguf.name, "file_mib": size / 2**20, "agreement": agreed}
    for system in rounds:
        summary[system] = {**medians[system], "rss_over_file": median([r["rss_mb"] for r in rounds[system]]) * 2**20
                           / size, "weights_mib": held[system] / 2**20,
                           "bandwidth_share": share(held[system], kv[system], 30 + 64,
                                                    medians[system]["one stream tpot"], bandwidth_gbs)}
    return {"summary": summary, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, action="append", default=[])
    parser.add_argument("--shape", action="append", default=[], help="a real model's shape (scripts/real_gguf.py)")
    parser.add_argument("--type", default="Q4_K_M", help="the --shape files' type")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--context", type=int, default=512, help="llama-server's KV cache: this many tokens a slot")
    parser.add_argument("--ttft", action="store_true", help="also the long prompt's TTFT")
    parser.add_argument("--agree", action="store_true", help="also compare both servers' greedy text")
    parser.add_argument("--streamq-env", nargs="*", default=[], help="extra STREAMQ_* settings, K=V")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from scripts.real_gguf import real_gguf

    files = [*args.gguf, *(real_gguf(shape, args.type) for shape in args.shape)]
    if not files:
        parser.error("give --gguf FILE or --shape NAME")
    settings = {"STREAMQ_BATCH_SIZE": str(args.slots), **dict(kv.split("=", 1) for kv in args.streamq_env)}
    one, every = measure_bandwidth(1), measure_bandwidth(os.cpu_count() or 1)
    print(f"# memory bandwidth (triad): {one.triad_gbs:.1f} GB/s on one core, {every.triad_gbs:.1f} GB/s on "
          f"{every.threads}", file=sys.stderr)
    results = [run_file(f, args, settings, every.triad_gbs) for f in files]
    print("**Every file** (streamq / llama.cpp: medians of the rounds; share: of the triad bandwidth)\n")
    rows = []
    for res in results:
        s, q, ll = res["summary"], res["summary"]["streamq"], res["summary"]["llama.cpp"]
        ttft = (f"{q[LONG]:.0f} / {ll[LONG]:.0f} ms ({q[LONG] / ll[LONG]:.2f}x)" if LONG in q else "-")
        rows.append([f"{s['file']} ({s['file_mib']:.0f} MiB)",
                     f"{q['one stream']:.2f} / {ll['one stream']:.2f} ({q['one stream'] / ll['one stream']:.2f}x)",
                     f"{q['W (32 at once)']:.1f} / {ll['W (32 at once)']:.1f} "
                     f"({q['W (32 at once)'] / ll['W (32 at once)']:.2f}x)", ttft,
                     f"{q['rss_over_file']:.2f} / {ll['rss_over_file']:.2f}",
                     f"{q['weights_mib']:.0f} / {ll['weights_mib']:.0f}",
                     f"{q['bandwidth_share']:.2f} / {ll['bandwidth_share']:.2f}"])
    print_table(["file", "one stream tok/s", "W tok/s", LONG, "RSS / file", "weights read, MiB",
                 "one stream's share of bandwidth"], rows)
    print(f"\nMachine: {cpu_model()}, {os.cpu_count()} cores (flags: {' '.join(cpu_flags())}); memory bandwidth "
          f"(triad) {one.triad_gbs:.1f} GB/s on one core, {every.triad_gbs:.1f} GB/s on {every.threads}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "cpu": cpu_model(), "flags": cpu_flags(),
                                         "triad_gbs": [one.triad_gbs, every.triad_gbs]}, indent=1))


if __name__ == "__main__":
    main()
