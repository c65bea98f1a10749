"""Pick the next token of each request from its logits, with its own sampling parameters."""
from __future__ import annotations

import torch

from shared.sampling import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request random stream: the same seed gives the same sample whatever the batch."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token from one row of logits (shape [vocab])."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
