"""The draft model of speculative decoding: a smaller model with the target's tokenizer
proposes each decoding request's next k tokens, one batched forward per proposed token.

It keeps its own paged KV cache (the target's block count and size, no prefix sharing).
Each step it first catches up on the tokens it has not seen (the whole prompt the first
time, then what the target accepted), then proposes: its argmax for greedy requests, a draw
from its own distribution q under the request's sampling parameters for the others (with a
random stream of its own, seeded from the request's seed). q goes with the proposal to the
acceptance rule. After verification it forgets whatever the target did not keep.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model.batch import Chunk, SchedulerOutput
from worker.engine.block_manager import BlockManager, NoFreeBlocks
from worker.model.model_runner import PagedRunner
from worker.engine.random_streams import draw, make_generator
from worker.engine.sampler import SamplingBatch, SamplingRow, scores
from worker.engine.sequence import Sequence


@dataclass
class _Draft:
    """A request as the draft model sees it: the target's tokens, then its own proposals."""

    seq: Sequence
    k: int
    token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def proposed(self) -> list[int]:
        return self.token_ids[self.seq.num_tokens:]


class DraftProposer:
    def __init__(self, runner: PagedRunner, blocks: BlockManager, vocab: int):
        self.runner = runner
        self.blocks = blocks
        self.vocab = vocab  # the target's logits width: q is given over the target's vocabulary
        self._computed: dict[str, int] = {}  # leading tokens whose keys and values the draft cache holds
        self._sampling: dict[str, SamplingRow] = {}  # the target's parameters, the draft's own random stream

    @classmethod
    def beside(cls, target: PagedRunner, model: torch.nn.Module) -> DraftProposer:
        """The draft `model` next to the target's runner: on its device, with a KV cache of the
        same number and size of blocks."""
        runner = PagedRunner(model, target.device, target.num_blocks, target.block_size, target.kernels)
        vocab = target.model.get_output_embeddings().weight.shape[0]
        return cls(runner, BlockManager(target.num_blocks, target.block_size, prefix_caching=False), vocab)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        drafts = []
        for seq, k in wanted:
            if seq.num_tokens + k - 1 > self.runner.context_length:
                continue
            try:  # the last proposed token is never fed to the draft model
                self.blocks.append_slots(seq.id, seq.num_tokens + k - 1)
            except NoFreeBlocks:
                continue  # the draft cache is full: this request decodes plainly this step
            if seq.id not in self._sampling:
                self._sampling[seq.id] = SamplingRow.of(seq, self._generator(seq))
            drafts.append(_Draft(seq, k, list(seq.token_ids)))
        q_rows: dict[str, list[torch.Tensor]] = {d.seq.id: [] for d in drafts}
        for i in range(max((d.k for d in drafts), default=0)):
            active = [d for d in drafts if d.k > i]
            chunks = []
            for d in active:
                start = self._computed.get(d.seq.id, 0)
                chunks.append(Chunk(d.seq, start, d.token_ids[start:], self.blocks.table(d.seq.id), num_logits=1))
            logits = self.runner.execute(SchedulerOutput(chunks))
            tokens, q = propose_from(logits, SamplingBatch([self._sampling[d.seq.id] for d in active]), self.vocab)
            for d, token, qi in zip(active, tokens, q):
                self._computed[d.seq.id] = d.num_tokens
                d.token_ids.append(token)
                if qi is not None:
                    q_rows[d.seq.id].append(qi)
        return {d.seq.id: (d.proposed, torch.stack(q_rows[d.seq.id]) if q_rows[d.seq.id] else None)
                for d in drafts}

    def verified(self, seq: Sequence) -> None:
        """Keep only the cache entries of tokens the target has too."""
        if seq.id in self._computed:
            self._computed[seq.id] = min(self._computed[seq.id], seq.num_computed)

    def forget(self, seq_id: str) -> None:
        self._computed.pop(seq_id, None)
        self._sampling.pop(seq_id, None)
        self.blocks.free(seq_id)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        params = seq.params
        if params.seed is None:
            return make_generator(params, self.runner.device)
        # Its own stream, so the target's draws stay where plain sampling would have them.
        return make_generator(params.model_copy(update={"seed": (params.seed + 1) % 2**63}), self.runner.device)


def propose_from(logits: torch.Tensor, batch: SamplingBatch, vocab: int) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft model's next token for each row: its argmax for greedy requests, else a draw
    from its distribution q under the request's parameters (q is returned, `vocab` wide, for
    the acceptance rule)."""
    _, tokens, probs = scores(logits[:, :vocab], batch.rows, batch.constraints())
    q: list[torch.Tensor | None] = [None] * len(batch)
    for i, p in probs.items():
        q[i] = torch.nn.functional.pad(p, (0, vocab - p.shape[-1]))
        tokens[i] = draw(q[i], batch.rows[i].generator)
    return tokens, q
