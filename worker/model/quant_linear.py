"""A projection over a weight kept quantized (worker/model/quantized.py): x @ dequantize(w).T (+ bias).

Decoding a few tokens streams every weight once a step, so its time is the weight's bytes: the
codes stay 4 or 8 bits wide in memory, and nothing holds a float copy of the weight. Where the
step kernels run on this CPU (AVX2 or AVX-512) the weight is packed once for their quant_linear,
which widens the codes in registers and computes each row alone (its result does not hang on the
other rows of the call). Elsewhere, or with the ISA held to "portable", the portable path
dequantizes a slice of the weight's rows at a time and runs F.linear on it.

torch's own CPU kernels hold other formats: `_weight_int8pack_mm` one scale per output row (no
groups), `_weight_int4pack_mm_for_cpu` (q - 8) * scale + zero in groups of 32 or more, where our
offset would become zero = 8 * scale - offset, rounded in fp32 (exact for Q4_0 alone).
benchmarks/quant_kernels.py measures them beside these kernels.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from worker.model.quantized import QuantizedWeight

# Bytes of fp32 weight the portable path dequantizes at once: bounded whatever the weight's size.
PORTABLE_SLICE_BYTES = 16 << 20
_float_activations = threading.local()


@contextlib.contextmanager
def float_activations() -> Iterator[None]:
    """Within it, in this thread, the projections packed for int8 activations compute with fp32
    ones instead: the weight's rows dequantized a slice at a time (exact values; slower). Pooling
    (embeddings, rerank scores) runs so: int8-rounded activations moved an embedding by a cosine of
    about 0.998 and a yes/no score by up to 0.1 on the default model (docs/benchmarks.md)."""
    before = getattr(_float_activations, "on", False)
    _float_activations.on = True
    try:
        yield
    finally:
        _float_activations.on = before


def float_activations_on() -> bool:
    return getattr(_float_activations, "on", False)


class QuantLinear:
    """x [M, K] (fp32 or bf16) @ w.T + bias -> [M, N] in x's dtype, computed in fp32."""

    def __init__(self, w: QuantizedWeight, bias: torch.Tensor | None, kernels: ModuleType | Any | None = None):
        self.n, self.k = w.shape
        self.group, self.bits, self.bias, self.per = w.group, w.bits, bias, 0
        isa = getattr(kernels, "isa", "auto") if kernels is not None else "portable"
        self.isa = "portable" if kernels is None or not kernels.isas else isa
        # int8 activations on VNNI where "auto" picks it or it is asked for, and the groups are whole quads
        self.int8 = (self.isa != "portable" and (kernels.isas[0] if isa == "auto" else isa) == "avx512vnni"
                     and w.group % 4 == 0)
        if self.isa == "portable":
            self.packed, self.codes = None, _pack_codes(w.q, w.bits)
            self.scale, self.offset = w.scale, w.offset
        elif self.int8:  # a k-quant's super-blocks packed as such: a byte a group's scale, not a float
            if w.bits == 8 and int(w.q.min()) >= -32 and int(w.q.max()) <= 31:
                self.bits = 6  # Q6_K's, Q5_*'s (and 4-bit codes widened beside them) held 6 bits wide
            self.packed = kernels.pack_quantized_int8(w.q, w.scale, w.offset, self.bits, w.steps, w.offset_steps)
            self.per = w.per
            self.linear = functools.partial(kernels.quant_linear_int8, per=self.per)
            self.read_rows = functools.partial(kernels.quantized_int8_rows, per=self.per)
        else:
            self.packed = kernels.pack_quantized(w.q, w.scale, w.offset, w.bits)
            self.linear, self.read_rows = kernels.quant_linear, kernels.quantized_rows

    @property
    def row_independent(self) -> bool:
        """Whether a row's result is the same whatever other rows share the call."""
        return self.packed is not None

    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.numel()
        return self.codes.numel() + sum(t.numel() * 4 for t in (self.scale, self.offset) if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8:
            if float_activations_on():
                return self._sliced(x, lambda rows: self.rows(torch.arange(rows.start, rows.stop)))
            return self.linear(x, self.packed, self.n, self.group, self.bits, self.bias)
        if self.packed is not None:
            return self.linear(x, self.packed, self.n, self.group, self.bits, self.bias, self.isa)
        return self._portable(x)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the weight, dequantized to fp32 [len(index), K]: a tied embedding's
        lookup reads the head's own packed table, so the model holds the table once; the kernels
        read their own packing back (its layout is written once, in worker/model/csrc)."""
        if self.packed is None:
            return QuantizedWeight(_unpack_codes(self.codes[index], self.bits), self.scale[index],
                                   None if self.offset is None else self.offset[index], self.group,
                                   self.bits).dequantize()
        return self.read_rows(self.packed, index.to(torch.long), self.group, self.bits)

    def projection(self, ops: ModuleType) -> Any | None:
        """This projection for the step kernels' one-token Layers; None on the portable path."""
        if self.packed is None:
            return None
        if self.int8:
            return ops.Projection.quantized_int8(self.packed, self.n, self.group, self.bits, self.bias, self.per)
        return ops.Projection.quantized(self.packed, self.n, self.group, self.bits, self.bias, self.isa)

    def _portable(self, x: torch.Tensor) -> torch.Tensor:
        def dequantized(rows: slice) -> torch.Tensor:
            return QuantizedWeight(_unpack_codes(self.codes[rows], self.bits), self.scale[rows],
                                   None if self.offset is None else self.offset[rows], self.group,
                                   self.bits).dequantize()
        return self._sliced(x, dequantized)

    def _sliced(self, x: torch.Tensor, dequantized) -> torch.Tensor:
        """x @ w.T + bias in fp32, the weight's rows dequantized (`dequantized(rows)`) a bounded slice at a time."""
        xf = x.to(torch.float32)
        bias = None if self.bias is None else self.bias.to(torch.float32)
        step = max(32, PORTABLE_SLICE_BYTES // (4 * self.k))
        parts = []
        for start in range(0, self.n, step):
            rows = slice(start, min(start + step, self.n))
            parts.append(F.linear(xf, dequantized(rows), None if bias is None else bias[rows]))
        return torch.cat(parts, dim=1).to(x.dtype)


def _pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """4-bit codes two a byte (k even in the low nibble); 8-bit ones as they are."""
    if bits == 8:
        return q.contiguous()
    if q.min() < 0 or q.max() > 15:
        raise ValueError("4-bit codes must be 0..15")
    return (q[:, 0::2] | (q[:, 1::2] << 4)).view(torch.uint8)


def _unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes
    return torch.stack((codes & 15, codes >> 4), dim=-1).view(codes.shape[0], -1).view(torch.int8)
