"""Workload W in-process, then through the whole stack, in ONE run (default model, fp32).

    .venv/bin/python benchmarks/full_stack.py

1. The engine in-process (as benchmarks/engine.py's streamq mode).
2. A private redis-server, one worker (batch 32, 2048-token budget: the same engine settings)
   and one api replica, loaded with `streamq bench --endpoint native` sending W's 32 prompts at
   once (64 tokens each, greedy, ignore_eos).
Prints both, the throughput ratio and what the queue path adds to TTFT p50.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine import run_streamq
from streamq.stack import local_stack
from streamq import bench
from shared.model_paths import prepare_model, weights_dir
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from worker.model.model_loader import load_model

W = ROOT / "benchmarks" / "workload_w.json"


def in_process(batch: int, budget: int) -> dict:
    settings = WorkerSettings()
    tok = Tokenizer(prepare_model(settings))
    model = load_model(weights_dir(settings), torch.device("cpu"), torch.float32)
    workload = json.loads(W.read_text())
    prompts = [tok.encode_chat(m) for m in workload["messages"]]
    run_streamq(model, tok, prompts[:4], 4, batch, budget)  # warm-up
    return run_streamq(model, tok, prompts, workload["max_tokens"], batch, budget)


def through_stack(batch: int, budget: int, extra: dict[str, str] | None = None, repeat: int = 1) -> list[dict]:
    """W through a fresh local stack (fp32; `extra`: more settings for its processes), `repeat`
    times after a warm-up: `streamq bench`'s report of each run."""
    settings = {"STREAMQ_BATCH_SIZE": str(batch), "STREAMQ_DTYPE": "float32",
                "STREAMQ_MAX_NUM_BATCHED_TOKENS": str(budget), "STREAMQ_NUM_KV_BLOCKS": "4096", **(extra or {})}
    with local_stack("fullstack", settings) as url:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        common = ["--url", url, "--endpoint", "native", "--prompts", str(W), "--max-tokens", "64",
                  "--ignore-eos", "--quiet"]
        asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "4", "--max-tokens", "4"])))  # warm-up
        return [asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "32"])))
                for _ in range(repeat)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    engine = in_process(args.batch_size, args.max_num_batched_tokens)
    gc.collect()
    stack = through_stack(args.batch_size, args.max_num_batched_tokens)[0]
    stack.pop("config", None)
    report = {"in_process": engine, "full_stack": stack,
              "throughput_ratio": round(stack["output_tokens_per_s"] / engine["tok_per_s"], 3),
              "ttft_p50_added_ms": round(stack["ttft_ms"]["p50"] - 1000 * engine["ttft_p50_s"], 1)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
