"""Structured outputs' cost: workload W free, under a JSON schema, and half and half, in one run.

    .venv/bin/python benchmarks/structured.py [--dtype bfloat16] [--rounds 2]

W's 32 chat prompts at once, 64 new tokens each, greedy, through the built-in engine in this
process (as benchmarks/engine.py). The constrained requests follow a JSON schema that cannot be
complete within 64 tokens (an array of at least 200 one-digit integers), so every request
decodes all 64 tokens under its constraint and each run does the same work: the difference is
the masks (computed for every constrained row at every step) and their application. The
constrained runs also go with the masks computed during the forward (as the engine does on an
accelerator) instead of after it (on the CPU). Rounds
alternate the order of the runs; medians are reported. Also: the api's compile time per
schema (llguidance's grammar built and validated, as the api's grammar pool runs it) and the
worker's matcher build time, over the schemas of tests/e2e/test_structured_outputs.py and this one.
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
from shared.messages import RequestPayload
from shared.model_paths import prepare_model, weights_dir
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.structured import StructuredOutputs
from shared.tokenizer import Tokenizer
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.model_loader import load_model, pick_dtype
from worker.model.model_runner import PagedRunner

LONG = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 200}
SCHEMAS = {
    "array of 200+ digits": LONG,
    "city (strict object)": {"type": "object", "additionalProperties": False,
                             "required": ["name", "population", "capital", "region"],
                             "properties": {"name": {"type": "string", "maxLength": 8},
                                            "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999},
                                            "capital": {"type": "boolean"}, "region": {"enum": ["north", "south"]}}},
    "any object": {"type": "object"},
    "order with nested items": {"type": "object", "required": ["id", "items"], "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "items": {"type": "object", "required": ["sku", "qty"], "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}}},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}},
}


def run(engine: Engine, prompts: list[list[int]], constrained: list[bool], new_tokens: int,
        overlap: bool = True) -> dict:
    """`overlap`: the masks computed while the model runs (the engine's way on an accelerator),
    else in the sampler after it (on the CPU)."""
    engine.overlap_masks = overlap
    started = time.perf_counter()
    seqs = engine.generate([RequestPayload(id=f"r{i}", model="m", prompt_token_ids=prompt, params=SamplingParams(
        temperature=0, max_tokens=new_tokens, ignore_eos=True, structured_outputs={"json": LONG} if constrain else None))
        for i, (prompt, constrain) in enumerate(zip(prompts, constrained))])
    wall = time.perf_counter() - started
    tokens = sum(len(s.output_ids) for s in seqs)
    assert tokens == len(prompts) * new_tokens, "every request decodes all its tokens"
    return {"wall_s": wall, "tok_per_s": tokens / wall}


def compile_times(tokenizer: Tokenizer, vocab: int) -> list[dict]:
    from llguidance import LLMatcher
    from worker.engine.structured import Grammars

    grammars = Grammars(tokenizer, vocab)
    grammars.matcher(SamplingParams(structured_outputs={"json_object": True}), [])  # the tokenizer, once
    rows = []
    for name, schema in SCHEMAS.items():
        began = time.perf_counter()
        constraint = StructuredOutputs.model_validate({"json": schema})
        assert constraint.compile_error() == ""
        api_ms = 1000 * (time.perf_counter() - began)
        began = time.perf_counter()
        matcher = grammars.matcher(SamplingParams(structured_outputs=constraint), [])
        worker_ms = 1000 * (time.perf_counter() - began)
        assert isinstance(matcher, LLMatcher)
        rows.append({"schema": name, "api_compile_ms": round(api_ms, 2), "worker_matcher_ms": round(worker_ms, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=str(pick_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
                        choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = WorkerSettings()
    tok = Tokenizer(prepare_model(settings))
    model = load_model(weights_dir(settings), torch.device("cpu"), getattr(torch, args.dtype))
    runner = PagedRunner(model, torch.device("cpu"), 4096, 16, kernels.load())
    engine = Engine(runner, tok, Batcher(BlockManager(4096, 16, True), 32, 2048))
    workload = json.loads((ROOT / "benchmarks" / "workload_w.json").read_text())
    prompts = [tok.encode_chat(m) for m in workload["messages"]]
    new_tokens = workload["max_tokens"]
    every, half = [True] * len(prompts), [i % 2 == 0 for i in range(len(prompts))]
    runs = {"free": ([False] * len(prompts), False), "all under a JSON schema": (every, False),
            "half under a JSON schema": (half, False), "all, masks during the forward": (every, True),
            "half, masks during the forward": (half, True)}
    run(engine, prompts[:4], [True, False, True, False], 4)  # warm-up: kernels, the llguidance tokenizer
    results: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            results[name].append(run(engine, prompts, runs[name][0], new_tokens, runs[name][1])["tok_per_s"])
            print(f"# round {r + 1}: {name} {results[name][-1]:.1f} tok/s", file=sys.stderr)
    free = statistics.median(results["free"])
    rows = [{"run": name, "tok_per_s": round(statistics.median(v), 1),
             "each_round": " / ".join(f"{x:.1f}" for x in v), "vs_free": round(statistics.median(v) / free, 3)}
            for name, v in results.items()]
    compiles = compile_times(tok, runner.vocab_size)
    report = {"machine": machine(args.dtype, torch.get_num_threads()), "w": rows, "compile": compiles}
    print(json.dumps(report, indent=1))
    print_table(["run", "W tok/s (median)", "each round", "vs free"], [list(r.values()) for r in rows])
    print_table(["schema", "api compile ms", "worker matcher ms"], [list(r.values()) for r in compiles])
    print_machine(report["machine"])


if __name__ == "__main__":
    main()
