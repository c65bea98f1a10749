"""Speculative decoding for a step (pure Python): which decoding requests get proposed
tokens, how many, and what was kept.

Proposals come from prompt lookup (the tokens that followed the latest earlier occurrence of
the request's last n tokens, in its prompt or output; no second model) or from a draft model
(worker/engine/drafter.py). The proposed tokens ride on the request's decode chunk, the target model
scores them all in one forward, and the sampler keeps the longest acceptable prefix plus one
token of its own (worker/engine/sampler.py). Rejected tokens' KV-cache slots are given back.

Each request's proposal length adapts to its own acceptance, as in transformers' assisted
generation: +2 when every proposed token was kept, -1 otherwise (never below 1), so text
that does not repeat costs little extra compute. Above a batch size, when one is set (vLLM's
disable_by_batch_size), speculation pauses: where a big batch already keeps the hardware busy,
a proposed token costs about as much as a generated one.
"""
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.engine.batcher import Batcher

from worker.model.batch import Chunk, SchedulerOutput
from worker.engine.sequence import Sequence


def propose_ngram(tokens: Tokens[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram
    (min_n <= n <= max_n)."""
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n; got k={k}, min_n={min_n}, max_n={max_n}")
    end = len(tokens)
    if end < 2:
        return []
    last = tokens[-1]
    best_n, best_at = 0, -1
    # One pass from the latest candidate back: at each earlier occurrence of the last token,
    # count how far the match reaches backwards (up to max_n); keep the longest, latest first.
    for i in range(end - 2, -1, -1):
        if tokens[i] != last:
            continue
        n = 1
        while n < max_n and n <= i and tokens[i - n] == tokens[end - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_at = n, i
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return list(tokens[best_at + 1:best_at + 1 + k])


class Proposer(Protocol):
    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, tuple[list[int], Any]]:
        """For (request, most tokens) pairs: request id -> (proposed tokens, the proposer's
        distributions over them or None when it proposes with certainty)."""

    def forget(self, seq_id: str) -> None: ...

    def verified(self, seq: Sequence) -> None:
        """The request's tokens and num_computed are final for this step."""


@dataclass
class NgramProposer:
    max_k: int
    min_n: int = 2
    max_n: int = 4

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, tuple[list[int], Any]]:
        out = {}
        for seq, k in wanted:
            if tokens := propose_ngram(seq.token_ids, k, self.max_n, self.min_n):
                out[seq.id] = (tokens, None)
        return out

    def forget(self, seq_id: str) -> None:
        pass

    def verified(self, seq: Sequence) -> None:
        pass


@dataclass
class SpecStats:
    """Running totals, read by the worker's metrics."""

    drafts: int = 0  # decode chunks that carried proposed tokens
    proposed: int = 0
    accepted: int = 0
    forbidden: int = 0  # proposed tokens cut off because the request's grammar forbids them


@dataclass
class Speculator:
    proposer: Proposer
    max_k: int
    disable_by_batch_size: int = 0  # pause while more requests than this run (0: never)
    draft_sampled: bool = True  # a draft model's proposals for sampled requests too (not greedy only)
    stats: SpecStats = field(default_factory=SpecStats)
    _k: dict[str, int] = field(default_factory=dict)  # each request's current proposal length

    def propose(self, out: SchedulerOutput, batcher: Batcher, context_length: int,
               fitting: Callable[[Sequence, list[int]], int] | None = None) -> None:
        """Put proposed tokens (and the proposer's distributions over them) on this step's
        decode chunks, within the step's leftover budget and the free KV blocks (speculation
        never preempts anyone). `fitting(seq, tokens)`: how many leading proposed tokens the
        request's grammar allows; a proposal is cut at the first one it forbids, which the
        model then never scores."""
        for seq in out.preempted:
            self.proposer.forget(seq.id)
        if self.disable_by_batch_size and len(batcher.running) > self.disable_by_batch_size:
            return  # where a big batch is compute-bound, proposed tokens cost nearly full price
        chunks = {c.seq.id: c for c in out.chunks if self._eligible(c)}
        wanted = [(c.seq, k) for c in chunks.values() if (k := self._room(c.seq, context_length)) > 0]
        for seq_id, (tokens, q) in self.proposer.propose(wanted).items() if wanted else ():
            if q is not None and not self.draft_sampled and not chunks[seq_id].seq.params.greedy:
                self.proposer.verified(chunks[seq_id].seq)
                continue
            if fitting is not None and (n := fitting(chunks[seq_id].seq, tokens)) < len(tokens):
                self.stats.forbidden += len(tokens) - n
                tokens, q = tokens[:n], None if q is None else q[:n]
            added = batcher.speculate(out, chunks[seq_id], tokens, q) if tokens else 0
            if not added:
                self.proposer.verified(chunks[seq_id].seq)  # none will run: the proposer forgets them now
            else:
                self.stats.drafts += 1
                self.stats.proposed += added

    def settle(self, chunk: Chunk, kept: int) -> None:
        """The step verified the chunk's proposals: `kept` of them were accepted (the batcher has
        rolled back the rest). Adapt the request's proposal length to it."""
        proposed = len(chunk.draft)
        self.stats.accepted += kept
        k = self._k.get(chunk.seq.id, self.max_k)
        self._k[chunk.seq.id] = min(self.max_k, k + 2) if kept == proposed else max(1, k - 1)
        self.proposer.verified(chunk.seq)

    def forget(self, seq_id: str) -> None:
        self._k.pop(seq_id, None)
        self.proposer.forget(seq_id)

    @staticmethod
    def _eligible(chunk: Chunk) -> bool:
        # A decode (one new token to score), of a request that wants speculation, whose sampling
        # does not depend on its history (penalties would differ at each position).
        p = chunk.seq.params
        return chunk.samples and chunk.length == 1 and p.speculative and not p.needs_history

    def _room(self, seq: Sequence, context_length: int) -> int:
        """Tokens worth proposing: no more than the request may still emit, less its own token."""
        p = seq.params
        left = min((p.max_tokens or context_length) - len(seq.output_ids), context_length - seq.num_tokens)
        return min(self._k.get(seq.id, self.max_k), left - 1)
