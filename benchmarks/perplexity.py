"""Perplexity of a fixed public-domain text (benchmarks/data/declaration.txt) through the engine's
own paged forward, for the model's weights in each format, beside llama.cpp's llama-perplexity on
the same GGUF file, in one run.

    .venv/bin/python benchmarks/perplexity.py [--model FILE.gguf] [--ctx 256]

The method is llama-perplexity's, so the figures compare: the text's tokens (BOS first where the
tokenizer adds one) cut into chunks of `ctx`; each chunk runs alone from position 0 (its first
token replaced by BOS where the model takes one); the negative log-likelihood of each token of a
chunk's second half, given the tokens before it in the chunk, averaged over every chunk; PPL = e^that.
Rows: the GGUF kept quantized (its own formats), dequantized to fp32, and the fp32 copy compressed
at load with STREAMQ_QUANTIZATION=int8 and int4. Quantized rows run on each kind of activation this
CPU has: fp32 (the widest of avx512 and avx2) and, with AVX-512 VNNI, int8 (`avx512vnni`).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import cpu_flags, cpu_model, print_table
from shared.model_paths import gguf_file, prepare_model
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from worker.model import kernels
from worker.model.batch import Chunk, SchedulerOutput
from worker.model.model_loader import load_weights
from worker.model.model_runner import PagedRunner

TEXT = ROOT / "benchmarks" / "data" / "declaration.txt"
FORMATS = {"GGUF as stored (quantized)": {"gguf_weights": "quantized"},
           "dequantized, fp32": {"gguf_weights": "dequantized"},
           "fp32 compressed: int8": {"gguf_weights": "dequantized", "quantization": "int8"},
           "fp32 compressed: int4": {"gguf_weights": "dequantized", "quantization": "int4"}}


def token_ids(settings: WorkerSettings, text: str) -> tuple[list[int], int | None]:
    """The text's ids (with BOS where the tokenizer adds one) and the BOS id it adds (or None)."""
    tok = Tokenizer(prepare_model(settings, weights=False))
    ids = tok.encode(text)
    bos = tok.vocabulary().get(tok.bos_token) if tok.bos_token else None
    return ids, bos if bos is not None and ids[:1] == [bos] else None


@torch.inference_mode()
def perplexity(runner: PagedRunner, ids: list[int], ctx: int, bos: int | None) -> tuple[float, int]:
    """llama-perplexity's estimate over `ids` in chunks of `ctx`; also how many tokens it scored."""
    blocks = list(range(-(-ctx // runner.block_size)))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - ctx + 1, ctx):
        chunk = ids[start:start + ctx]
        inputs = ([bos] + chunk[1:]) if bos is not None else chunk
        logits = runner.execute(SchedulerOutput([Chunk(None, 0, inputs, blocks, ctx)])).to(torch.float64)
        first = ctx // 2
        logp = torch.log_softmax(logits[first:ctx - 1], dim=-1)
        targets = torch.tensor(chunk[first + 1:ctx])
        nll -= logp.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count), count


def ours(model: str, ctx: int, text: str, **overrides: str) -> tuple[float, int, float]:
    settings = WorkerSettings(_env_file=None, model=model, dtype="float32", **overrides)
    ids, bos = token_ids(settings, text)
    net = load_weights(settings, torch.device("cpu"), torch.float32)
    runner = PagedRunner(net, torch.device("cpu"), -(-ctx // 16), 16, kernels.load(settings))
    ppl, count = perplexity(runner, ids, ctx, bos)
    return ppl, count, runner.weight_bytes() / 2**20


def llama_cpp(gguf: Path, ctx: int) -> float | None:
    try:
        built = subprocess.run([str(ROOT / "scripts" / "llama-cpp.sh")], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        print(f"# llama.cpp not built: {exc.stderr[-500:]}", file=sys.stderr)
        return None
    binary = Path(built.stdout.strip().splitlines()[-1]) / "bin" / "llama-perplexity"
    out = subprocess.run([str(binary), "-m", str(gguf), "-f", str(TEXT), "-c", str(ctx), "-b", str(ctx),
                          "-t", str(os.cpu_count())], capture_output=True, text=True)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not match:
        print(f"# llama-perplexity gave no estimate:\n{(out.stdout + out.stderr)[-2000:]}", file=sys.stderr)
        return None
    return float(match[1])


def activation_isas() -> dict[str, str]:
    """The ISAs to hold quantized rows to: the widest with fp32 activations, and avx512vnni's int8."""
    built = kernels.load()
    runs = built.isas if built is not None else []
    return {"fp32 activations": kernels.widest_fp32(built),
            **({"int8 activations": "avx512vnni"} if "avx512vnni" in runs else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="STREAMQ_MODEL: a GGUF file (default: the default model's)")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=list(FORMATS))
    args = parser.parse_args()
    text = TEXT.read_text()
    gguf = gguf_file(WorkerSettings(_env_file=None, model=args.model))
    rows, stored = [], []
    for name in args.formats:
        quantized = FORMATS[name] != FORMATS["dequantized, fp32"]
        for kind, isa in (activation_isas() if quantized else {"": "auto"}).items():
            ppl, count, mib = ours(args.model, args.ctx, text, cpu_isa=isa, **FORMATS[name])
            rows.append([f"streamq, {name}" + (f", {kind} ({isa})" if kind else ""), f"{ppl:.4f}", count, f"{mib:.0f}"])
            print(f"# {rows[-1]}", file=sys.stderr)
            if name == "GGUF as stored (quantized)":
                stored.append((rows[-1][0], ppl))
    reference = llama_cpp(gguf, args.ctx) if gguf is not None else None
    if reference is not None:
        rows.append(["llama.cpp llama-perplexity, same GGUF", f"{reference:.4f}", "", ""])
    print(f"\n{gguf.name if gguf else args.model}, {TEXT.name}, ctx {args.ctx}\n")
    print_table(["weights", "PPL", "tokens scored", "weights the steps read, MiB"], rows)
    for name, ppl in stored if reference is not None else []:
        print(f"\n{name} / llama.cpp: {ppl / reference:.4f}")
    print(f"\nMachine: {cpu_model()} (flags: {' '.join(cpu_flags())})")


if __name__ == "__main__":
    main()
