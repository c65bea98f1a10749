"""OPT (the seed's architecture) on its modules' own projections and torch's ops: learned
positions, the norms before or after each block as the config says, optional projections in and
out of the embedding's width."""
from __future__ import annotations

import torch

from worker.model.batch import StepInputs
from worker.model.forwards import Runner
from worker.model.forwards.attention import attend
from worker.model.lm_head import output


def forward(r: Runner, step: StepInputs) -> torch.Tensor:
    dec = r.model.model.decoder
    h = dec.embed_tokens(step.input_ids)
    if getattr(dec, "project_in", None) is not None:
        h = dec.project_in(h)
    h = h + dec.embed_positions.weight[step.positions + dec.embed_positions.offset]
    total = h.shape[0]
    for i, layer in enumerate(dec.layers):
        attn, before = layer.self_attn, layer.do_layer_norm_before
        x = layer.self_attn_layer_norm(h) if before else h
        q = attn.q_proj(x).view(total, -1, r.head_dim)
        k = attn.k_proj(x).view(total, -1, r.head_dim)
        v = attn.v_proj(x).view(total, -1, r.head_dim)
        o = attend(r, i, q, k, v, step, getattr(attn, "scaling", r.head_dim ** -0.5))
        h = h + attn.out_proj(o.reshape(total, -1))
        if not before:
            h = layer.self_attn_layer_norm(h)
        x = layer.final_layer_norm(h) if before else h
        h = h + layer.fc2(layer.activation_fn(layer.fc1(x)))
        if not before:
            h = layer.final_layer_norm(h)
    h = h[step.logits_index]
    if getattr(dec, "final_layer_norm", None) is not None:
        h = dec.final_layer_norm(h)
    if getattr(dec, "project_out", None) is not None:
        h = dec.project_out(h)
    return output(h, step, r.model.lm_head)
