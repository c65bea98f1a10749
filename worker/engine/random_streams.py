"""Each request's own random stream: made from its seed, so the same seed gives the same sample
whatever else the batch holds, and moved past the draws it made before a failover."""
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


def replay_draws(generator: torch.Generator | None, vocab: int, n: int) -> None:
    """Move a request's random stream past the `n` tokens it drew before (a continuation after a
    failover), so its next draw is the one the undisturbed run made. torch's multinomial takes the
    same share of the stream for any distribution of one width: uniform ones stand in."""
    if generator is not None and n > 0:
        torch.multinomial(torch.full((n, vocab), 1.0 / vocab, device=generator.device), 1, generator=generator)


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token from `probs`, with the request's stream."""
    return int(torch.multinomial(probs, 1, generator=gen)[0])
