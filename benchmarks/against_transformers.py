"""Greedy tokens of the worker's engine against transformers' `generate`, for any STREAMQ_MODEL,
at prompt lengths that can run past a sliding window (Gemma 3's is 512, Mistral's 4096).

    STREAMQ_MODEL=/path/to/gemma-3-270m-q4_k_m.gguf STREAMQ_DTYPE=float32 \
        .venv/bin/python benchmarks/against_transformers.py --lengths 40 300 700 1100

The engine is the one a worker builds from the same settings (paged or static); every prompt
runs in one batch. The reference loads the folder the worker loaded its float weights from (a
GGUF's dequantised copy). Prints one line per prompt, a count, and the CPU's model and flags;
exits 1 where any prompt differs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import cpu_flags, cpu_model
from shared.model_paths import weights_dir
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from worker.main import build_engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[40, 300, 700, 1100], help="prompt tokens each")
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args()
    settings = WorkerSettings()
    engine = build_engine(settings)
    runner = getattr(engine, "runner", None)
    fused = getattr(runner, "fused", None)
    held = "" if fused is None else (f", weights {runner.weight_bytes() / 2**20:.0f} MiB "
                                     f"({'quantized' if runner.lm_head.quant is not None else 'float'})")
    print(f"{settings.model}: {type(engine).__name__}, windows {sorted(set(getattr(runner, 'windows', [])))}{held}")
    text = (Path(__file__).resolve().parent / "data" / "declaration.txt").read_text()  # a fixed public-domain text
    prompts = [engine.tokenizer.encode(text[i * 500:])[:n] for i, n in enumerate(args.lengths)]
    began = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    print(f"engine: {time.perf_counter() - began:.1f} s")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights_dir(settings), dtype=torch.float32).eval()
    equal = 0
    for prompt, seq in zip(prompts, seqs):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             do_sample=False)[0, ids.shape[1]:].tolist()
        equal += ref == seq.output_ids
        print(f"prompt {len(prompt)} tokens: {'equal' if ref == seq.output_ids else 'DIFFERENT'}")
    print(f"{equal}/{len(seqs)} equal; CPU: {cpu_model()}, flags {' '.join(cpu_flags())}")
    return 0 if equal == len(seqs) else 1


if __name__ == "__main__":
    sys.exit(main())
