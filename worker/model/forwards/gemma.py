"""Gemma 3 (the plan's gemma3 forward) on the fused projections (float on the kernels' panels, or
kept quantized), with its modules' own norms: embeddings scaled, q and k normalised per head, a
norm after the attention and after the MLP as well as before each, local layers (the sliding
window, their own rotary base) between global ones, and optionally softcapped logits. With the CPU kernels, every chunk attends
through the paged kernel, as the llama layers' do."""
from __future__ import annotations

import torch

from worker.model.batch import StepInputs
from worker.model.forwards import Runner, embed
from worker.model.forwards.attention import attend
from worker.model.fused_layers import rotate_half


def forward(r: Runner, step: StepInputs) -> torch.Tensor:
    core, config, paged = r.model.model, r.model.config, step.paged
    h = embed(core, step)
    total, heads = h.shape[0], config.num_attention_heads
    sizes = [heads * r.head_dim, r.kv_heads * r.head_dim, r.kv_heads * r.head_dim]
    rotary = {}
    for kind in set(config.layer_types):
        cos, sin = core.rotary_emb(h[None], step.positions[None], kind)
        rotary[kind] = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, D]
    for i, (layer, w) in enumerate(zip(core.layers, r.fused)):
        attn = layer.self_attn
        cos, sin = rotary[config.layer_types[i]]
        q, k, v = w.qkv(layer.input_layernorm(h)).split(sizes, dim=-1)
        q = attn.q_norm(q.reshape(total, heads, r.head_dim))
        k = attn.k_norm(k.reshape(total, r.kv_heads, r.head_dim))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = attend(r, i, q, k, v.reshape(total, r.kv_heads, r.head_dim), step, attn.scaling)
        if paged is not None:
            r.kernels.paged_attention(q, o, paged.tokens, paged.rows, paged.context, paged.tables,
                                      r.k_cache[i], r.v_cache[i], attn.scaling, r.windows[i], paged.positions)
        h = h + layer.post_attention_layernorm(w.o(o.view(total, -1)))
        gate, up = w.gate_up(layer.pre_feedforward_layernorm(h)).chunk(2, dim=-1)
        h = h + layer.post_feedforward_layernorm(w.down(layer.mlp.act_fn(gate) * up))
    h = core.norm(h[step.logits_index])
    if step.hidden:  # pooling: the final hidden states, before the head and its softcapping
        return h
    logits = r.lm_head(h)
    cap = config.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap
