"""Deterministic mode's cost: the built-in engine with the mode off and on, in one run.

    .venv/bin/python benchmarks/deterministic.py [--dtype bfloat16] [--rounds 3] [--weights as-served] [--modes off]

In this process, on the default model, as benchmarks/engine.py does:
- **W**: workload W's 32 chat prompts at once, 64 new tokens each, greedy (tok/s over the whole
  run, prefill included);
- **one stream**: 4 of W's prompts one after another, 64 tokens each (tok/s);
- **long prefill**: 8 prompts of about 1,000 tokens at once, 1 new token each (prompt tok/s), where
  the paged attention kernel computes the most there.
Rounds alternate the order of off and on; medians, and on/off per workload. The engines of a mode
share one model. `--weights`: `float` (the default model's float weights, the GGUF dequantized)
or `as-served` (what `make run` serves: the GGUF kept quantized on this CPU's quantized kernels).
`--modes off` measures the default alone (benchmarks/ab.py runs it in two checkouts, in turns).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if __name__ == "__main__":  # torch on Intel's OpenMP, as in the worker (worker/model/openmp.py)
    from worker.model.openmp import restart_with_intel_openmp
    restart_with_intel_openmp([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]])

import torch

from benchmarks.report import machine, print_machine, print_table
from shared.model_paths import prepare_model, weights_dir
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.model_loader import load_model, load_weights, pick_dtype
from worker.model.model_runner import PagedRunner


def timed(engine: Engine, prompts: list[list[int]], new_tokens: int, one_by_one: bool = False) -> float:
    """Tokens per second: generated ones, or the prompts' when new_tokens is 1."""
    started = time.perf_counter()
    seqs = []
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for group in ([[p] for p in prompts] if one_by_one else [prompts]):
        seqs += engine.generate(group, params)
    wall = time.perf_counter() - started
    counted = sum(len(p) for p in prompts) if new_tokens == 1 else sum(len(s.output_ids) for s in seqs)
    return counted / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=str(pick_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
                        choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--weights", default="float", choices=["float", "as-served"])
    parser.add_argument("--modes", default="off,on", help="comma-separated: off (the default), on (the mode)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    settings = WorkerSettings()
    tok = Tokenizer(prepare_model(settings))
    dtype, cpu = getattr(torch, args.dtype), torch.device("cpu")

    def runner(mode: str) -> PagedRunner:
        """Each mode on its own model: the runner fuses and packs the model's weights."""
        if args.weights == "float":
            model = load_model(weights_dir(settings), cpu, dtype)
        else:
            model = load_weights(settings, cpu, dtype)
        return PagedRunner(model, cpu, 4096, 16, kernels.load(settings.step), deterministic=mode == "on")
    runners = {mode: runner(mode) for mode in modes}
    workload = json.loads((ROOT / "benchmarks" / "workload_w.json").read_text())
    w = [tok.encode_chat(m) for m in workload["messages"]]
    filler = tok.encode(" ".join(m[-1]["content"] for m in workload["messages"]))
    long = [(filler * 8)[i * 50:i * 50 + 1000] for i in range(8)]
    runs = {"W (32 at once, 64 tokens)": lambda e: timed(e, w, workload["max_tokens"]),
            "one stream (64 tokens)": lambda e: timed(e, w[:4], 64, one_by_one=True),
            "long prefill (8 x 1,000 tokens)": lambda e: timed(e, long, 1)}

    def engine(mode: str) -> Engine:
        return Engine(runners[mode], tok, Batcher(BlockManager(4096, 16, False), 32, 2048))
    for mode in modes:  # warm-up
        timed(engine(mode), w[:2], 4)
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            for name, measure in runs.items():
                results.setdefault((name, mode), []).append(measure(engine(mode)))
                print(f"# round {r + 1}: {name}, mode {mode}: {results[(name, mode)][-1]:.1f} tok/s", file=sys.stderr)
    rows = []
    for name in runs:
        row = {"workload": name}
        for mode in modes:
            row[f"{mode}_tok_per_s"] = round(statistics.median(results[(name, mode)]), 1)
        if len(modes) == 2:
            row["on_vs_off"] = round(row["on_tok_per_s"] / row["off_tok_per_s"], 3)
        for mode in modes:
            row[f"rounds_{mode}"] = " / ".join(f"{x:.1f}" for x in results[(name, mode)])
        rows.append(row)
    report = {"machine": machine(args.dtype, torch.get_num_threads(), weights=args.weights), "rows": rows}
    print(json.dumps(report, indent=1))
    print_table(list(rows[0]), [list(r.values()) for r in rows])
    print_machine(report["machine"])


if __name__ == "__main__":
    main()
