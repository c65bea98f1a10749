"""Workload W through the whole stack with the worker's default settings, beside tuned ones, in
ONE run (default model, the default dtype, both cores).

    .venv/bin/python benchmarks/defaults.py

Each setting starts a private redis-server, one worker and one api replica and sends W's 32
chat prompts at once through the OpenAI chat endpoint (64 tokens each, greedy, ignore_eos),
after a warm-up. The settings run in --rounds rounds, every other round in reverse order (the
first stack of a run measured up to 25 % slow), and each setting's median is reported. The
defaults should serve W within 0.9 of the best setting.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from streamq.stack import local_stack
from benchmarks.report import machine, print_machine, print_table
from streamq import bench
from shared.model_source import served_name
from shared.settings import WorkerSettings
from worker.model.model_loader import pick_dtype

W = ROOT / "benchmarks" / "workload_w.json"
SETTINGS = {
    "defaults": {},
    "batch 32, 2048 tokens": {"STREAMQ_BATCH_SIZE": "32", "STREAMQ_MAX_NUM_BATCHED_TOKENS": "2048"},
    "batch 64, 4096 tokens": {"STREAMQ_BATCH_SIZE": "64", "STREAMQ_MAX_NUM_BATCHED_TOKENS": "4096"},
    "batch 8, 512 tokens (the old defaults)": {"STREAMQ_BATCH_SIZE": "8", "STREAMQ_MAX_NUM_BATCHED_TOKENS": "512"},
}


def through_stack(settings: dict[str, str]) -> dict:
    with local_stack("defaults", settings) as url:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        common = ["--url", url, "--endpoint", "openai-chat", "--model", served_name(WorkerSettings()),
                  "--prompts", str(W), "--ignore-eos", "--quiet"]
        asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "4", "--max-tokens", "4"])))  # warm-up
        result = asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "32", "--max-tokens", "64"])))
    result.pop("config", None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all settings, alternating their order")
    args = parser.parse_args()
    print_machine(machine(pick_dtype("auto", torch.device("cpu")).__str__().removeprefix("torch."),
                          torch.get_num_threads()))
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_ in range(args.rounds):
        for name in list(SETTINGS)[::-1 if round_ % 2 else 1]:
            runs[name].append(through_stack(SETTINGS[name]))
    print(json.dumps(runs, indent=1))
    tok_s = {name: statistics.median(r["output_tokens_per_s"] for r in rs) for name, rs in runs.items()}
    best = max(tok_s.values())
    print_table(["worker settings", "W tok/s (median)", "each round", "vs best", "TTFT p50 ms (median)"],
                [(name, round(tok_s[name], 1), " / ".join(f"{r['output_tokens_per_s']:.1f}" for r in rs),
                  round(tok_s[name] / best, 2), round(statistics.median(r["ttft_ms"]["p50"] for r in rs)))
                 for name, rs in runs.items()])


if __name__ == "__main__":
    main()
