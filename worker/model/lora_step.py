"""Each row's LoRA delta in one step whose rows belong to several adapters and to the base model.

As Punica and S-LoRA do: every projection runs once over all of the step's rows on the base
weights; then, for each adapter present in the step, its rows are gathered, their low-rank
product (x A^T)(scale B)^T computed, and added into those rows of the projection's output. A
base-model row gets no delta at all, so its bits are the base step's. A fused projection (q/k/v,
gate/up) takes its parts' deltas as one pair: the targeted parts' A stacked, their B placed
block-diagonally at the part's rows (worker/model/lora.py), a zero delta for a part not targeted.

A small step (decodes) of several adapters runs each fused projection's deltas as ONE pair of
matmuls over all its rows instead: the step's adapters' A side by side, each row's product masked
to its own adapter's columns (zero for a base row), then their B side by side. At decode sizes the
calls, not the arithmetic, are the cost: 16 streams of 4 adapters on the default model ran at 0.49x
the base model's W with a gathered product per adapter (docs/lora.md).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from worker.model.fused_layers import FusedLayer
from worker.model.lora import FUSED, Adapters, LoraAdapter

# (rows of the step, or None for all of them; A; scale B) of one adapter at one projection.
Pair = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]
# Steps of up to this many rows (and more than one adapter, or base rows too) stack their adapters
# (above); larger ones (prefill) gather each adapter's rows, computing nothing for other adapters'.
STACK_ROWS = 64


class StepLora:
    """The adapters of one step's rows: (adapter, its rows) for each adapter present."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor | None]], tile: int = 0,
                 stack: list[dict] | None = None, owner: torch.Tensor | None = None):
        """`groups`: each adapter with the flat indices of its rows (None: every row of the step);
        `tile`: the deltas' matmuls in calls of exactly this many rows (0: any number); `stack`:
        Adapters.stacked() of the groups' adapters, in order, with `owner`, each row's index among
        them (-1: the base model), to run the fused projections stacked."""
        self.groups, self.tile, self.stack, self.owner = groups, tile, stack, owner
        self._masks: dict[tuple, torch.Tensor] = {}  # a stacked projection's column owners -> its row mask

    @classmethod
    def of(cls, chunks: list, adapters: Adapters | None, device: torch.device) -> StepLora | None:
        """The step's adapter rows, chunk by chunk (a chunk's tokens are consecutive rows, proposed
        tokens included); None where every row is the base model's."""
        rows: dict[tuple[str, int], list[int]] = {}  # by adapter and revision: a reload's rows beside the old one's
        first = 0
        for chunk in chunks:
            seq = chunk.seq
            if seq is not None and seq.adapter is not None:
                key = (seq.adapter, seq.adapter_revision or 0)
                rows.setdefault(key, []).extend(range(first, first + chunk.length))
            first += chunk.length
        if not rows:
            return None
        if adapters is None:
            raise ValueError(f"adapters {sorted(name for name, _ in rows)} asked for on a runner that serves none")
        keys = tuple(sorted(rows))
        groups = [(adapters.get(key), None if len(rows[key]) == first else torch.tensor(rows[key], device=device))
                  for key in keys]
        if first > STACK_ROWS or adapters.tile or groups[0][1] is None:
            return cls(groups, adapters.tile)
        owner = torch.full((first,), -1)
        for j, key in enumerate(keys):
            owner[rows[key]] = j
        return cls(groups, 0, adapters.stacked(keys), owner.to(device))

    def layers(self, fused: list[FusedLayer]) -> list[FusedLayer]:
        """The fused layers with each targeted projection adding this step's deltas."""
        if self.stack is not None:
            return [replace(layer, **{p: _Stacked(getattr(layer, p), a, b, self._mask(owner, x_dtype(a)))
                                      for p, (a, b, owner) in self.stack[i].items()})
                    for i, layer in enumerate(fused)]
        out = []
        for i, layer in enumerate(fused):
            changes = {}
            for projection in FUSED:
                pairs = [(rows, *adapter.fused[i][projection]) for adapter, rows in self.groups
                         if projection in adapter.fused[i]]
                if pairs:
                    changes[projection] = _WithDelta(getattr(layer, projection), pairs, self.tile)
            out.append(replace(layer, **changes) if changes else layer)
        return out

    def _mask(self, owner: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, columns]: 1 where the column is the row's own adapter's, else 0."""
        key = (owner.data_ptr(), owner.shape[0])  # one owner tensor per stacked projection: shared by layers alike
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = (self.owner[:, None] == owner[None, :]).to(dtype)
        return mask

    def project(self, layer: int, name: str, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's own module `name` (q_proj, ...) of layer `layer` on x, plus the deltas."""
        pairs = [(rows, *adapter.modules[layer][name]) for adapter, rows in self.groups
                 if name in adapter.modules[layer]]
        return add_deltas(module(x), x, pairs, self.tile)

    def mlp(self, layer: int, mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A llama MLP, down(act(gate(x)) * up(x)), each projection with its deltas."""
        if not self.groups:
            return mlp(x)
        gate = self.project(layer, "gate_proj", mlp.gate_proj, x)
        up = self.project(layer, "up_proj", mlp.up_proj, x)
        return self.project(layer, "down_proj", mlp.down_proj, mlp.act_fn(gate) * up)


class _WithDelta:
    """A fused projection (worker/model/fused_layers.py Weight) followed by its deltas."""

    def __init__(self, base, pairs: list[Pair], tile: int):
        self.base, self.pairs, self.tile = base, pairs, tile

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return add_deltas(self.base(x), x, self.pairs, self.tile)


class _Stacked:
    """A fused projection followed by the step's adapters' deltas, stacked: (x A^T * mask) B^T."""

    def __init__(self, base, a, b, mask: torch.Tensor):
        self.base, self.a, self.b, self.mask = base, a, b, mask  # a, b: Weights (worker/model/fused_layers.py)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x).add_(self.b(self.a(x).mul_(self.mask)))


def x_dtype(weight) -> torch.dtype:
    return weight.w.dtype


def add_deltas(y: torch.Tensor, x: torch.Tensor, pairs: list[Pair], tile: int = 0) -> torch.Tensor:
    """y (the base projection of x, fresh: changed in place) plus each pair's delta on its rows."""
    for rows, a, b in pairs:
        if rows is None:
            y += _low_rank(x, a, b, tile)
        else:
            y.index_add_(0, rows, _low_rank(x.index_select(0, rows), a, b, tile))
    return y


def _low_rank(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tile: int) -> torch.Tensor:
    if not tile or x.shape[0] == 0:
        return F.linear(F.linear(x, a), b)
    # Deterministic mode: every call has `tile` rows, so a row's bits do not hang on how many
    # rows the step gave this adapter (a library matmul picks its blocking by the row count).
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -rows % tile))
    return torch.cat([F.linear(F.linear(padded[i:i + tile], a), b) for i in range(0, padded.shape[0], tile)])[:rows]
