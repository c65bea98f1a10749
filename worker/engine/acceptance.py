"""Speculative decoding's acceptance rules: which of the proposed tokens a verifying step keeps,
and the token it adds, so that the output is distributed as the model's own (worker/engine/sampler.py
applies them to each request of a step)."""
from __future__ import annotations

from collections.abc import Sequence as Tokens

import torch

from worker.engine.random_streams import draw


def accept_greedy(proposed: Tokens[int], choices: Tokens[int]) -> list[int]:
    """The tokens a greedy step emits: `choices[i]` is the model's argmax after the prefix plus
    proposed[:i] (len(proposed) + 1 of them); the agreeing prefix, then the model's own token.
    Exactly what plain greedy decoding would emit, several steps' worth."""
    if len(choices) != len(proposed) + 1:
        raise ValueError(f"{len(proposed)} proposed tokens need {len(proposed) + 1} choices, got {len(choices)}")
    out = []
    for token, choice in zip(proposed, choices):
        if token != choice:
            break
        out.append(token)
    out.append(choices[len(out)])
    return out


def sample_lookup(draft: list[int], p: list[torch.Tensor], gen: torch.Generator | None) -> list[int]:
    """A sampled step over a proposal made with certainty (prompt lookup): draw each position
    from the model's p and go on while the draw equals the proposal (the rejection rule exactly)."""
    out = []
    for i, token in enumerate(draft):
        out.append(draw(p[i], gen))
        if out[-1] != token:
            return out
    out.append(draw(p[len(draft)], gen))
    return out


def sample_draft(draft: list[int], p: list[torch.Tensor], q: torch.Tensor, gen: torch.Generator | None) -> list[int]:
    """A sampled step over a draft model's proposal drawn from its q: each token kept with
    probability min(1, p / q); the first rejected one replaced by a draw from max(0, p - q)."""
    out = []
    for i, token in enumerate(draft):
        u = float(torch.rand((), generator=gen, device=q.device))
        if u * float(q[i, token]) < float(p[i][token]):
            out.append(token)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        out.append(draw(residual if float(residual.sum()) > 0 else p[i], gen))
        return out
    out.append(draw(p[len(draft)], gen))
    return out
