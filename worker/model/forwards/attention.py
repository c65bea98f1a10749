"""Attention on torch's ops over the paged KV cache, for the forwards without the CPU kernels'
paged attention (and for Gemma 3's cache writes with them).

Each token's key and value are written to its slot (`index_copy_`), then each group of
like-length chunks (worker/model/runner_inputs.py) attends in one batched call: a group gathers
its requests' cache blocks whole (`index_select` of the block tables), which gives each
(request, kv head) its keys as one [context, head dim] matrix. Prefill groups use the fused
attention kernel with a causal, per-request mask; decodes use two batched matmuls instead."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.model.batch import AttentionGroup, StepInputs
from worker.model.forwards import Runner


def attend(r: Runner, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInputs,
           scale: float) -> torch.Tensor:
    """Write this step's k, v to the cache, then attend each group. q: [T, H, D]."""
    k_cache, v_cache = r.k_cache[layer], r.v_cache[layer]
    k_cache.view(r.kv_heads, -1, r.head_dim).index_copy_(1, step.slots, k.transpose(0, 1))
    v_cache.view(r.kv_heads, -1, r.head_dim).index_copy_(1, step.slots, v.transpose(0, 1))
    out = torch.empty_like(q)
    attend_groups(r, layer, q, step.groups, scale, out)
    return out


def attend_groups(r: Runner, layer: int, q: torch.Tensor, groups: list[AttentionGroup], scale: float,
                  out: torch.Tensor) -> None:
    """Attend each group of chunks over keys gathered from the cache; results into out."""
    k_cache, v_cache = r.k_cache[layer], r.v_cache[layer]
    q_ext = None
    for g in groups:
        mask = g.windowed if r.windows[layer] and g.windowed is not None else g.mask
        if g.query_index is None:  # one query per chunk (decodes): no padding to add or drop
            qg = q[g.tokens][:, :, None]  # [S, H, 1, D]
        else:
            if q_ext is None:
                q_ext = torch.cat([q, q.new_zeros((1,) + q.shape[1:])])
            qg = q_ext[g.query_index].transpose(1, 2)  # [S, H, Q, D]
        # Whole blocks at once: [Hkv, S * B, bs, D] -> [S, Hkv, B * bs, D].
        kg = k_cache.index_select(1, g.blocks).view(r.kv_heads, -1, g.span, r.head_dim).transpose(0, 1)
        vg = v_cache.index_select(1, g.blocks).view(r.kv_heads, -1, g.span, r.head_dim).transpose(0, 1)
        if g.query_index is None:
            og = _decode_attention(qg, kg, vg, mask, scale)
        else:
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale,
                                                enable_gqa=qg.shape[1] != kg.shape[1])
        og = og.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])  # [S*Q, H, D]
        out[g.tokens] = og if g.unpad is None else og[g.unpad]


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per sequence, as two batched matmuls: q [S, H, 1, D], k and v [S, Hkv, L, D].

    The CPU's fused attention kernel spent ~1 ms a layer here (it tiles for long queries); the
    query heads that share a kv head form the rows of one small matmul instead."""
    seqs, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(seqs, kv_heads, heads // kv_heads, dim)  # heads of one kv head are adjacent
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [S, Hkv, G, L]
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(seqs, heads, 1, dim)
