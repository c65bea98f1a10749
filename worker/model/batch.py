"""A step's batch as the forward takes it: the scheduler's chunks (Chunk, SchedulerOutput), and
the index tensors the forward runs on (StepInputs, AttentionGroup, Paged), built by the runner or
over CUDA graphs' static buffers. The engine writes the first; worker/model reads both and imports
nothing of the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from worker.model.lora_step import StepLora


class ChunkRequest(Protocol):
    """What the forward reads of a chunk's request: its LoRA adapter (None: the base model) and the
    revision of it the request holds. The engine's request (worker/engine/sequence.py Sequence) is
    one; this package does not import it."""

    @property
    def adapter(self) -> str | None: ...

    @property
    def adapter_revision(self) -> int | None: ...

    def rope_positions(self, start: int, end: int) -> list[list[int]] | None:
        """M-RoPE's (time, height, width) positions of its tokens start .. end (Qwen2-VL's images);
        None: each token's index, on every axis."""
        ...

    def attention_ends(self, start: int, end: int) -> list[int] | None:
        """The last key each of its tokens start .. end attends to, where an image's tokens attend
        to each other both ways (Gemma 3's): the image's last; None: each its own (causal)."""
        ...


R = TypeVar("R", bound=ChunkRequest)


@dataclass
class Chunk(Generic[R]):
    """Tokens of one request to run in this step: input_ids at positions start .. start + length.

    The runner reads input_ids, start, block_table and num_logits; the engine's postprocess
    reads seq, draft and draft_probs."""

    seq: R | None  # its request (the engine's Chunk[Sequence]; None: a pooling input, on the base model)
    start: int
    input_ids: list[int]  # the request's known tokens from start on, then any proposed ones
    block_table: list[int]
    num_logits: int  # trailing positions whose logits the step needs: 1 when the chunk reaches the end of
    #                  the known tokens (its last logits pick the next one) plus one per proposed token; else 0
    draft: list[int] = field(default_factory=list)  # proposed tokens after the known ones, to verify
    draft_probs: torch.Tensor | None = None  # the proposer's distributions over them (a draft model's), for the acceptance rule

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def samples(self) -> bool:
        return self.num_logits > 0


@dataclass
class SchedulerOutput(Generic[R]):
    chunks: list[Chunk[R]] = field(default_factory=list)
    preempted: list[R] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


@dataclass
class AttentionGroup:
    """Index tensors of one attention group (chunks of like length), built once per step."""

    tokens: torch.Tensor  # [n] flat indices of the group's tokens
    query_index: torch.Tensor | None  # [S, Q] flat token index of each padded query (T = padding row); None: Q = 1
    unpad: torch.Tensor | None  # [n] position of each group token in the flattened [S*Q] queries
    blocks: torch.Tensor  # [S * B] cache block of each key block, sequence by sequence (0 for padding)
    span: int  # B * block_size: the key positions each sequence attends over
    mask: torch.Tensor  # [S, 1, Q, B * block_size] True where a query may attend to a key
    windowed: torch.Tensor | None = None  # the same within the sliding window, for the layers that have one


@dataclass
class Paged:
    """The tokens the paged-attention kernel serves (with the kernels: every chunk's): each attends
    to its own sequence's keys 0 .. its position, read from the cache through the block table."""

    tokens: torch.Tensor  # [N] flat index of each token
    rows: torch.Tensor  # [N] its chunk's row in tables
    context: torch.Tensor  # [N] keys it sees: position + 1 (past it, for an image's token that sees the whole image)
    tables: torch.Tensor  # [chunks, B] each chunk's block table (0 past its end)
    positions: torch.Tensor | None = None  # [N] its position, where the context passes it (the sliding window ends there)


@dataclass
class StepInputs:
    """A step's inputs as the forward reads them (built by PagedRunner, or over static buffers
    by worker/model/cuda_graphs.py)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    groups: list[AttentionGroup]  # the chunks attended by torch's ops: none with the kernels
    logits_index: torch.Tensor  # flat index of each token whose logits the step needs, chunk by chunk
    paged: Paged | None = None
    lora: StepLora | None = None  # the step's LoRA adapter rows (None: every row is the base model's)
    hidden: bool = False  # give those tokens' final hidden states (after the last norm), not their logits
    image_rows: torch.Tensor | None = None  # rows whose token is an image's: their embeddings are image_embeddings'
    image_embeddings: torch.Tensor | None = None
    rope: torch.Tensor | None = None  # [3, T] M-RoPE's positions (None: `positions` on every axis)

    def rotary_positions(self) -> torch.Tensor:
        """The positions the model's rotary embedding takes: [1, T], or M-RoPE's [3, 1, T]."""
        return self.positions[None] if self.rope is None else self.rope[:, None]
