"""A llama-family step on the fused projections with the CPU step kernels (worker/model/kernels.py):
per layer four projections and five kernel calls (norms, rotary and the cache writes, paged
attention). Every chunk attends through the paged kernel (worker/model/runner_inputs.py puts
none in attention groups), each token computed alone. A one-token step (one stream decoding)
runs the whole layer stack in one kernel call where it is built (`one_token_stack`); a step with
LoRA rows runs per layer, the deltas added (worker/model/lora_step.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.model.batch import StepInputs
from worker.model.forwards import Runner, embed
from worker.model.lm_head import output
from worker.model.quant_linear import float_activations_on


def forward(r: Runner, step: StepInputs) -> torch.Tensor:
    core, ops, paged = r.model.model, r.kernels, step.paged
    h = embed(core, step)
    cos, sin = core.rotary_emb(h[None], step.rotary_positions())
    cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [T, D]
    eps, scale = r.eps, r.scale
    heads, total = r.model.config.num_attention_heads, h.shape[0]
    # One stream decoding: the layers in one call (which adds no LoRA deltas).
    if total == 1 and r.one_token is not None and step.lora is None and not float_activations_on():
        h = r.one_token.run(h, cos, sin, step.slots, r.k_cache, r.v_cache, paged.tokens, paged.rows,
                            paged.context, paged.tables)
        return output(ops.add_rms_norm(h[step.logits_index], None, core.norm.weight.data,
                                       core.norm.variance_epsilon), step, r.lm_head)
    y = None
    for i, w in enumerate(r.fused if step.lora is None else step.lora.layers(r.fused)):
        k_cache, v_cache = r.k_cache[i], r.v_cache[i]
        x = ops.add_rms_norm(h, y, w.ln1, eps)  # h += y (the last layer's MLP), then the norm
        q = ops.rope_cache(w.qkv(x), cos, sin, step.slots, k_cache.view(r.kv_heads, -1, r.head_dim),
                           v_cache.view(r.kv_heads, -1, r.head_dim), heads, r.kv_heads)
        o = torch.empty_like(q)
        ops.paged_attention(q, o, paged.tokens, paged.rows, paged.context, paged.tables, k_cache, v_cache, scale,
                            r.windows[i], paged.positions)
        x = ops.add_rms_norm(h, w.o(o.view(total, -1)), w.ln2, eps)
        gate, up = w.gate_up(x).chunk(2, dim=-1)
        y = w.down(F.silu(gate) * up)
    h = (h + y)[step.logits_index]
    return output(ops.add_rms_norm(h, None, core.norm.weight.data, core.norm.variance_epsilon), step, r.lm_head)


def one_token_stack(r: Runner):
    """The kernels' Layers, or None where a projection runs in Python only (quantized, portable)
    or in tiles (deterministic mode without panels: the stack would call the library's matmul on one row)."""
    ops, layers = r.kernels, r.fused
    if any(w.tile for w in r.projections()):
        return None
    args = {name: [getattr(w, name).projection(ops) for w in layers] for name in ("qkv", "o", "gate_up", "down")}
    if any(p is None for projections in args.values() for p in projections):
        return None
    return ops.Layers([w.ln1 for w in layers], [w.ln2 for w in layers], args["qkv"], args["o"], args["gate_up"],
                      args["down"], r.windows, r.model.config.num_attention_heads, r.kv_heads, r.eps, r.scale)
