"""Where exact output holds: three claims measured on the default model in one dtype or more.

    .venv/bin/python benchmarks/exactness.py                      # bf16 where the CPU has it, and fp32
    .venv/bin/python benchmarks/exactness.py --dtypes float32 --prompts 4
    .venv/bin/python benchmarks/exactness.py --weights as-served   # the GGUF as `make run` serves it

Prompts: the first --prompts chat prompts of benchmarks/workload_w.json (64 new tokens,
ignore_eos) and copy-style ones of benchmarks/workload_lookup.json (128 new tokens at most),
chat-templated, run through the built-in engine in this process. Per dtype and prompt set,
how many prompts' token ids differ between:
  lookup    greedy with prompt-lookup speculation (the worker's defaults, never paused) vs plain
            greedy, all prompts in one batch either way
  seed      a seeded sampled request (temperature 0.8, seed = its number) alone vs in one batch
            with the others
  takeover  greedy continued after the first --delivered tokens (prompt and those tokens
            prefilled in one forward, as a worker taking over a request does) vs undisturbed,
            all prompts in one batch either way
  prefix    greedy, the same prompts sent again to the same engine, whose prefix cache now holds
            their blocks (only each prompt's last tokens are computed again) vs the first time
--weights: `float` (the default model's float weights, the GGUF dequantized) or `as-served` (the
GGUF kept quantized, on this CPU's quantized kernels, as `make run` serves it).
Prints a JSON report (with the CPU's model and its avx512/amx flags) and a markdown table.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, print_machine, print_table
from shared.messages import RequestPayload, TokenEvent
from shared.model_paths import prepare_model, weights_dir
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model import kernels
from worker.model.model_runner import PagedRunner
from worker.model.model_loader import load_model, load_weights, pick_dtype
from worker.engine.speculation import NgramProposer, Speculator

BLOCKS, BLOCK_SIZE, BUDGET = 1024, 16, 512


def run(model, tok, prompts: list[list[int]], params: list[SamplingParams], speculate: bool = False,
        resumed: list[list[TokenEvent]] | None = None, again: bool = False
        ) -> tuple[list[list[int]], list[list[TokenEvent]]]:
    """All prompts in one batch, to the end: each one's output ids and token events. `again`: then
    the same batch once more on the same engine (its prefix cache warm), whose outputs are returned.
    `model`: a function that loads the model (a runner packs the weights of the model it is given)."""
    model = model()
    settings = WorkerSettings.model_fields
    k = settings["num_speculative_tokens"].default
    spec = Speculator(NgramProposer(k, settings["ngram_min"].default, settings["ngram_max"].default), k) \
        if speculate else None
    runner = PagedRunner(model, torch.device("cpu"), BLOCKS, BLOCK_SIZE, kernels.load())
    engine = Engine(runner, tok, Batcher(BlockManager(BLOCKS, BLOCK_SIZE), len(prompts), BUDGET), spec)
    seqs = engine.generate([RequestPayload(id=f"r{i}", model="m", prompt_token_ids=p, params=q)
                            for i, (p, q) in enumerate(zip(prompts, params))], resumed=resumed)
    events = [list(resumed[i] if resumed else []) + s.tokens for i, s in enumerate(seqs)]
    if again:
        seqs = engine.generate([RequestPayload(id=f"again{i}", model="m", prompt_token_ids=p, params=q)
                                for i, (p, q) in enumerate(zip(prompts, params))])
        events = [[] for _ in seqs]  # the second run's events are not kept
        assert engine.batcher.blocks.prefix_hits > 0
    return [s.output_ids for s in seqs], events


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b))


def measure(model, tok, prompts: list[list[int]], greedy: SamplingParams, delivered: int) -> dict:
    n = len(prompts)
    plain, events = run(model, tok, prompts, [greedy] * n)
    lookup, _ = run(model, tok, prompts, [greedy] * n, speculate=True)
    sampled = [greedy.model_copy(update={"temperature": 0.8, "seed": i}) for i in range(n)]
    together, _ = run(model, tok, prompts, sampled)
    alone = [run(model, tok, [p], [q])[0][0] for p, q in zip(prompts, sampled)]
    # A takeover continues after tokens already delivered (half of a short output).
    cut = [min(delivered, len(e) // 2) for e in events]
    taken_over, _ = run(model, tok, prompts, [greedy] * n, resumed=[e[:c] for e, c in zip(events, cut)])
    cached, _ = run(model, tok, prompts, [greedy] * n, again=True)
    return {"prompts": n, "lookup": differing(plain, lookup), "seed": differing(together, alone),
            "takeover": differing(plain, taken_over), "prefix": differing(plain, cached), "delivered": cut,
            "first_difference": {name: [_first_difference(x, y) for x, y in zip(plain if name != "seed" else together,
                                                                                 other)]
                                 for name, other in (("lookup", lookup), ("seed", alone),
                                                     ("takeover", taken_over), ("prefix", cached))}}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token that differs (None: identical)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def cpu() -> dict:
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.+)", text)
    flags = re.search(r"Flags:\s*(.+)", text)
    wanted = sorted(f for f in (flags.group(1).split() if flags else []) if f.startswith(("avx512", "amx")))
    return {"model": model.group(1).strip() if model else platform.processor(), "flags": wanted,
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="auto,float32", help="comma-separated: auto, float32, bfloat16")
    parser.add_argument("--prompts", type=int, default=8, help="prompts of each set")
    parser.add_argument("--delivered", type=int, default=16, help="tokens delivered before the takeover")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--weights", default="float", choices=["float", "as-served"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    settings = WorkerSettings(_env_file=None)
    tok = Tokenizer(prepare_model(settings))
    sets = {}
    for name, workload in (("chat", "w"), ("copy", "lookup")):
        data = json.loads((ROOT / "benchmarks" / f"workload_{workload}.json").read_text())
        prompts = [tok.encode_chat(m) for m in data["messages"]][:args.prompts]
        sets[name] = (prompts, SamplingParams(temperature=0, max_tokens=data["max_tokens"], ignore_eos=name == "chat"))
    report = {"cpu": cpu(), "torch": torch.__version__, "weights": args.weights, "results": []}
    dtypes = dict.fromkeys(str(pick_dtype(d, torch.device("cpu"))).removeprefix("torch.")
                           for d in args.dtypes.split(","))
    for dtype in dtypes:
        def model(dtype: str = dtype):
            if args.weights == "float":
                return load_model(weights_dir(settings), torch.device("cpu"), getattr(torch, dtype))
            return load_weights(settings, torch.device("cpu"), getattr(torch, dtype))
        for name, (prompts, greedy) in sets.items():
            start = time.perf_counter()
            row = {"dtype": dtype, "set": name, **measure(model, tok, prompts, greedy, args.delivered),
                   "wall_s": 0.0}
            row["wall_s"] = round(time.perf_counter() - start, 1)
            report["results"].append(row)
            print(json.dumps(row), file=sys.stderr)
    print(json.dumps(report, indent=1))
    print()
    print_table(["dtype", "prompts", "lookup vs plain (greedy)", "seeded: alone vs batched",
                 "takeover vs undisturbed (greedy)", "prefix cached vs not (greedy)"],
                [(r["dtype"], r["set"], f"{r['lookup']}/{r['prompts']} differ", f"{r['seed']}/{r['prompts']} differ",
                  f"{r['takeover']}/{r['prompts']} differ", f"{r['prefix']}/{r['prompts']} differ")
                 for r in report["results"]])
    print_machine(machine(", ".join(dtypes), torch.get_num_threads(), weights=args.weights))


if __name__ == "__main__":
    main()
