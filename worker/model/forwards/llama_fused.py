"""A llama-family step on the fused projections (worker/model/fused_layers.py) and torch's ops:
the path on a GPU, and on a CPU without the step kernels; the step CUDA graphs capture
(worker/model/cuda_graphs.py). A step with LoRA rows runs the layers with their deltas added
(worker/model/lora_step.py)."""
from __future__ import annotations

import torch

from worker.model.batch import StepInputs
from worker.model.forwards import Runner, embed
from worker.model.forwards.attention import attend
from worker.model.fused_layers import after_attention, before_attention
from worker.model.lm_head import output


def forward(r: Runner, step: StepInputs) -> torch.Tensor:
    core = r.model.model
    h = embed(core, step)
    cos, sin = core.rotary_emb(h[None], step.rotary_positions())
    cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, D]
    eps, scale = r.eps, r.scale
    heads = r.model.config.num_attention_heads
    for i, w in enumerate(r.fused if step.lora is None else step.lora.layers(r.fused)):
        q, k, v = before_attention(h, w, cos, sin, eps, heads, r.kv_heads, r.head_dim)
        o = attend(r, i, q, k, v, step, scale)
        h = after_attention(h, o, w, eps)
    return output(core.norm(h[step.logits_index]), step, r.lm_head)
