"""Weights kept quantized in memory: one format for a GGUF file's blocks and for load-time compression.

A projection's weight [N, K] is stored as small integer codes with, per row and per group of
`group` consecutive k, a scale and an offset:

    w[n, k] = q[n, k] * scale[n, k // group] - offset[n, k // group]

Every block format this project serves (worker/model/gguf_blocks.py DECODERS, the one list of them,
with each one's group and bits) maps onto it exactly: the products are of an fp16 and a small
integer, exact in fp32. For example Q8_0 (offset 0), Q4_0 (codes 0..15, offset 8 * d), Q4_1
(offset -m), Q4_K (scale d * sc, offset dmin * m), Q5_0 / Q5_1 / Q5_K (codes 0..31 stored 8 bits
wide), Q6_K (codes -32..31, group 16). `bits` is the width the codes are stored in: 4 packs two
codes a byte, 8 one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPS = (16, 32, 64, 128)


@dataclass
class QuantizedWeight:
    q: torch.Tensor  # int8 [N, K]: codes, 0..15 where bits == 4
    scale: torch.Tensor  # float32 [N, K // group]
    offset: torch.Tensor | None  # float32 [N, K // group], or None for 0
    group: int
    bits: int  # 4 or 8
    steps: torch.Tensor | None = None  # float32 [N, K // group // per]: scale = step * an int8, exactly
    offset_steps: torch.Tensor | None = None  # the same for offset, where there are both

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.q.dtype != torch.int8 or self.bits not in (4, 8) or self.group not in GROUPS or k % self.group:
            raise ValueError(f"bad quantized weight: q {self.q.dtype} {tuple(self.q.shape)}, bits {self.bits}, "
                             f"group {self.group}")
        if self.scale.shape != (n, k // self.group) or (self.offset is not None and self.offset.shape != self.scale.shape):
            raise ValueError(f"scales {tuple(self.scale.shape)} do not fit q {tuple(self.q.shape)} in groups of "
                             f"{self.group}")
        if self.steps is not None:
            supers = self.steps.shape[1] if self.steps.dim() == 2 else 0
            if self.steps.shape[0] != n or not supers or (k // self.group) % supers:
                raise ValueError(f"steps {tuple(self.steps.shape)} do not fit scales {tuple(self.scale.shape)}")
            if (self.offset_steps is None) != (self.offset is None) or (
                    self.offset_steps is not None and self.offset_steps.shape != self.steps.shape):
                raise ValueError("offset steps go with offsets, shaped as the steps")
        elif self.offset_steps is not None:
            raise ValueError("offset steps without steps")

    @property
    def per(self) -> int:
        """Groups a step holds, or 0 where the weight has no steps."""
        return 0 if self.steps is None else self.scale.shape[1] // self.steps.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in `dtype`: the reference every kernel is tested against."""
        n, k = self.q.shape
        groups = self.q.view(n, k // self.group, self.group).to(torch.float32) * self.scale.unsqueeze(-1)
        if self.offset is not None:
            groups = groups - self.offset.unsqueeze(-1)
        return groups.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation or a selection), still quantized."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]
        return QuantizedWeight(self.q[index], self.scale[index], pick(self.offset), self.group, self.bits,
                               pick(self.steps), pick(self.offset_steps))

    def nbytes(self) -> int:
        """Bytes this weight holds in memory as packed (codes at `bits`, scales and offsets fp32)."""
        codes = self.q.numel() * self.bits // 8
        return codes + 4 * self.scale.numel() * (1 if self.offset is None else 2)


def quantize(w: torch.Tensor, bits: int, group: int = 32) -> QuantizedWeight:
    """Weight-only, group-wise compression of a float weight [N, K] (STREAMQ_QUANTIZATION):
    int8 symmetric (codes -127..127, offset 0); int4 asymmetric (codes 0..15 spanning each
    group's min to max)."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"K={k} is not a multiple of the group {group}")
    g = w.detach().to(torch.float32).view(n, k // group, group)
    if bits == 8:
        scale = g.abs().amax(-1).clamp_min(1e-12) / 127
        q = torch.round(g / scale.unsqueeze(-1)).clamp(-127, 127)
        return QuantizedWeight(q.to(torch.int8).view(n, k), scale.contiguous(), None, group, 8)
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
        return QuantizedWeight(q.to(torch.int8).view(n, k), scale.contiguous(), (-lo).contiguous(), group, 4)
    raise ValueError(f"bits must be 4 or 8, not {bits}")


def _widened(w: QuantizedWeight, bits: int, group: int, with_offset: bool, with_steps: bool) -> QuantizedWeight:
    """`w` in a format that holds it exactly: wider code storage (4-bit codes are 0..15, valid at 8
    bits too), smaller groups (each scale repeated; a step then holds more of them), or a zero
    offset (and offset step) where it had none; its steps kept where `with_steps`."""
    repeat = w.group // group
    scale = w.scale.repeat_interleave(repeat, dim=1) if repeat > 1 else w.scale
    offset = w.offset
    if offset is not None and repeat > 1:
        offset = offset.repeat_interleave(repeat, dim=1)
    steps = w.steps if with_steps else None
    offset_steps = w.offset_steps if with_steps else None
    if offset is None and with_offset:
        offset = torch.zeros_like(scale)
        offset_steps = None if steps is None else torch.zeros_like(steps)
    return QuantizedWeight(w.q, scale, offset, group, bits, steps, offset_steps)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """The weights stacked along N (q, k, v into one qkv; gate and up into one), still quantized.

    Parts of different formats (a Q4_K_M file has Q4_K q and k but Q6_K v) are first widened to one
    that holds each exactly: the largest `bits`, the smallest `group` and an offset if any part has
    one, so the result dequantizes to torch.cat of the parts' dequantized weights, bit for bit.
    """
    if not weights:
        raise ValueError("concat_rows needs at least one weight")
    if len(weights) == 1:
        return weights[0]
    ks = {w.shape[1] for w in weights}
    if len(ks) > 1:
        raise ValueError(f"cannot stack weights of different K: {sorted(ks)}")
    bits = max(w.bits for w in weights)
    group = min(w.group for w in weights)
    if any(w.group % group for w in weights):
        raise ValueError(f"groups {[w.group for w in weights]} do not divide into {group}")
    with_offset = any(w.offset is not None for w in weights)
    # steps kept where every part has them over the same span of k (so the same count a row)
    with_steps = all(w.steps is not None for w in weights) and len({w.steps.shape[1] for w in weights}) == 1
    parts = [_widened(w, bits, group, with_offset, with_steps) for w in weights]

    def cat(name: str) -> torch.Tensor | None:
        found = [getattr(p, name) for p in parts]
        return None if found[0] is None else torch.cat(found)
    return QuantizedWeight(torch.cat([p.q for p in parts]), cat("scale"), cat("offset"), group, bits, cat("steps"),
                           cat("offset_steps"))
