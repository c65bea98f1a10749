"""LoRA adapters mixed in one batch against the base model alone, on the default model, in ONE run.

    .venv/bin/python benchmarks/lora.py [--rounds 3] [--streams 16] [--tokens 64] [--dtype bfloat16]

The default model as `make run` serves it (--weights as-served: the GGUF kept quantized; float: its
dequantized weights). Four adapters made by peft on the default model (ranks 8, 16, 8, 16, all seven projections,
random non-zero weights) are served by one engine (worker/model/lora.py). Each round runs, in turns:

- base: `--streams` chat prompts of workload W (benchmarks/workload_w.json) at once, greedy,
  `--tokens` new tokens each, ignore_eos, on the base model;
- lora: the same requests, each naming one of the four adapters in turn, so every step's batch
  holds rows of all four (each projection adds four gathered low-rank deltas).

W = output tokens / wall time from the first request to the last token. Each run has a fresh
prefix cache (no run reuses another's prompts). Medians over the rounds, the lora/base ratio,
and the machine (lscpu's model name and flags).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if __name__ == "__main__":  # torch on Intel's OpenMP, as in the worker (worker/model/openmp.py)
    from worker.model.openmp import restart_with_intel_openmp
    restart_with_intel_openmp([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]])

import torch

from benchmarks.report import machine, print_machine, print_table
from shared.messages import RequestPayload
from shared.model_paths import prepare_model, weights_dir
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from streamq.testing.lora_adapters import make_adapter
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.lora import Adapters
from worker.model.model_loader import load_model, load_weights, pick_dtype
from worker.model.model_runner import PagedRunner

RANKS = (8, 16, 8, 16)
BLOCKS, BLOCK_SIZE = 2048, 16


def run_w(runner: PagedRunner, tok: Tokenizer, prompts: list[list[int]], names: list[str | None],
          tokens: int) -> dict:
    """All prompts at once (request i with adapter names[i]); W and the step count."""
    engine = Engine(runner, tok, Batcher(BlockManager(BLOCKS, BLOCK_SIZE), len(prompts), 2048))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    seqs = [engine.add(RequestPayload(id=f"r{i}", model="m", prompt_token_ids=p, params=params, adapter=name))
            for i, (p, name) in enumerate(zip(prompts, names))]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    errors = [s.error for s in seqs if s.error]
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    produced = sum(len(s.output_ids) for s in seqs)
    return {"tok_per_s": produced / wall, "wall_s": wall, "steps": steps, "output_tokens": produced}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default=str(pick_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
                        choices=["float32", "bfloat16"], help="default: what dtype=auto picks on this CPU")
    parser.add_argument("--weights", default="as-served", choices=["as-served", "float"],
                        help="as-served: the GGUF kept quantized, as `make run` serves it; float: dequantized")
    args = parser.parse_args()

    settings = WorkerSettings()
    tok = Tokenizer(prepare_model(settings))
    folder = weights_dir(settings)
    model = (load_weights(settings, torch.device("cpu"), getattr(torch, args.dtype)) if args.weights == "as-served"
             else load_model(folder, torch.device("cpu"), getattr(torch, args.dtype)))
    runner = PagedRunner(model, torch.device("cpu"), BLOCKS, BLOCK_SIZE, kernels.load())
    runner.adapters = Adapters(model, len(RANKS), max(RANKS), kernels=runner.kernels)
    with tempfile.TemporaryDirectory() as scratch:
        for i, rank in enumerate(RANKS):
            print(f"# making adapter {i} (r={rank}) with peft", file=sys.stderr)
            runner.adapters.load(f"a{i}", make_adapter(folder, Path(scratch) / f"a{i}", r=rank, alpha=2 * rank,
                                                       seed=i + 1, magnitude=0.05))
    workload = json.loads((ROOT / "benchmarks" / "workload_w.json").read_text())
    prompts = [tok.encode_chat(m) for m in workload["messages"][:args.streams]]
    modes = {"base": [None] * len(prompts), "lora": [f"a{i % len(RANKS)}" for i in range(len(prompts))]}
    run_w(runner, tok, prompts[:4], modes["lora"][:4], 4)  # warm-up: both paths
    run_w(runner, tok, prompts[:4], modes["base"][:4], 4)
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode, names in (modes.items() if r % 2 == 0 else reversed(modes.items())):
            results[mode].append(run_w(runner, tok, prompts, names, args.tokens))
            print(f"# round {r + 1} {mode}: {results[mode][-1]['tok_per_s']:.1f} tok/s", file=sys.stderr)
    medians = {mode: statistics.median(x["tok_per_s"] for x in runs) for mode, runs in results.items()}
    report = {"machine": machine(args.dtype, torch.get_num_threads(), step=runner.numerics[2], weights=args.weights),
              "streams": len(prompts), "new_tokens": args.tokens, "rounds": args.rounds, "adapter_ranks": RANKS,
              "results": {mode: [round(x["tok_per_s"], 1) for x in runs] for mode, runs in results.items()},
              "median_tok_per_s": {mode: round(v, 1) for mode, v in medians.items()},
              "ratio_lora_over_base": round(medians["lora"] / medians["base"], 3)}
    print(json.dumps(report, indent=2))
    print_table(["mode", "W (tok/s), median", "rounds", "lora / base"],
                [["base", f"{medians['base']:.1f}", ", ".join(f"{x:.1f}" for x in report["results"]["base"]), ""],
                 ["4 adapters (r 8/16, all 7 projections) in one batch", f"{medians['lora']:.1f}",
                  ", ".join(f"{x:.1f}" for x in report["results"]["lora"]), f"{report['ratio_lora_over_base']:.2f}x"]])
    print_machine(report["machine"])


if __name__ == "__main__":
    main()
