"""A llama-family layer as two functions around attention, over fused, prepacked weights.

At a decode step of a small model the calls, not the arithmetic, were most of the time:
- q, k and v are one projection, and gate and up another (the weights concatenated once; the
  modules' own weights become views of them, so the model still works as transformers' own);
- on a CPU each projection's weight is also reordered once into oneDNN's blocked layout
  (`Weight`), which the matmul then reads without repacking it every call: 1.2 to 2× faster
  per projection at batch sizes 1 to 32 in bf16, and about 2× in fp32 on a CPU where torch's
  default fp32 matmul (MKL) is slow (AMD EPYC). Its results differ from the default matmul's in
  rounding, as the default matmul's own differ between one row and several; what is kept is
  the engine's greedy output against transformers' `generate`, which the tests check.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from worker.model.quant_linear import QuantLinear
from worker.model.quantized import QuantizedWeight, concat_rows

log = logging.getLogger(__name__)


# A Weight's kind, chosen once when it is built (its kernel then follows from it alone).
QUANTIZED = "quantized"  # a QuantizedWeight: quant_linear on the kernels, else dequantized a slice at a time
PANELS = "panels"  # the kernels' panel_linear (with matmul_rows: calls of that many rows or more on oneDNN)
ONEDNN = "onednn"  # prepacked once into oneDNN's blocked layout (a CPU)
MATMUL = "matmul"  # the plain matmul (a GPU, or a CPU whose oneDNN does not pack the dtype)


class Weight:
    """A projection, x @ w.T + b, for a float weight or a QuantizedWeight. With the step kernels
    (`kernels`, their projections on its `isa`): a float w runs on panel_linear where that computes
    w's dtype, a quantized one on quant_linear. Without: a float w is prepacked for oneDNN on a CPU
    (the plain matmul on a GPU), a quantized one dequantized a slice at a time (QuantLinear).
    `kind` says which, once; the tensors a kind does not use are None."""

    def __init__(self, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                 kernels: ModuleType | None = None, matmul_rows: int = 0, tile: int = 0):
        """`matmul_rows` > 0: a weight on panels is also prepacked for oneDNN, and a call of that many
        rows or more runs there (AMX_MATMUL_ROWS on a CPU with AMX); 0: the panels take every call.
        `tile` > 0 (deterministic mode, the plan's tile): where this weight's rows are not computed
        alone, every call runs in calls of exactly that many rows."""
        self.bias, self.isa = bias, getattr(kernels, "isa", "auto")
        self.w = self.panels = self.packed = self.quant = None
        self.out_features = w.shape[0]
        self.matmul_rows = 0
        if isinstance(w, QuantizedWeight):
            self.kind, self.quant = QUANTIZED, QuantLinear(w, bias, kernels)
        elif kernels is not None and str(w.dtype).removeprefix("torch.") in kernels.panel_dtypes:
            self.kind, self.w, self.panels, self.panel_linear = PANELS, w, kernels.pack_panels(w), kernels.panel_linear
            if matmul_rows and device.type == "cpu":
                self.packed = _pack(w)
                self.matmul_rows = matmul_rows if self.packed is not None else 0
        else:
            self.w, self.packed = w, _pack(w) if device.type == "cpu" else None
            self.kind = ONEDNN if self.packed is not None else MATMUL
        # Rows a matmul call takes, padded, in deterministic mode where rows are not computed alone
        # (0: any number). panel_linear and quant_linear compute each row alone; a library matmul
        # picks its blocking by the row count, so a row's result would hang on how many others share the call.
        self.tile = 0 if self.row_independent else tile

    def nbytes(self) -> int:
        """Bytes of the weight this projection holds, in every form it keeps (the float weight and
        its panels or oneDNN's prepacked copy, or the packed quantized codes and scales)."""
        tensors = [t for t in (self.w, self.panels, self.packed) if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors) + (self.quant.nbytes() if self.quant else 0)

    @property
    def row_independent(self) -> bool:
        """Whether each row's result is the same whatever other rows share the call, untiled."""
        if self.kind == PANELS:
            return not self.matmul_rows
        return self.kind == QUANTIZED and self.quant.row_independent

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == PANELS and not (self.matmul_rows and x.shape[0] >= self.matmul_rows):
            return self.panel_linear(x, self.panels, self.out_features, self.bias, self.isa)
        if self.tile:
            return self._tiled(x)
        return self._matmul(x)

    def projection(self, ops: ModuleType):
        """This projection for the step kernels' one-token Layers (`ops`); None where it runs in
        Python only (a quantized weight on the portable path)."""
        if self.kind == QUANTIZED:
            return self.quant.projection(ops)
        if self.kind == PANELS:
            return ops.Projection.panels(self.panels, self.out_features, self.bias, self.isa)
        return ops.Projection.matmul(self.w, self.packed, self.bias)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == QUANTIZED:
            return self.quant(x)
        if self.packed is not None:  # ONEDNN, or PANELS' calls of matmul_rows and more
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.w, self.bias)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T + b in calls of exactly `tile` rows (the last padded with zeros): every row goes
        through the same call shape, whatever else the step holds."""
        rows, tile = x.shape[0], self.tile
        if rows == 0:  # a step whose chunks need no logits (a chunked prefill's first part)
            return self._matmul(x)
        padded = F.pad(x, (0, 0, 0, -rows % tile))
        return torch.cat([self._matmul(padded[i:i + tile]) for i in range(0, padded.shape[0], tile)])[:rows]


def _pack(w: torch.Tensor) -> torch.Tensor | None:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 1)
    except RuntimeError as exc:  # a dtype or CPU oneDNN does not pack for
        log.debug("no prepacked weights (%s)", exc)
        return None


@dataclass
class FusedLayer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: Weight  # [(H + 2 Hkv) D, hidden]
    o: Weight
    gate_up: Weight  # [2 I, hidden]
    down: Weight


def qkv_modules(attn: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of an attention's q, k and v projections, in that order: one for Phi-3 (qkv_proj)."""
    return [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]


def gate_up_modules(mlp: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of an MLP's gate and up projections, gate first: one for Phi-3 (gate_up_proj)."""
    return [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]


def fusable(model: torch.nn.Module) -> bool:
    """Llama-family layers with SiLU MLPs, no MLP or output biases and no per-head q/k norms."""
    layer = model.model.layers[0]
    return (getattr(model.config, "hidden_act", None) == "silu" and not hasattr(layer.self_attn, "q_norm")
            and gate_up_modules(layer.mlp)[0].bias is None and layer.mlp.down_proj.bias is None
            and layer.self_attn.o_proj.bias is None)


def fuse(model: torch.nn.Module, device: torch.device, kernels: ModuleType | None = None,
         matmul_rows: int = 0, tile: int = 0) -> list[FusedLayer]:
    """Concatenate each layer's q/k/v and gate/up weights; point the modules at views of them.
    `kernels`: the step kernels, whose projection kernels run what they compute (Weight);
    `matmul_rows`, `tile`: Weight's.
    A module that carries a `quantized` weight (worker/model/quant_model.py) is projected through it;
    its own `weight` is left as it is (a placeholder)."""
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp

        def weight(modules: list[torch.nn.Module], bias: torch.Tensor | None = None) -> Weight:
            found = [getattr(module, "quantized", None) for module in modules]
            if any(q is not None for q in found) and any(q is None for q in found):
                raise ValueError("q, k and v (or gate and up) must be all quantized or none: they run as one projection")
            w = concat_rows(found) if found[0] is not None else _concat(modules, "weight")
            return Weight(w, bias, device, kernels, matmul_rows, tile)

        qkv = qkv_modules(attn)
        bqkv = _concat(qkv, "bias") if qkv[0].bias is not None else None
        layers.append(FusedLayer(
            layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
            weight(qkv, bqkv), weight([attn.o_proj]), weight(gate_up_modules(mlp)), weight([mlp.down_proj])))
    return layers


def _concat(modules: list[torch.nn.Module], name: str) -> torch.Tensor:
    parts = [getattr(m, name).data for m in modules]
    if len(parts) == 1:
        return parts[0]
    fused = torch.cat(parts)
    start = 0
    for module, part in zip(modules, parts):
        getattr(module, name).data = fused[start:start + part.shape[0]]
        start += part.shape[0]
    return fused


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' LlamaRMSNorm, op for op: fp32 outputs equal the eager model's.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def before_attention(h: torch.Tensor, w: FusedLayer, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                     heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, the q/k/v projection and rotary: q [T, H, D], k and v [T, Hkv, D]."""
    total = h.shape[0]
    qkv = w.qkv(_rms_norm(h, w.ln1, eps))
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(total, heads, head_dim), k.view(total, kv_heads, head_dim), v.view(total, kv_heads, head_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def after_attention(h: torch.Tensor, o: torch.Tensor, w: FusedLayer, eps: float) -> torch.Tensor:
    """The attention output's projection and residual, then the MLP and its residual."""
    h = h + w.o(o.reshape(h.shape[0], -1))
    gate, up = w.gate_up(_rms_norm(h, w.ln2, eps)).chunk(2, dim=-1)
    return h + w.down(F.silu(gate) * up)
