"""A llama-family model whose projections, embedding and head stay quantized in memory.

A module whose weight is quantized carries it as `module.quantized` (a QuantizedWeight) and
holds an empty placeholder as its `weight`: the GGUF loader (worker/gguf_weights.py) builds
models this way, and `compress` (STREAMQ_QUANTIZATION) turns a float model into one. The
paged runner's fused layers then project through the quantized kernels, the embedding gathers
and dequantises only the step's rows, and no float copy of a quantized weight is ever held.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.quantized import QuantizedWeight, quantize

# Each decoder layer's projections, by their module paths in transformers' llama-family layers.
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
BITS = {"int8": 8, "int4": 4}
GROUP = 32  # k per scale: Q8_0's and Q4_0's block


def quantized(module: nn.Module) -> QuantizedWeight | None:
    return getattr(module, "quantized", None)


def is_quantized(model: nn.Module) -> bool:
    return any(quantized(module) is not None for module in model.modules())


def compress(model: nn.Module, method: str) -> None:
    """Weight-only, group-wise compression at load (`method`: int8 or int4) of every projection
    and the head; a head tied to the embedding shares its quantized weight with it."""
    bits = BITS[method]
    for layer in model.model.layers:
        for path in PROJECTIONS:
            _quantize_module(layer.get_submodule(path), bits)
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
    """The token embedding over a quantized table: each step dequantises only its tokens' rows."""

    def __init__(self, table: QuantizedWeight, dtype: torch.dtype, scale: float = 1.0):
        super().__init__()
        self.table, self.dtype, self.scale = table, dtype, scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.rows(ids.reshape(-1)).dequantize(self.dtype)
        if self.scale != 1.0:  # embeddings a model scales (Gemma: by sqrt(hidden))
            rows = rows * self.scale
        return rows.view(*ids.shape, -1)


def install_embedding(model: nn.Module, dtype: torch.dtype) -> None:
    """Swap a quantized embedding's module for one the runner can call like the original."""
    embed = model.model.embed_tokens
    table = quantized(embed)
    if table is not None and not isinstance(embed, QuantizedEmbedding):
        model.model.embed_tokens = QuantizedEmbedding(table, dtype, float(getattr(embed, "embed_scale", 1.0)))


def release_projections(model: nn.Module) -> None:
    """Drop the modules' references to their quantized weights once the runner's fused Weights
    hold them packed (unpacked, a 4-bit code takes a byte). A quantized embedding keeps its table."""
    for module in [*(layer.get_submodule(p) for layer in model.model.layers for p in PROJECTIONS), model.lm_head]:
        if quantized(module) is not None:
            del module.quantized


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
        table = quantized(module) if not isinstance(module, QuantizedEmbedding) else module.table
        if table is not None:
            seen[id(table)] = table.nbytes()
    floats = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters() if p.numel()}
    return sum(seen.values()) + sum(floats.values())
