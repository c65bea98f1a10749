"""The paged runner's forwards, one module each, named as the plan names them
(worker/model/forward_plan.py ForwardPlan.forward): llama_kernels (the llama family on the CPU
step kernels), llama_fused (on the fused projections and torch's ops; what CUDA graphs capture),
llama_eager (the modules' own projections), gemma (the plan's gemma3: Gemma 3) and opt;
attention.py is the attention on torch's ops they share. A forward is a function `forward(runner, step) -> Tensor`: the runner looks
it up once, when it is built, and calls it each step. It reads the runner's state (`Runner`) as
the step runs, so a test may change it (the windows, the one-token stack) between steps.

May import: shared/ and worker/model/ (never model_runner.py, which imports these).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

import torch


class Runner(Protocol):
    """What the forwards read of the runner (worker/model/model_runner.py PagedRunner)."""

    model: torch.nn.Module  # transformers' own modules: embeddings, norms, rotary, the eager paths' projections
    k_cache: torch.Tensor  # [layers, kv heads, blocks, block_size, head dim] (worker/model/kv_cache.py)
    v_cache: torch.Tensor
    kv_heads: int
    head_dim: int
    windows: list[int]  # each layer's sliding window (0: none)
    kernels: ModuleType | None  # the CPU step kernels, where the plan has them
    fused: list | None  # the fused layers' weights (worker/model/fused_layers.py FusedLayer), where the plan fuses
    lm_head: Any  # the fused paths' head (a Weight, worker/model/lm_head.py)
    eps: float | None  # the fused llama layers' norm epsilon and attention scale (every layer's the first's)
    scale: float | None
    one_token: Any  # the kernels' one-call layer stack (worker/model/forwards/llama_kernels.py), or None

    def projections(self) -> list: ...  # every fused projection of every layer, and the head


def embed(core: torch.nn.Module, step) -> torch.Tensor:
    """The step's input embeddings: the tokens' (core.embed_tokens), an image token's row replaced
    by its image's embedding (worker/engine/vision.py) where the step has images."""
    h = core.embed_tokens(step.input_ids)
    if step.image_rows is not None:
        h = h.index_copy(0, step.image_rows, step.image_embeddings.to(h.dtype))
    return h
