"""GGUF tensors read into memory as they are stored: block-quantized ones as QuantizedWeight, never
through float.

Each decoder turns an array of raw blocks [n_blocks, type_size] (uint8) into the codes, scales and
offsets of worker/model/quantized.py, with whole-array numpy operations (a 0.5B model has millions of
blocks). The result dequantizes to exactly what gguf's own `gguf.quants.dequantize` gives for the
same bytes: the layouts below follow gguf-py's reference dequantizers (and llama.cpp's
ggml-quants.c), and every product of an fp16 and a small integer is exact in fp32.
"""
from __future__ import annotations

import struct
import sys
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize as gguf_dequantize

from worker.model.quantized import QuantizedWeight

T = GGMLQuantizationType
_CHUNK_BLOCKS = 1 << 16  # blocks decoded at a time: bounds the temporaries of a large tensor

# (codes int8 [n, block], scale fp32 [n, block // group], offset fp32 or None), and for the
# k-quants the block's steps (fp32 [n, 1]: scale = step * an int8 exactly) and offset step or None
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None] | tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                    np.ndarray, np.ndarray | None]


class UnsupportedTensorType(ValueError):
    """A tensor whose GGML type this loader does not keep quantized."""


class TensorReader(GGUFReader):
    """A GGUFReader that skips the values of array metadata: the tokenizer's vocabulary, scores and
    merges, which GGUFReader parses entry by entry into small numpy arrays (seconds, and tens of
    MB of objects, for a vocabulary of 50k to 260k). Scalars, strings and all tensors are read as
    usual; an array field keeps its header and has no values.

    gguf's reader has no public way to skip fields: this overrides its private _get_field_parts,
    which is why pyproject pins gguf to the version tested (tests/unit/test_gguf_weights.py)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        if self.byte_order != "I":  # the decoders read fp16 fields in the host's byte order
            raise ValueError(f"{path} is a GGUF file of the other byte order, which this loader does not read")

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        end = self._skip_array(memoryview(self.data), orig_offs)
        return end - orig_offs, [item_type, length], [], [GGUFValueType.ARRAY]

    def _skip_array(self, buf: memoryview, offs: int) -> int:
        """The offset just past the array value at `offs` (its item type, length, then items)."""
        order = "<" if (self.byte_order == "I") == (sys.byteorder == "little") else ">"
        item_type, length = struct.unpack_from(order + "IQ", buf, offs)
        offs += 12
        if item_type == GGUFValueType.STRING:
            for _ in range(length):  # each string: its uint64 length, then its bytes
                offs += 8 + struct.unpack_from(order + "Q", buf, offs)[0]
            return offs
        if item_type == GGUFValueType.ARRAY:
            for _ in range(length):
                offs = self._skip_array(buf, offs)
            return offs
        return offs + length * np.dtype(self.gguf_scalar_to_np[GGUFValueType(item_type)]).itemsize


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of each block, as fp32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray, run: int) -> np.ndarray:
    """Unpack bytes [n, m] holding runs of `run` bytes: each run gives its `run` low nibbles, then
    its `run` high nibbles, as [n, 2 * m] uint8 (how Q4_0/Q4_1/Q4_K/Q5_K/Q6_K order codes)."""
    n, m = packed.shape
    runs = packed.reshape(n, m // run, 1, run)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(n, 2 * m)


def _high_bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Bit i of each of `count` little-endian bits [n, count // 8] bytes -> [n, count] 0/1 uint8."""
    return np.unpackbits(packed, axis=1, count=count, bitorder="little")


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins of a Q4_K/Q5_K block from its 12 bytes: bytes 0-3
    hold scales 0-3 (and the top bits of scales 4-7), bytes 4-7 mins 0-3 (and the top bits of mins
    4-7), bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high)."""
    lo, mid, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q8_0(b: np.ndarray) -> Decoded:  # d, 32 x int8
    return b[:, 2:].view(np.int8), _f16(b, 0), None


def _q4_0(b: np.ndarray) -> Decoded:  # d, 16 bytes of nibbles; w = d * (code - 8)
    d = _f16(b, 0)
    return _nibbles(b[:, 2:], 16).view(np.int8), d, 8 * d


def _q4_1(b: np.ndarray) -> Decoded:  # d, m, 16 bytes of nibbles; w = d * code + m
    return _nibbles(b[:, 4:], 16).view(np.int8), _f16(b, 0), -_f16(b, 2)


def _q5(b: np.ndarray, at: int) -> np.ndarray:  # 4 bytes of fifth bits, then 16 bytes of nibbles
    return _nibbles(b[:, at + 4:], 16) | (_high_bits(b[:, at:at + 4], 32) << 4)


def _q5_0(b: np.ndarray) -> Decoded:  # w = d * (code - 16): signed codes, no offset
    return (_q5(b, 2).view(np.int8) - np.int8(16)), _f16(b, 0), None


def _q5_1(b: np.ndarray) -> Decoded:  # w = d * code + m
    return _q5(b, 4).view(np.int8), _f16(b, 0), -_f16(b, 2)


def _q4_k(b: np.ndarray) -> Decoded:  # d, dmin, 12 scale bytes, 128 bytes of nibbles in runs of 32
    sc, mn = _k_scales(b[:, 4:16])
    d, dmin = _f16(b, 0), _f16(b, 2)
    return _nibbles(b[:, 16:], 32).view(np.int8), d * sc, dmin * mn, d, dmin


def _q5_k(b: np.ndarray) -> Decoded:  # d, dmin, 12 scale bytes, 32 bytes of fifth bits, 128 of nibbles
    sc, mn = _k_scales(b[:, 4:16])
    n = b.shape[0]
    # Bit j of byte i is the fifth bit of code 32 * j + i: sub-block j takes bit j of all 32 bytes.
    high = _high_bits(b[:, 16:48].reshape(n * 32, 1), 8).reshape(n, 32, 8).transpose(0, 2, 1)
    codes = _nibbles(b[:, 48:], 32) | (high.reshape(n, 256) << 4)
    d, dmin = _f16(b, 0), _f16(b, 2)
    return codes.view(np.int8), d * sc, dmin * mn, d, dmin


def _q6_k(b: np.ndarray) -> Decoded:  # 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d
    n = b.shape[0]
    low = _nibbles(b[:, :128], 64)  # per half of 128 codes: 64 low nibbles, then 64 high nibbles
    # Byte i of a half's 32 qh bytes holds, at bits 2j..2j+1, the high bits of code 32 * j + i.
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = low | ((qh & 0x03).reshape(n, 256) << 4)
    d = _f16(b, 208)
    return codes.view(np.int8) - np.int8(32), d * b[:, 192:208].view(np.int8).astype(np.float32), None, d, None


# type -> (decoder, group, bits): how each block format maps onto QuantizedWeight.
DECODERS: dict[GGMLQuantizationType, tuple[Callable[[np.ndarray], Decoded], int, int]] = {
    T.Q8_0: (_q8_0, 32, 8),
    T.Q4_0: (_q4_0, 32, 4),
    T.Q4_1: (_q4_1, 32, 4),
    T.Q5_0: (_q5_0, 32, 8),
    T.Q5_1: (_q5_1, 32, 8),
    T.Q4_K: (_q4_k, 32, 4),
    T.Q5_K: (_q5_k, 32, 8),
    T.Q6_K: (_q6_k, 16, 8),
}
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16, T.F64})  # kept as tensors of their own dtype


def decode_blocks(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedWeight:
    """The weight `shape` = [N, K] whose blocks of type `qtype` are the bytes `raw` (any shape,
    row-major, N * K / block_size blocks), still quantized."""
    decoder, group, bits = DECODERS[qtype]
    block, size = GGML_QUANT_SIZES[qtype]
    n, k = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, size)
    if blocks.shape[0] * block != n * k:
        raise ValueError(f"{blocks.shape[0]} blocks of {qtype.name} do not hold a weight of shape {shape}")
    count = blocks.shape[0]
    codes = np.empty((count, block), np.int8)
    scale = np.empty((count, block // group), np.float32)
    offset = steps = offset_steps = None
    for start in range(0, count, _CHUNK_BLOCKS):
        end = min(start + _CHUNK_BLOCKS, count)
        q, s, o, *stepped = decoder(blocks[start:end])
        codes[start:end], scale[start:end] = q, s
        if o is not None:
            offset = np.empty_like(scale) if offset is None else offset
            offset[start:end] = o
        if stepped:
            steps = np.empty((count, 1), np.float32) if steps is None else steps
            steps[start:end] = stepped[0]
            if stepped[1] is not None:
                offset_steps = np.empty((count, 1), np.float32) if offset_steps is None else offset_steps
                offset_steps[start:end] = stepped[1]

    def rows(a: np.ndarray | None, width: int) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(a).view(n, width)
    return QuantizedWeight(rows(codes, k), rows(scale, k // group), rows(offset, k // group), group, bits,
                           rows(steps, k // block), rows(offset_steps, k // block))


def tensor_dims(tensor: ReaderTensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch's order (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def read_tensor(tensor: ReaderTensor, dequantize_unsupported: bool = False,
                row_order: np.ndarray | None = None) -> QuantizedWeight | torch.Tensor:
    """One tensor of a GGUFReader, copied out of the file's memory map: a QuantizedWeight for the
    block types in DECODERS (2-D only), a tensor of its own dtype for F32/F16/BF16/F64.

    `row_order` reorders the first dimension (row i of the result is row row_order[i] of the
    file), done on the raw rows, before decoding. Any other type raises UnsupportedTensorType, or
    with `dequantize_unsupported` becomes an fp32 tensor through gguf's dequantizer (memory: 4
    bytes a weight).
    """
    dims, qtype = tensor_dims(tensor), tensor.tensor_type
    data = tensor.data if row_order is None else tensor.data[row_order]
    if qtype in FLOAT_TYPES:
        data = np.array(data, order="C")  # a copy: nothing may keep the file mapped
        if qtype == T.BF16:  # the reader gives bf16 as raw bytes
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(dims)
        return torch.from_numpy(data).reshape(dims)
    if qtype in DECODERS and len(dims) == 2:
        return decode_blocks(data, qtype, dims)
    if dequantize_unsupported:
        return torch.from_numpy(np.array(gguf_dequantize(data, qtype))).reshape(dims)
    raise UnsupportedTensorType(
        f"tensor {tensor.name!r} {list(dims)} has GGML type {qtype.name}, which this loader does not keep "
        f"quantized (supported: {', '.join(t.name for t in DECODERS)} as 2-D weights); "
        "pass dequantize_unsupported=True to load it as float"
    )
