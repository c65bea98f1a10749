"""A llama-family or Gemma 3 model whose projections, embedding and head stay quantized in memory.

A module whose weight is quantized carries it as `module.quantized` (a QuantizedWeight) and
holds an empty placeholder as its `weight`: the GGUF loader (worker/model/gguf_weights.py) builds
models this way, and `compress` (STREAMQ_QUANTIZATION) turns a float model into one. The
paged runner's fused layers then project through the quantized kernels, the embedding gathers
and dequantises only the step's rows, and no float copy of a quantized weight is ever held.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc

import torch
from torch import nn

from worker.model.quantized import QuantizedWeight, quantize

# The llama-family model types the paged runner serves on its fused layers (and keeps quantized).
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3"})

# Each decoder layer's projections, by their module paths in transformers' llama-family layers
# (Phi-3 holds q, k, v in one qkv_proj and gate, up in one gate_up_proj): a layer has some of them.
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj", "mlp.down_proj")
BITS = {"int8": 8, "int4": 4}
GROUP = 32  # k per scale: Q8_0's and Q4_0's block


def quantized(module: nn.Module) -> QuantizedWeight | None:
    return getattr(module, "quantized", None)


def is_quantized(model: nn.Module) -> bool:
    return any(quantized(module) is not None for module in model.modules())


def projections(layer: nn.Module) -> list[nn.Module]:
    """The decoder layer's projection modules (those of PROJECTIONS it has)."""
    found = []
    for path in PROJECTIONS:
        try:
            found.append(layer.get_submodule(path))
        except AttributeError:
            continue
    return found


def compress(model: nn.Module, method: str) -> None:
    """Weight-only, group-wise compression at load (`method`: int8 or int4) of every projection
    and the head; a head tied to the embedding shares its quantized weight with it."""
    bits = BITS[method]
    for layer in model.model.layers:
        for module in projections(layer):
            _quantize_module(module, bits)
    embed, head = model.model.embed_tokens, model.lm_head
    tied = head.weight is embed.weight
    _quantize_module(head, bits)
    if tied:
        embed.quantized = head.quantized
        _drop(embed)
    # An untied embedding stays in float: a step reads only its own rows of it.


def _quantize_module(module: nn.Module, bits: int) -> None:
    module.quantized = quantize(module.weight.data, bits, GROUP)
    _drop(module)


def _drop(module: nn.Module) -> None:
    """Free a module's float weight: an empty placeholder keeps its dtype and device."""
    w = module.weight
    module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)


class QuantizedEmbedding(nn.Module):
    """The token embedding over a quantized table: each step dequantises only its tokens' rows,
    from the table itself or, for an embedding tied to the head, from the head's packed copy
    (`head`, a QuantLinear), so the model holds the table once."""

    def __init__(self, table: QuantizedWeight, dtype: torch.dtype, scale: float = 1.0, head=None):
        super().__init__()
        self.table = None if head is not None else table  # what this module alone holds
        self.dtype, self.scale = dtype, scale
        self._rows = head.rows if head is not None else (lambda ids: table.rows(ids).dequantize())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._rows(ids.reshape(-1)).to(self.dtype)
        if self.scale != 1.0:  # embeddings a model scales (Gemma: by sqrt(hidden))
            rows = rows * self.scale
        return rows.view(*ids.shape, -1)


def install_embedding(model: nn.Module, dtype: torch.dtype, head=None) -> None:
    """Swap a quantized embedding's module for one the runner can call like the original; `head`:
    the runner's head projection (a QuantLinear), read from where the embedding is tied to it."""
    embed = model.model.embed_tokens
    table = quantized(embed)
    if table is None or isinstance(embed, QuantizedEmbedding):
        return
    tied = head is not None and quantized(model.lm_head) is table
    model.model.embed_tokens = QuantizedEmbedding(table, dtype, float(getattr(embed, "embed_scale", 1.0)),
                                                  head if tied else None)


def release_projections(model: nn.Module) -> None:
    """Drop the modules' references to their quantized weights once a runner's fused Weights hold
    them packed (unpacked, a 4-bit code takes a byte); no other runner can be built on the model
    after. A quantized embedding keeps its table. A model with nothing quantized is left as it is.
    Then the freed heap goes back to the system (glibc keeps it resident otherwise: a 1.5B Q4_K_M
    worker held 3.9 GB where 2.0 GB are in use)."""
    if not is_quantized(model):
        return
    for module in [*(m for layer in model.model.layers for m in projections(layer)), model.lm_head]:
        if quantized(module) is not None:
            del module.quantized
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim); nothing where the C library
    has no such call."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def vocab_size(model: nn.Module) -> int:
    """The logits' width, also where the head's float weight is a placeholder."""
    head = model.get_output_embeddings()
    table = quantized(head)
    return table.shape[0] if table is not None else int(head.weight.shape[0])


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights the model holds: float parameters and buffers, plus quantized tables
    (each counted once, however many modules share it)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        table = module.table if isinstance(module, QuantizedEmbedding) else quantized(module)
        if table is not None:
            seen[id(table)] = table.nbytes()
    floats = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters() if p.numel()}
    return sum(seen.values()) + sum(floats.values())
