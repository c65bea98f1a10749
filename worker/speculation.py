"""Speculative decoding's two pure pieces: proposing tokens, and accepting them (no torch).

Proposing, by prompt lookup: the k tokens that followed the latest earlier occurrence of the
request's last n tokens (the longest n that matches, from max_n down to min_n), in its prompt
or output. No second model: it pays off where the output repeats its input (edits, quotes,
summaries with names and numbers).

Accepting: the model scores the proposed tokens in one forward. Greedy keeps the longest prefix
that agrees with the model's own choices, plus the model's next token (the correction, or a
bonus one when all agree), so the output is exactly plain greedy decoding's. With temperature,
the standard rejection rule keeps the output distribution the model's: a proposed token x is
kept with probability min(1, p(x) / q(x)) (q = the proposer's distribution; a lookup proposes
one token for certain, q(x) = 1), and at the first rejection the replacement is drawn from
max(0, p - q), renormalised.

Not wired into the engine yet: the step, the KV-cache roll-back and the settings come next.
"""
from __future__ import annotations

import random
from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram."""
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n; got k={k}, min_n={min_n}, max_n={max_n}")
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = list(tokens[-n:])
        for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence first, the suffix itself excluded
            if list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []


def accept_greedy(proposed: Sequence[int], choices: Sequence[int]) -> list[int]:
    """The tokens a greedy step emits: `choices[i]` is the model's argmax after the prefix plus
    proposed[:i] (len(proposed) + 1 of them); the agreeing prefix, then the model's own token."""
    if len(choices) != len(proposed) + 1:
        raise ValueError(f"{len(proposed)} proposed tokens need {len(proposed) + 1} choices, got {len(choices)}")
    out = []
    for token, choice in zip(proposed, choices):
        if token != choice:
            break
        out.append(token)
    out.append(choices[len(out)])
    return out


def accept_sampled(proposed: Sequence[int], target: Sequence[Sequence[float]], rng: random.Random,
                   draft: Sequence[Sequence[float]] | None = None) -> list[int]:
    """The tokens a sampling step emits. `target[i]` is the model's distribution after the prefix
    plus proposed[:i] (len(proposed) + 1 of them), `draft[i]` the proposer's (None: a lookup,
    certain of its token). Each emitted token is distributed as plain sampling's would be."""
    if len(target) != len(proposed) + 1:
        raise ValueError(f"{len(proposed)} proposed tokens need {len(proposed) + 1} distributions")
    out = []
    for i, token in enumerate(proposed):
        p = target[i][token]
        q = 1.0 if draft is None else draft[i][token]
        if rng.random() * q < p:  # kept with probability min(1, p / q)
            out.append(token)
            continue
        residual = [max(0.0, pi - (0.0 if draft is None else draft[i][j])) for j, pi in enumerate(target[i])]
        if draft is None:
            residual[token] = 0.0
        out.append(_draw(residual, rng))
        return out
    out.append(_draw(target[len(proposed)], rng))  # all kept: one more from the model
    return out


def _draw(weights: Sequence[float], rng: random.Random) -> int:
    total = sum(weights)
    if total <= 0:
        raise ValueError("nothing left to draw from")
    x = rng.random() * total
    for token, w in enumerate(weights):
        x -= w
        if x < 0:
            return token
    return max(range(len(weights)), key=weights.__getitem__)
