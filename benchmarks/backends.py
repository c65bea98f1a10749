"""Workload W through the whole stack with each worker backend, and through `vllm serve` alone,
in ONE run on this machine (default model, fp32, both cores).

    .venv/bin/python benchmarks/backends.py     # needs .venv-vllm (make vllm-env)

Each phase sends W's 32 chat prompts at once to an OpenAI chat endpoint (64 tokens each,
greedy, ignore_eos), with `streamq bench --endpoint openai-chat`, after a warm-up:
1. streamq, built-in backend (worker batch 32);
2. streamq, vLLM backend (the same, the worker running from .venv-vllm; max_num_seqs 32);
3. vLLM's own OpenAI server (vllm.entrypoints.openai.api_server), max_num_seqs 32.
The difference between 2 and 3 is what streamq's queue, relay and SSE path cost or save.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.local_stack import local_stack  # noqa: E402
from benchmarks.report import print_table  # noqa: E402
from shared import bench  # noqa: E402
from shared.models import prepare_model, served_name, weights_dir  # noqa: E402
from shared.redis_server import free_port  # noqa: E402
from shared.settings import WorkerSettings  # noqa: E402

W = ROOT / "benchmarks" / "workload_w.json"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}


def load(url: str, model: str) -> dict:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    common = ["--url", url, "--endpoint", "openai-chat", "--model", model, "--prompts", str(W), "--ignore-eos",
              "--quiet"]
    asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "4", "--max-tokens", "4"])))  # warm-up
    result = asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "32", "--max-tokens", "64"])))
    result.pop("config", None)
    return result


def streamq(backend: str, model: str) -> dict:
    settings = {"STREAMQ_BATCH_SIZE": "32", "STREAMQ_DTYPE": "float32", "STREAMQ_MAX_NUM_BATCHED_TOKENS": "2048",
                "STREAMQ_NUM_KV_BLOCKS": "4096", "STREAMQ_BACKEND": backend, "STREAMQ_KV_CACHE_GB": "2",
                "STREAMQ_VLLM_ENFORCE_EAGER": "true", "STREAMQ_VLLM_MAX_MODEL_LEN": "2048", **VLLM_ENV}
    python = str(VLLM_PYTHON) if backend == "vllm" else None
    with local_stack(f"backend-{backend}", settings, timeout_s=600, worker_python=python) as url:
        return load(url, model)


def vllm_serve(model_dir: Path, model: str) -> dict:
    port = free_port()
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--served-model-name", model, "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "32",
         "--max-model-len", "2048", "--port", str(port)],
        env={**os.environ, **VLLM_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vllm serve exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("vllm serve did not start")
            time.sleep(1)
        return load(url, model)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    settings = WorkerSettings()
    prepare_model(settings)
    model = served_name(settings)
    report = {"streamq_hf": streamq("hf", model), "streamq_vllm": streamq("vllm", model),
              "vllm_serve": vllm_serve(weights_dir(settings), model)}
    print(json.dumps(report, indent=1))
    print_table(["path", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)"],
                [(name, r["output_tokens_per_s"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"])
                 for name, r in report.items()])


if __name__ == "__main__":
    main()
