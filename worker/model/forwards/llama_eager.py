"""A llama-family step on the modules' own projections and torch's ops (the reference path, for
tests: the plan's `fuse` off), each adapter row's LoRA delta added projection by projection."""
from __future__ import annotations

import torch

from worker.model.batch import StepInputs
from worker.model.forwards import Runner, embed
from worker.model.forwards.attention import attend
from worker.model.fused_layers import rotate_half
from worker.model.lm_head import output
from worker.model.lora_step import StepLora


def forward(r: Runner, step: StepInputs) -> torch.Tensor:
    core = r.model.model
    h = embed(core, step)
    cos, sin = core.rotary_emb(h[None], step.rotary_positions())
    cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, D]
    total, lora = h.shape[0], step.lora or StepLora([])  # no groups: the modules alone
    for i, layer in enumerate(core.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = lora.project(i, "q_proj", attn.q_proj, x).view(total, -1, r.head_dim)
        k = lora.project(i, "k_proj", attn.k_proj, x).view(total, -1, r.head_dim)
        v = lora.project(i, "v_proj", attn.v_proj, x).view(total, -1, r.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = attend(r, i, q, k, v, step, getattr(attn, "scaling", r.head_dim ** -0.5))
        h = h + lora.project(i, "o_proj", attn.o_proj, o.reshape(total, -1))
        h = h + lora.mlp(i, layer.mlp, layer.post_attention_layernorm(h))
    return output(core.norm(h[step.logits_index]), step, r.model.lm_head)
