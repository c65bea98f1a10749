"""The CPU projection kernels against oneDNN and torch's own quantized matmuls, per call.

    .venv/bin/python benchmarks/quant_kernels.py [--rows 1,4,8,16,32,64,256] [--threads N] [--k-quants]

For each weight shape (N x K, as x @ w.T) and row count: ms per call (the best of a few rounds
of calls, so a busy machine shows its quiet moments) and GB/s of weight streamed (the bytes the
path holds for the weight, over the call's time: what bounds decoding at small row counts).
Paths: oneDNN's prepacked fp32 matmul (Weight without panels), panel_linear fp32 and
quant_linear int8 (group 32) and int4 (group 32, with offsets) on each ISA this CPU runs (on
avx512vnni: quant_linear_int8, activations rounded to int8), and
torch's `_weight_int8pack_mm` (one scale per row: not a format of ours, shown for its speed) and
`_weight_int4pack_mm_for_cpu` (fp32, (q - 8) * scale + zero in groups of 32).

With --k-quants (avx512vnni only): quant_linear_int8 on the super-block packings of a Q4_K_M
file's two kinds of weight at Qwen2.5-1.5B's shapes: gate and up stacked in Q4_K (4-bit codes,
groups of 32, 8 a step, offsets) and down in Q6_K (6-bit codes, groups of 16, 16 a step).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamq.testing.k_quants import stepped_weight
from worker.model import kernels
from worker.model.quantized import quantize

SHAPES = [(576, 1536), (1536, 576), (896, 4864), (4864, 896)]
# name, n, k, code bits, group, groups a step, offsets
K_QUANTS = [("gate+up Q4_K", 2 * 8960, 1536, 4, 32, 8, True), ("down Q6_K", 1536, 8960, 6, 16, 16, False)]


def cpu_header() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return f"cpu: {kernels.cpu_model()}"
    keep = [line for line in lines if line.startswith(("Model name", "Flags", "CPU(s):"))]
    return "\n".join(" ".join(line.split()) for line in keep)


def per_call(fn, budget_s: float) -> float:
    """Best mean seconds per call over 5 rounds, each of about budget_s / 5."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < budget_s / 25:
        fn()
        calls += 1
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(max(calls, 1)):
            fn()
        best = min(best, (time.perf_counter() - start) / max(calls, 1))
    return best


def paths(ops, w: torch.Tensor) -> dict[str, tuple[int, object]]:
    """name -> (weight bytes held, fn(x))."""
    n = w.shape[0]
    out = {}
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    out["oneDNN fp32"] = (w.numel() * 4, lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    panels = ops.pack_panels(w)
    q8, q4 = quantize(w, 8, 32), quantize(w, 4, 32)
    p8 = ops.pack_quantized(q8.q, q8.scale, q8.offset, 8)
    p4 = ops.pack_quantized(q4.q, q4.scale, q4.offset, 4)
    for isa in ops.isas:
        if isa == "avx512vnni":  # int8 activations, its own layout; its float panels are avx512's
            v8 = ops.pack_quantized_int8(q8.q, q8.scale, q8.offset, 8)
            v4 = ops.pack_quantized_int8(q4.q, q4.scale, q4.offset, 4)
            out[f"int8 g32 {isa}"] = (v8.numel(), lambda x, v8=v8: ops.quant_linear_int8(x, v8, n, 32, 8, None))
            out[f"int4 g32 {isa}"] = (v4.numel(), lambda x, v4=v4: ops.quant_linear_int8(x, v4, n, 32, 4, None))
            continue
        out[f"panel fp32 {isa}"] = (panels.numel() * 4, lambda x, isa=isa: ops.panel_linear(x, panels, n, None, isa))
        out[f"int8 g32 {isa}"] = (p8.numel(), lambda x, isa=isa: ops.quant_linear(x, p8, n, 32, 8, None, isa))
        out[f"int4 g32 {isa}"] = (p4.numel(), lambda x, isa=isa: ops.quant_linear(x, p4, n, 32, 4, None, isa))
    row_scale = w.abs().amax(1) / 127
    codes = torch.round(w / row_scale[:, None]).to(torch.int8)
    out["torch int8 (row scale)"] = (codes.numel() + n * 4,
                                     lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, row_scale))
    scale_zero = torch.stack([q4.scale.T, (8 * q4.scale - q4.offset).T], -1).contiguous()
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.q.to(torch.int32), 1)
    out["torch int4 g32"] = (int4.numel() + scale_zero.numel() * 4,
                             lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4, 32, scale_zero))
    return out


def k_quant(ops, n: int, k: int, bits: int, group: int, per: int, offset: bool, gen) -> torch.Tensor:
    """A k-quant's shape of weight (streamq/testing/k_quants.py), 6-bit codes in -32..31, packed
    for quant_linear_int8."""
    w = stepped_weight(n, k, 8 if bits == 6 else bits, group, per, offset, gen)
    if bits == 6:
        w.q = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    return ops.pack_quantized_int8(w.q, w.scale, w.offset, bits, w.steps, w.offset_steps)


def k_quants(ops, rows: list[int], budget: float, gen) -> None:
    if "avx512vnni" not in ops.isas:
        sys.exit(f"--k-quants: this CPU has no avx512vnni (kernels on: {', '.join(ops.isas)})")
    print(f"\n{'k-quant weight':28}" + "".join(f"{r:>16}" for r in rows) + "   (ms per call / GB/s of weight)")
    for name, n, k, bits, group, per, offset in K_QUANTS:
        packed = k_quant(ops, n, k, bits, group, per, offset, gen)
        def call(x, packed=packed, n=n, group=group, bits=bits, per=per):
            return ops.quant_linear_int8(x, packed, n, group, bits, None, per=per)
        cells = []
        for r in rows:
            x = torch.randn((r, k), generator=gen)
            seconds = per_call(lambda x=x, call=call: call(x), budget)
            cells.append(f"{seconds * 1e3:8.3f} /{packed.numel() / seconds / 1e9:5.1f}")
        print(f"{f'{name} {n}x{k}':28}" + "".join(f"{c:>16}" for c in cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,256")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--budget", type=float, default=0.4, help="seconds measured per cell")
    parser.add_argument("--k-quants", action="store_true", help="only the k-quant packings at 1.5B shapes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = kernels.load()
    if ops is None:
        sys.exit("the CPU step kernels did not build")
    print(cpu_header())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernels on: {', '.join(ops.isas) or 'none'}")
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    if args.k_quants:
        k_quants(ops, rows, args.budget, gen)
        return
    for n, k in SHAPES:
        w = torch.randn((n, k), generator=gen) * 0.02
        table = paths(ops, w)
        print(f"\nw {n}x{k} (fp32 {n * k * 4 / 1e6:.1f} MB)   ms per call / GB/s of weight")
        print(f"{'path':24}" + "".join(f"{r:>16}" for r in rows))
        for name, (nbytes, fn) in table.items():
            cells = []
            for r in rows:
                x = torch.randn((r, k), generator=gen)
                seconds = per_call(lambda fn=fn, x=x: fn(x), args.budget)
                cells.append(f"{seconds * 1e3:8.3f} /{nbytes / seconds / 1e9:5.1f}")
            print(f"{name:24}" + "".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
