"""Random weights in a k-quant's shape, for the kernel tests and benchmarks/quant_kernels.py."""
from __future__ import annotations

import torch

from worker.model.quantized import QuantizedWeight


def stepped_weight(n: int, k: int, bits: int, group: int, per: int, offset: bool, gen: torch.Generator) -> QuantizedWeight:
    """A k-quant's shape of weight: each group's scale (and offset) a small integer times an
    fp16 step its `per` groups share (Q4_K: 4-bit, groups of 32, 8 a step, offsets; Q6_K: 8-bit,
    groups of 16, 16 a step, signed integers)."""
    low, high = (-128, 128) if bits == 8 else (0, 16)
    q = torch.randint(low, high, (n, k), generator=gen, dtype=torch.int8)
    supers = k // group // per

    def stepped(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        steps = (torch.rand((n, supers), generator=gen) * 0.01).half().float()
        steps[0, 0] = 0  # a block of zeros: its integers are 0
        whole = torch.randint(lo, hi, (n, k // group), generator=gen).float()
        return steps, steps.repeat_interleave(per, dim=1) * whole
    steps, scale = stepped(-128, 128) if bits == 8 else stepped(0, 64)
    offset_steps, offsets = stepped(0, 64) if offset else (None, None)
    return QuantizedWeight(q, scale, offsets, group, bits, steps, offset_steps)
