"""Speculative decoding benchmark: tokens/s and acceptance with and without prompt lookup, on
the default model, in ONE process run (so the ratios compare like with like).

    .venv/bin/python benchmarks/speculative.py
    .venv/bin/python benchmarks/speculative.py --k 6 --ngram-min 2 --single-requests 4

Workloads, greedy, chat-templated:
  lookup  benchmarks/workload_lookup.json: 16 requests that repeat or edit a ~230-token passage
          (128 new tokens at most; the model may stop earlier, the same way in both modes)
  W       benchmarks/workload_w.json: the first 16 of its prompts, 64 new tokens, ignore_eos
Each at concurrency 1 (--single-requests of them, one after another, batch 1) and 16 (all 16
at once, batch 16), speculation off and on (prompt lookup with the worker's defaults); with
--disable-by-batch-size N below 16, concurrency 16 also runs lookup paused above batch N.
Modes are interleaved (request by request at concurrency 1, round by round at 16, median of
--rounds) so the machine's drift hits them alike. Greedy output
must be identical in every mode; the report says so per row. Prints a JSON report and a
markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.messages import RequestPayload
from shared.model_paths import prepare_model, weights_dir
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from worker.engine.batcher import Batcher
from benchmarks.report import machine, print_machine, print_table
from streamq.testing.tiny_models import first_layers
from worker.engine.block_manager import BlockManager
from worker.engine.drafter import DraftProposer
from worker.engine.core import Engine
from worker.model import kernels
from worker.model.model_runner import PagedRunner
from worker.model.model_loader import load_model
from worker.engine.speculation import NgramProposer, Speculator

BLOCKS, BLOCK_SIZE, BUDGET = 1024, 16, 512


def run(model, tok, prompts, params: SamplingParams, make_spec=lambda runner: None) -> dict:
    """The prompts all at once (batch = their number), to the end; `make_spec(runner)` gives the
    engine's speculator (None: off)."""
    runner = PagedRunner(model, torch.device("cpu"), BLOCKS, BLOCK_SIZE, kernels.load())
    spec = make_spec(runner)
    engine = Engine(runner, tok, Batcher(BlockManager(BLOCKS, BLOCK_SIZE), len(prompts), BUDGET), spec)
    steps = 0
    start = time.perf_counter()
    seqs = [engine.add(RequestPayload(id=f"r{i}", model="m", prompt_token_ids=p, params=params))
            for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
        steps += 1
    return {"wall_s": time.perf_counter() - start, "steps": steps, "outputs": [s.output_ids for s in seqs],
            "stats": spec.stats if spec else None}

def measure(model, tok, prompts, params, concurrency: int, modes: dict, rounds: int) -> dict:
    """Every mode on the same requests, interleaved so the machine's drift hits all alike:
    at concurrency 1 request by request (each mode in turn), at 16 round by round (median wall)."""
    groups = [[p] for p in prompts] if concurrency == 1 else [prompts] * rounds
    walls: dict[str, list[float]] = {m: [] for m in modes}
    out: dict[str, dict] = {m: {"steps": 0, "outputs": [], "proposed": 0, "accepted": 0, "drafts": 0} for m in modes}
    for n, group in enumerate(groups):
        for mode, make in modes.items():
            result = run(model, tok, group, params, make)
            walls[mode].append(result["wall_s"])
            if concurrency == 1 or n == 0:
                o = out[mode]
                o["steps"] += result["steps"]
                o["outputs"] += result["outputs"]
                if stats := result["stats"]:
                    o["proposed"] += stats.proposed
                    o["accepted"] += stats.accepted
                    o["drafts"] += stats.drafts
    for mode, o in out.items():
        tokens = sum(map(len, o["outputs"]))
        wall = sum(walls[mode]) if concurrency == 1 else statistics.median(walls[mode])
        o |= {"output_tokens": tokens, "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 1),
              "walls": [round(w, 2) for w in walls[mode]] if concurrency > 1 else None,
              "acceptance": round(o["accepted"] / o["proposed"], 3) if o["proposed"] else None,
              "tokens_per_verify": round((o["accepted"] + o["drafts"]) / o["drafts"], 2) if o["drafts"] else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = WorkerSettings.model_fields
    parser.add_argument("--k", type=int, default=defaults["num_speculative_tokens"].default,
                        help="num_speculative_tokens")
    parser.add_argument("--ngram-min", type=int, default=defaults["ngram_min"].default)
    parser.add_argument("--ngram-max", type=int, default=defaults["ngram_max"].default)
    parser.add_argument("--disable-by-batch-size", type=int,
                        default=defaults["speculative_disable_by_batch_size"].default)
    parser.add_argument("--single-requests", type=int, default=16,
                        help="requests run one after another at concurrency 1")
    parser.add_argument("--workloads", default="lookup,W")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each mode at concurrency 16 (median)")
    parser.add_argument("--draft-layers", type=int, default=0,
                        help="also a draft model at concurrency 1: the default model's first N layers "
                             "(an untrained early exit; no smaller model with its tokenizer is at hand)")
    args = parser.parse_args()

    settings = WorkerSettings(_env_file=None)
    tok = Tokenizer(prepare_model(settings))
    model = load_model(weights_dir(settings), torch.device("cpu"), torch.float32)
    workloads = {}
    for name in args.workloads.split(","):
        data = json.loads((ROOT / "benchmarks" / f"workload_{name.lower()}.json").read_text())
        prompts = [tok.encode_chat(m) for m in data["messages"]][:16]
        ignore_eos = name == "W"
        workloads[name] = (prompts, SamplingParams(temperature=0, max_tokens=data["max_tokens"], ignore_eos=ignore_eos))
    report = {"k": args.k, "ngram": [args.ngram_min, args.ngram_max],
              "disable_by_batch_size": args.disable_by_batch_size, "threads": torch.get_num_threads(),
              "dtype": "float32", "results": []}
    draft = None
    if args.draft_layers:
        folder = Path(tempfile.mkdtemp()) / "draft"
        draft = load_model(first_layers(weights_dir(settings), folder, args.draft_layers), torch.device("cpu"),
                           torch.float32)
        report["draft_layers"] = args.draft_layers
    warm_up = workloads[next(iter(workloads))][0][:2]
    run(model, tok, warm_up, SamplingParams(temperature=0, max_tokens=8))
    for name, (prompts, params) in workloads.items():
        for concurrency in (1, 16):
            subset = prompts[:args.single_requests] if concurrency == 1 else prompts

            def lookup(pause: int):
                return lambda runner: Speculator(NgramProposer(args.k, args.ngram_min, args.ngram_max), args.k, pause)
            modes = {"off": lambda runner: None, "lookup": lookup(0)}
            if draft is not None and concurrency == 1:
                label = f"draft model (first {args.draft_layers} layers)"
                modes[label] = lambda runner: Speculator(DraftProposer.beside(runner, draft), args.k)
            if concurrency > (pause := args.disable_by_batch_size) > 0:
                modes[f"lookup, paused above batch {pause}"] = lookup(pause)
            print(f"# {name}, concurrency {concurrency}: {', '.join(modes)}", file=sys.stderr)
            results = measure(model, tok, subset, params, concurrency, modes, args.rounds)
            off = results["off"]
            for mode, result in results.items():
                row = {"workload": name, "concurrency": concurrency, "mode": mode, "requests": len(subset),
                       **{k: v for k, v in result.items() if k != "outputs"},
                       "vs_off": round(result["tok_per_s"] / off["tok_per_s"], 2),
                       "identical": result["outputs"] == off["outputs"]}
                report["results"].append(row)
                print(json.dumps(row), file=sys.stderr)
    print(json.dumps(report, indent=1))
    print()
    print_table(["workload", "concurrency", "speculation", "tok/s", "vs off", "acceptance", "tokens per verify",
                 "steps", "identical to off"],
                [(r["workload"], r["concurrency"], r["mode"], r["tok_per_s"], f"{r['vs_off']}×",
                  r.get("acceptance", ""), r.get("tokens_per_verify", ""), r["steps"],
                  "yes" if r["identical"] else "NO")
                 for r in report["results"]])
    print_machine(machine(report["dtype"], report["threads"]))


if __name__ == "__main__":
    main()
