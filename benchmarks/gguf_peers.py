"""streamq against llama.cpp's own llama-server on the same GGUF file, in one run, rounds interleaved.

    .venv/bin/python benchmarks/gguf_peers.py --gguf FILE [--rounds 3] [--streamq-env K=V ...]

- llama.cpp: `llama-server` built for this CPU by scripts/llama-cpp.sh (from the source the
  llama-cpp-python sdist carries), `-np 32` parallel slots with continuous batching, every core.
- streamq: `STREAMQ_MODEL=FILE` through the whole stack (a private redis-server, one worker, one
  api), batch 32.
Both are loaded by `streamq bench` over their OpenAI chat endpoints: one stream (4 prompts one
after another, 128 tokens each) and W (benchmarks/workload_w.json: 32 chat prompts at once, 64
tokens each), greedy, ignore_eos. Prints a table per load with each round's figures and the median
ratio, lscpu's model and flags, and the resident memory (RSS) of each server's model process.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamq.stack import local_stack
from benchmarks.report import cpu_flags, cpu_model, print_table
from shared.redis_server import free_port
from streamq import bench

W = ROOT / "benchmarks" / "workload_w.json"
LOADS = {"one stream": ["--num-prompts", "4", "--concurrency", "1", "--max-tokens", "128"],
         "W (32 at once)": ["--num-prompts", "32", "--max-tokens", "64"]}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextmanager
def llama_server(gguf: Path, slots: int, context: int) -> Iterator[tuple[str, int]]:
    built = subprocess.run([str(ROOT / "scripts" / "llama-cpp.sh")], check=True, capture_output=True, text=True)
    binary = Path(built.stdout.strip().splitlines()[-1]) / "bin" / "llama-server"
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-np", str(slots), "-c", str(slots * context), "--cont-batching",
                             "-t", str(os.cpu_count()), "-tb", str(os.cpu_count()), "--no-webui"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
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


def load(url: str, model: str, extra: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    common = ["--url", url, "--endpoint", "openai-chat", "--model", model, "--prompts", str(W), "--ignore-eos",
              "--temperature", "0", "--quiet", "--timeout", "900"]
    asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "2", "--max-tokens", "8"])))  # warm-up
    report = asyncio.run(bench.run(parser.parse_args(common + extra)))
    if report["failed"]:
        raise SystemExit(f"{report['failed']} requests failed: {report['errors']}")
    return report


def one_round(system: str, url: str, model: str, pid: int) -> dict:
    out = {load_name: load(url, model, extra) for load_name, extra in LOADS.items()}
    out["rss_mb"] = rss_mb(pid)
    print(f"# {system}: " + ", ".join(f"{k} {v['output_tokens_per_s']} tok/s" for k, v in out.items()
                                       if isinstance(v, dict)) + f", RSS {out['rss_mb']:.0f} MB", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--context", type=int, default=512, help="tokens per llama-server slot")
    parser.add_argument("--streamq-env", nargs="*", default=[], help="extra STREAMQ_* settings, K=V")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    settings = {"STREAMQ_MODEL": str(args.gguf.resolve()), "STREAMQ_BATCH_SIZE": str(args.slots),
                **dict(kv.split("=", 1) for kv in args.streamq_env)}
    rounds: dict[str, list[dict]] = {"streamq": [], "llama.cpp": []}
    for _ in range(args.rounds):
        pids: dict[str, int] = {}
        with local_stack("gguf-peers", settings, timeout_s=600, pids_out=pids) as url:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            rounds["streamq"].append(one_round("streamq", url, model, pids["worker"]))
        with llama_server(args.gguf, args.slots, args.context) as (url, pid):
            rounds["llama.cpp"].append(one_round("llama.cpp", url, "model", pid))
    print(f"\n{args.gguf.name} ({args.gguf.stat().st_size / 2**20:.0f} MiB), {args.rounds} rounds interleaved\n")
    for load_name in LOADS:
        rows = []
        for system, runs in rounds.items():
            tps = [r[load_name]["output_tokens_per_s"] for r in runs]
            rows.append([system, " / ".join(str(t) for t in tps), round(statistics.median(tps), 2),
                         round(statistics.median(r[load_name]["ttft_ms"]["p50"] for r in runs), 2),
                         round(statistics.median(r[load_name]["tpot_ms"]["p50"] for r in runs), 2)])
        ratio = rows[0][2] / rows[1][2]
        print(f"**{load_name}** (streamq / llama.cpp, median tok/s: {ratio:.2f}x)\n")
        print_table(["system", "tok/s each round", "median tok/s", "TTFT p50 ms", "TPOT p50 ms"], rows)
        print()
    print_table(["system", "RSS of the model process, MB (median)"],
                [[s, round(statistics.median(r["rss_mb"] for r in runs))] for s, runs in rounds.items()])
    print(f"\nMachine: {cpu_model()}, {os.cpu_count()} cores (flags: {' '.join(cpu_flags())})")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "cpu": cpu_model(), "flags": cpu_flags()}, indent=1))


if __name__ == "__main__":
    main()
