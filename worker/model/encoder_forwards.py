"""Each encoder family's forward over packed inputs (worker/model/encoders.py Packed): the
transformers modules' own layers and norms, called on all the step's tokens at once, with
attention per input. One function per family, keyed by transformers' model_type in FORWARDS.

- BERT, RoBERTa, XLM-RoBERTa, CamemBERT: absolute positions (RoBERTa's from padding_idx + 1),
  segment ids, post-norm layers.
- MPNet: RoBERTa-style positions and a relative-position bias in every layer's scores.
- NomicBERT: rotary positions, segment ids, SwiGLU, post-norm.
- ModernBERT: rotary positions (a global and a local base), pre-norm, GeGLU, local layers that see
  `sliding_window` tokens either side.
- Gemma 3 with bidirectional attention (EmbeddingGemma): the scaled embedding, q/k norms, rotary
  positions per layer type, local layers within `sliding_window` either side, grouped KV heads.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, lengths: tuple[int, ...],
           bias: Callable[[int], torch.Tensor] | None = None, scale: float | None = None,
           kv_heads: int | None = None) -> torch.Tensor:
    """Bidirectional attention of each input over its own tokens; q: (tokens, heads × dim), k and
    v: (tokens, kv_heads × dim). Inputs of one length go through one call together. `bias(n)`: an
    (heads or 1, n, n) score bias or boolean mask for an input of n tokens."""
    size = q.shape[-1] // heads
    kv_heads = kv_heads or heads
    out = torch.empty_like(q)
    by_length: dict[int, list[int]] = {}
    start = 0
    for n in lengths:
        by_length.setdefault(n, []).append(start)
        start += n
    for n, starts in by_length.items():
        index = torch.cat([torch.arange(s, s + n, device=q.device) for s in starts])
        qs = q[index].view(len(starts), n, heads, size).transpose(1, 2)
        ks, vs = (x[index].view(len(starts), n, kv_heads, size).transpose(1, 2) for x in (k, v))
        if kv_heads != heads:
            ks, vs = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (ks, vs))
        mask = bias(n).unsqueeze(0) if bias is not None else None
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[index] = o.transpose(1, 2).reshape(len(starts) * n, heads * size)
    return out


def window(distance: int, inclusive: bool) -> Callable[[int], torch.Tensor]:
    """A local layer's mask: token i sees token j where |i - j| <= distance (or < distance)."""
    def mask(n: int) -> torch.Tensor:
        gap = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
        return (gap <= distance if inclusive else gap < distance).unsqueeze(0)
    return mask


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotary positions (the half-split form) on (tokens, heads × dim), computed in fp32."""
    t = x.view(x.shape[0], heads, -1).float()
    half = t.shape[-1] // 2
    turned = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return (t * cos[:, None].float() + turned * sin[:, None].float()).to(x.dtype).view(x.shape[0], -1)


def bert(model, packed) -> torch.Tensor:
    base, config = model.base_model, model.config
    emb = base.embeddings
    offset = 0 if config.model_type == "bert" else config.pad_token_id + 1  # RoBERTa counts from padding_idx + 1
    x = emb.word_embeddings(packed.ids) + emb.position_embeddings(packed.positions(offset))
    x = x + emb.token_type_embeddings(_segments(config, packed))
    x = emb.LayerNorm(x)
    heads = config.num_attention_heads
    for layer in base.encoder.layer:
        a = layer.attention.self
        ctx = attend(a.query(x), a.key(x), a.value(x), heads, packed.lengths)
        x = _feed_forward(layer, layer.attention.output.LayerNorm(layer.attention.output.dense(ctx) + x))
    return x


def mpnet(model, packed) -> torch.Tensor:
    base, config = model.base_model, model.config
    emb = base.embeddings
    x = emb.LayerNorm(emb.word_embeddings(packed.ids) + emb.position_embeddings(packed.positions(emb.padding_idx + 1)))
    biases: dict[int, torch.Tensor] = {}

    def bias(n: int) -> torch.Tensor:  # the relative-position bias of an input of n tokens, once a step
        if n not in biases:
            biases[n] = base.encoder.compute_position_bias(torch.empty(1, n, 1, device=x.device))[0].to(x.dtype)
        return biases[n]

    for layer in base.encoder.layer:
        a = layer.attention.attn
        ctx = attend(a.q(x), a.k(x), a.v(x), config.num_attention_heads, packed.lengths, bias)
        x = _feed_forward(layer, layer.attention.LayerNorm(a.o(ctx) + x))
    return x


def nomic_bert(model, packed) -> torch.Tensor:
    base, config = model.base_model, model.config
    emb = base.embeddings
    x = emb.LayerNorm(emb.word_embeddings(packed.ids) + emb.token_type_embeddings(_segments(config, packed)))
    heads = config.num_attention_heads
    cos, sin = base.rotary_emb(x, packed.positions())
    for layer in base.layers:
        a = layer.self_attn
        q, k = rotate(a.q_proj(x), cos, sin, heads), rotate(a.k_proj(x), cos, sin, heads)
        x = layer.post_attention_layernorm(x + a.o_proj(attend(q, k, a.v_proj(x), heads, packed.lengths,
                                                              scale=a.scaling)))
        x = layer.post_mlp_layernorm(x + layer.mlp(x))
    return x


def modernbert(model, packed) -> torch.Tensor:
    base, config = model.base_model, model.config
    x = base.embeddings.norm(base.embeddings.tok_embeddings(packed.ids))
    heads = config.num_attention_heads
    positions = packed.positions()
    rope = {kind: base.rotary_emb(x, positions, kind) for kind in set(config.layer_types)}
    local = window(config.sliding_window, inclusive=True)
    for layer in base.layers:
        cos, sin = rope[layer.attention_type]
        q, k, v = layer.attn.Wqkv(layer.attn_norm(x)).view(x.shape[0], 3, -1).unbind(1)
        ctx = attend(rotate(q, cos, sin, heads), rotate(k, cos, sin, heads), v, heads, packed.lengths,
                     local if layer.attention_type == "sliding_attention" else None)
        x = x + layer.attn.Wo(ctx)
        x = x + layer.mlp(layer.mlp_norm(x))
    return base.final_norm(x)


def gemma3_text(model, packed) -> torch.Tensor:
    base, config = model.base_model, model.config
    x = base.embed_tokens(packed.ids)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    positions = packed.positions()
    rope = {kind: base.rotary_emb(x, positions, kind) for kind in set(config.layer_types)}
    local = window(config.sliding_window, inclusive=False)
    for layer, kind in zip(base.layers, config.layer_types):
        a, (cos, sin) = layer.self_attn, rope[kind]
        h = layer.input_layernorm(x)
        n = h.shape[0]
        q = a.q_norm(a.q_proj(h).view(n, heads, -1)).view(n, -1)
        k = a.k_norm(a.k_proj(h).view(n, kv_heads, -1)).view(n, -1)
        ctx = attend(rotate(q, cos, sin, heads), rotate(k, cos, sin, kv_heads), a.v_proj(h), heads, packed.lengths,
                     local if kind == "sliding_attention" else None, scale=a.scaling, kv_heads=kv_heads)
        x = x + layer.post_attention_layernorm(a.o_proj(ctx))
        x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
    return base.norm(x)


def _feed_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """A BERT-style layer's feed-forward block after its attention: up, activation, down, residual, norm."""
    return layer.output.LayerNorm(layer.output.dense(layer.intermediate.intermediate_act_fn(
        layer.intermediate.dense(x))) + x)


def _segments(config, packed) -> torch.Tensor:
    """Each token's segment id, where the model has segments (else 0)."""
    return packed.types if int(getattr(config, "type_vocab_size", 0) or 0) > 1 else torch.zeros_like(packed.types)


FORWARDS: dict[str, Callable] = {"bert": bert, "roberta": bert, "xlm-roberta": bert, "camembert": bert,
                                 "mpnet": mpnet, "nomic_bert": nomic_bert, "modernbert": modernbert,
                                 "gemma3_text": gemma3_text}
