"""Decode steps on CUDA replayed from CUDA graphs, one per batch-size and context bucket.

A decode step of a small model on a GPU is mostly kernel launches: some ten per layer, each a
few microseconds of CPU for microseconds of GPU work. A CUDA graph records a step's launches
once and replays them in one call, as vLLM and nano-vllm do for decode.

A graph replays fixed shapes at fixed addresses, so a step runs on static buffers:
- the batch is padded up to a bucket (1, 2, 4, 8, then multiples of 16 up to the largest batch);
  padding rows decode token 0 at position 0 into a scratch cache block no request owns;
- attention reads a fixed number of cache blocks per request, a power-of-two bucket at least as
  long as the step's longest context, masked past each request's own length.

Graphs are captured the first time a bucket is needed (a fraction of a second each) and kept;
all share one memory pool, as they replay one at a time. Steps with prefill chunks or
speculative verifies, and decodes past the largest bucket, run eagerly.

On a CPU the same static-buffer step runs without capture; the tests use it to check the padding
and masking on machines with no GPU.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from worker.model.batch import AttentionGroup, SchedulerOutput, StepInputs

log = logging.getLogger(__name__)


class GraphedRunner(Protocol):
    """What the graphs read of the runner (worker/model/model_runner.py PagedRunner), besides what
    its forward reads."""

    device: torch.device
    block_size: int
    context_length: int
    window: int  # the sliding window (0: none)


def batch_buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


def block_buckets(max_blocks: int) -> list[int]:
    buckets, b = [], 4
    while b < max_blocks:
        buckets.append(b)
        b *= 2
    return buckets + [max_blocks]


class DecodeGraphs:
    def __init__(self, runner: GraphedRunner, forward: Callable[[GraphedRunner, StepInputs], torch.Tensor],
                 max_batch: int, scratch_block: int):
        """`forward`: the runner's (the plan's llama-fused, worker/model/forwards/llama_fused.py),
        run over the static buffers and captured."""
        self.runner, self.forward = runner, forward
        self.capture = runner.device.type == "cuda"
        self.scratch = scratch_block
        self.batches = batch_buckets(max_batch)
        bs = runner.block_size
        self.max_blocks = min(scratch_block, -(-runner.context_length // bs))
        self.spans = block_buckets(self.max_blocks)
        dev, long = runner.device, dict(dtype=torch.long)
        rows = self.batches[-1]
        # Token id, position, cache slot and context length of each row, filled by one copy a step.
        self.inputs = torch.zeros((4, rows), **long, device=dev)
        self.ids, self.positions, self.slots, self.context = self.inputs
        self.tables = torch.zeros((rows, self.max_blocks), **long, device=dev)
        self.rows = torch.arange(rows, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.steps = 0  # steps served from the static buffers

    def fits(self, out: SchedulerOutput) -> bool:
        """A step of decodes only (one token, one logits row each) that a bucket holds."""
        chunks = out.chunks
        if not chunks or len(chunks) > self.batches[-1]:
            return False
        bs = self.runner.block_size
        return all(c.length == 1 and c.num_logits == 1 and c.start // bs < self.max_blocks for c in chunks)

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        chunks, bs = out.chunks, self.runner.block_size
        batch = next(b for b in self.batches if b >= len(chunks))
        need = max(c.start // bs + 1 for c in chunks)
        span = next(k for k in self.spans if k >= need)
        self._fill(chunks, batch, span)
        self.steps += 1
        if not self.capture:
            return self._step(batch, span)[:len(chunks)]
        key = (batch, span)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, span)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:len(chunks)].clone()  # the next replay writes over the static output

    def _fill(self, chunks: list, batch: int, span: int) -> None:
        """The step's inputs into the static buffers; rows past the step's are padding."""
        bs, pad = self.runner.block_size, batch - len(chunks)
        ids = [c.input_ids[0] for c in chunks] + [0] * pad
        positions = [c.start for c in chunks] + [0] * pad
        slots = [c.block_table[c.start // bs] * bs + c.start % bs for c in chunks] + [self.scratch * bs] * pad
        context = [c.start + 1 for c in chunks] + [1] * pad
        tables = [c.block_table[:span] + [self.scratch] * (span - min(span, len(c.block_table))) for c in chunks]
        tables += [[self.scratch] * span] * pad
        self.inputs[:, :batch].copy_(torch.tensor([ids, positions, slots, context], dtype=torch.long))
        self.tables[:batch, :span].copy_(torch.tensor(tables, dtype=torch.long))

    def _step(self, batch: int, span: int) -> torch.Tensor:
        """The runner's forward over the static buffers: logits [batch, vocab]."""
        runner = self.runner
        length = span * runner.block_size
        keys, context = torch.arange(length, device=runner.device)[None, :], self.context[:batch, None]
        mask = keys < context
        windowed = mask & (keys >= context - runner.window) if runner.window else mask  # sliding-window layers'
        rows = self.rows[:batch]
        group = AttentionGroup(rows, None, None, self.tables[:batch, :span].flatten(), length, mask[:, None, None, :],
                       windowed[:, None, None, :])
        step = StepInputs(self.ids[:batch], self.positions[:batch], self.slots[:batch], [group], rows)
        return self.forward(runner, step)

    def _capture(self, batch: int, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy inits and the allocator, outside the capture
            self._step(batch, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._step(batch, span)
        log.info("captured the decode graph for batch %d, %d cache blocks (%d graphs)", batch, span,
                 len(self.graphs) + 1)
        return graph, logits
