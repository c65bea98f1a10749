"""The LM head of the fused paths, and what a step gives back from its final hidden states.

The head is built as the fused projections are (worker/model/fused_layers.py Weight: on the
kernels' panels, prepacked for oneDNN, or kept quantized), and a quantized tied embedding reads
its table. A step gives the logits of the rows it needs (runner_inputs.py: each sampling chunk's
last token, one per proposed token to verify), or, for pooling (embeddings), those rows' final
hidden states, after the last norm."""
from __future__ import annotations

from types import ModuleType

import torch

from worker.model import quant_model
from worker.model.batch import StepInputs
from worker.model.fused_layers import Weight


def build(model: torch.nn.Module, device: torch.device, kernels: ModuleType | None, matmul_rows: int, tile: int,
          dtype: torch.dtype) -> Weight:
    """The head's Weight (`matmul_rows`, `tile`: the plan's, as every projection takes them); the
    embedding made to read the head's quantized table where the two are tied."""
    head = quant_model.quantized(model.lm_head) or model.lm_head.weight.data
    weight = Weight(head, getattr(model.lm_head, "bias", None), device, kernels, matmul_rows, tile)
    quant_model.install_embedding(model, dtype, weight.quant)
    return weight


def output(h: torch.Tensor, step: StepInputs, head) -> torch.Tensor:
    """The step's result from the final hidden states `h` of its rows: they themselves where the
    step asks for them (pooling), else the logits of `head`."""
    return h if step.hidden else head(h)
