"""A step's inputs built from the scheduler's chunks: the flat batch of token ids, positions and
cache slots, the rows whose logits the step needs, and the index tensors attention runs on.

The rows of logits are each sampling chunk's last token plus one per proposed token: a
speculative verify is a chunk of its known token and the proposed ones, and the engine's
acceptance rule (worker/engine/acceptance.py) reads one row per proposed token. A pooling step
takes the same rows as final hidden states (worker/model/lm_head.py output).

With the CPU step kernels every chunk attends through the paged kernel (`Paged`), whose result
for a token depends on its own sequence only (worker/model/csrc/paged_attention.cpp): a decode, a
prefill chunk of any length, a cached prefix and a failover's replay give a token the same bits.
Otherwise chunks attend in groups of like length (`AttentionGroup`: decodes, short chunks such
as speculative verifies, long prefill chunks), each padded to its longest chunk and masked
causally (and within the sliding window, for the layers that have one). Everything is built once
per step, vectorised; the forwards run no per-request Python loop inside a layer."""
from __future__ import annotations

import torch

from worker.model.batch import AttentionGroup, Chunk, Paged, StepInputs


def step_inputs(chunks: list[Chunk], device: torch.device, block_size: int, window: int,
                paged: bool, mrope: bool = False, both_ways: bool = False) -> StepInputs:
    """The step's inputs on `device`; `window`: the model's sliding window (0: none); `paged`:
    every chunk on the paged kernel (the plan's CPU kernels), else in attention groups; `mrope`:
    the model's rotary takes M-RoPE's three axes, which the chunks' requests give; `both_ways`: an
    image's tokens attend to each other both ways (the chunks' requests say where)."""
    bs = block_size
    ids, positions, slots, logits_index = [], [], [], []
    rope: list[list[int]] | None = None  # M-RoPE's three axes, once a chunk has them
    groups: dict[int, list] = {}
    for chunk in chunks:
        first = len(ids)
        span = range(chunk.start, chunk.start + chunk.length)
        axes = chunk.seq.rope_positions(span.start, span.stop) if mrope and chunk.seq is not None else None
        if axes is not None and rope is None:
            rope = [list(positions) for _ in range(3)]
        if rope is not None:
            for axis, values in zip(rope, axes or (span, span, span)):
                axis += values
        ids += chunk.input_ids
        positions += span
        slots += [chunk.block_table[p // bs] * bs + p % bs for p in span]
        groups.setdefault(_size_class(chunk.length), []).append((first, chunk))
        logits_index += range(len(ids) - chunk.num_logits, len(ids))
    total = len(ids)
    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)
    # The last key each chunk's tokens attend to, where some see past themselves (None: causal)
    ends = {id(c): c.seq.attention_ends(c.start, c.start + c.length) if both_ways and c.seq is not None else None
            for c in chunks}
    kernel = None
    if paged:  # every chunk, taken out of the groups
        kernel = _paged([m for size in sorted(groups) for m in groups.pop(size)], chunks, bs, ends)
    step = StepInputs(tensor(ids), tensor(positions), tensor(slots),
                      [_group(groups[size], total, device, bs, window, ends) for size in sorted(groups)],
                      tensor(logits_index), kernel)
    if rope is not None:
        step.rope = torch.tensor(rope, dtype=torch.long, device=device)
    return step


def _paged(members: list, chunks: list[Chunk], bs: int, ends: dict) -> Paged:
    row_of = {id(chunk): row for row, chunk in enumerate(chunks)}
    width = max((-(-(c.start + c.length) // bs) for c in chunks), default=1)
    tables = [c.block_table[:width] + [0] * (width - min(width, len(c.block_table))) for c in chunks]
    tokens, rows, context, positions = [], [], [], []
    for first, chunk in members:
        row = row_of[id(chunk)]
        tokens += range(first, first + chunk.length)
        rows += [row] * chunk.length
        span = range(chunk.start, chunk.start + chunk.length)
        last = ends[id(chunk)]
        context += [p + 1 for p in (last or span)]
        positions += span
    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)
    seeing_past = any(ends[id(chunk)] is not None for _, chunk in members)
    return Paged(tensor(tokens), tensor(rows), tensor(context), tensor(tables),
                 tensor(positions) if seeing_past else None)


def _group(members: list, total: int, dev: torch.device, bs: int, window: int, ends: dict) -> AttentionGroup:
    width = max(c.length for _, c in members)
    nblocks = max(-(-(c.start + c.length) // bs) for _, c in members)
    first = torch.tensor([f for f, _ in members])
    start = torch.tensor([c.start for _, c in members])
    length = torch.tensor([c.length for _, c in members])
    blocks = torch.zeros((len(members), nblocks), dtype=torch.long)
    for row, (_, chunk) in enumerate(members):
        table = chunk.block_table[:nblocks]
        blocks[row, :len(table)] = torch.tensor(table, dtype=torch.long)
    q = torch.arange(width)
    real = q[None, :] < length[:, None]  # [S, Q]: a query of the chunk, not padding
    # Query q (at position start + q) sees keys 0 .. start + q: causal within the chunk (an image's
    # token that sees the whole image: to the image's last).
    keys, position = torch.arange(nblocks * bs)[None, None, :], (start[:, None] + q[None, :])[:, :, None]
    last = position
    if any(ends[id(c)] is not None for _, c in members):
        last = position.clone()
        for row, (_, chunk) in enumerate(members):
            if ends[id(chunk)] is not None:
                last[row, :chunk.length, 0] = torch.tensor(ends[id(chunk)])
    masks = [keys <= last]
    if 0 < window < nblocks * bs:  # the sliding-window layers' mask: from position-window+1 on
        masks.append(masks[0] & (keys > position - window))
    for m in masks:
        m &= real[:, :, None]
        m[:, :, 0] |= ~real  # padded queries attend somewhere, to stay finite; dropped later
    masks = [m[:, None].to(dev) for m in masks]
    mask, windowed = masks[0], masks[-1]
    tokens = (first[:, None] + q[None, :])[real]
    blocks, span = blocks.flatten().to(dev), nblocks * bs
    if width == 1:
        return AttentionGroup(tokens.to(dev), None, None, blocks, span, mask, windowed)
    query_index = torch.where(real, first[:, None] + q[None, :], total)
    unpad = (torch.arange(len(members))[:, None] * width + q[None, :])[real]
    return AttentionGroup(tokens.to(dev), query_index.to(dev), unpad.to(dev), blocks, span, mask, windowed)


def _size_class(length: int) -> int:
    """Chunks attend in groups of like length, so few queries are padding: decodes (1), short
    chunks (speculative verifies, prompt tails: up to 32) and longer prefill chunks."""
    return 0 if length == 1 else 1 if length <= 32 else 2
