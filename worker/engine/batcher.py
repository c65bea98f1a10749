"""The batcher (pure Python): which requests run in the next step, and how many tokens each.

Every step it first gives each running request its next tokens (one for a decode; the next
chunk of the prompt for a prefill in progress), oldest first, within the step's token budget.
When the KV cache has no block left for one, it preempts the newest running request of the
worst service tier among those not yet given tokens in the step (its blocks are freed and it is
recomputed later; cached blocks of its prefix stay shareable). Before that, where a request of
a better tier than `flex` waits with no batch slot or too few free blocks for its first chunk,
running `flex` requests are preempted, newest first, to make room for it (shared/service_tier.py),
and while a `priority` request waits or has yet to give its first token, running `flex` requests
sit the steps out (their cache kept), so its prompt runs beside no flex decode. Then, unless the
cache ran short, it admits waiting requests while batch slots, the token budget and free blocks
allow, sharing the cached blocks of their prefix. A finished request's slot is refilled at the very next step.
Which waiting request goes next is the fair queue's choice: tenants share the batch by
weight, whatever their backlogs (every token scheduled is charged to its tenant). A request
whose grammar is still being built waits in the queue as WAITING_FOR_GRAMMAR, passed over
until the engine has its matcher and marks it WAITING.
"""
from __future__ import annotations

import math
import time
from typing import Any

from shared.service_tier import PREEMPTIBLE_RANK, RANK
from shared.settings import check_budget
from worker.engine.block_manager import BlockManager
from worker.engine.fair_queue import FairQueue
from worker.engine.sequence import Sequence, Status
from worker.model.batch import Chunk, SchedulerOutput

PRIORITY_RANK = RANK["priority"]
PRIORITY_HOLD_S = 1.0  # flex stays capped this long after the last priority request ran
# While capped, a flex request's prompt goes in chunks of at most this many tokens: a long one
# would otherwise fill the step's budget, and the next priority prompt would wait for it.
FLEX_CHUNK_BESIDE_PRIORITY = 64


class Batcher:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 flex_beside_priority: int | None = None):
        check_budget(max_num_batched_tokens, max_num_seqs)
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The most flex requests given tokens in a step that runs a priority request (None: no cap).
        self.flex_beside_priority = flex_beside_priority
        self.clock = time.monotonic
        self._priority_seen_at = -math.inf
        self.waiting = FairQueue()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a request; one WAITING_FOR_GRAMMAR stays so, and is passed over until the engine
        marks it WAITING."""
        if seq.status is not Status.WAITING_FOR_GRAMMAR:
            seq.status = Status.WAITING
        self.waiting.add(seq)

    def max_tokens_per_request(self) -> int:
        """The most tokens (prompt + output) one request can ever hold in the cache."""
        return len(self.blocks.blocks) * self.blocks.block_size

    def has_work(self) -> bool:
        """Whether a step has a request to run (one waiting for its grammar does not count)."""
        return bool(self.running) or self.waiting.peek() is not None

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled request out and free its blocks."""
        if seq in self.running:  # its status may say finished already
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        yielded = self._yield_to_better_tier(out)
        # While a priority request waits or prefills, running flex requests sit the step out (their
        # cache kept): its prompt runs beside no flex decode, so its first token comes as soon as the
        # step it waited for ends. While one decodes, and PRIORITY_HOLD_S after, at most
        # flex_beside_priority flex requests (the oldest) run: on a CPU a step's time grows with its
        # batch, and the next priority request's first token waits for the step in flight. A step
        # with nothing else to run still runs them.
        flex_slots = 0 if self._priority_starting() else \
            self.flex_beside_priority if self._priority_running() else None
        self._fill(out, yielded, flex_slots)
        if flex_slots is not None and not out.chunks:  # nothing else to run: they run after all
            self._fill(out, yielded, None)
        return out

    def _fill(self, out: SchedulerOutput, yielded: int, flex_slots: int | None) -> None:
        """The running requests' next tokens, then waiting ones admitted, at most `flex_slots` flex
        requests in all (None: any number)."""
        budget = self._run_running(out, self.max_num_batched_tokens, flex_slots)
        short = len(out.preempted) > yielded  # the cache ran short: admit nobody this step
        while not short and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting.peek()
            if seq is None:
                break
            if flex_slots is not None and seq.tier >= PREEMPTIBLE_RANK:
                if self._flex_given(out) >= flex_slots:
                    break  # the queue is tier first: nobody better waits behind it
            computed = self.blocks.allocate_prefix(seq.id, seq.cache_ids, seq.kv_root)
            length = _whole_images(seq, computed, min(seq.num_tokens - computed, budget,
                                                      _flex_chunk(seq, flex_slots)))
            if self.blocks.blocks_needed(seq.id, computed + length) > self.blocks.num_free:
                self.blocks.free(seq.id)  # not now: give back the shared prefix
                break
            seq.num_computed = computed
            if seq.reused_tokens is None:  # its first admission: a preempted one's own blocks are no reuse
                seq.reused_tokens = computed
            self.waiting.pop()
            self.running.append(seq)
            seq.status = Status.RUNNING
            out.chunks.append(self._chunk(seq, computed, length))
            budget -= length

    def _run_running(self, out: SchedulerOutput, budget: int, flex_slots: int | None) -> int:
        """Give the running requests their next tokens, oldest first, within `budget` (at most
        `flex_slots` flex ones, unless None); the budget left."""
        i, flex = 0, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if flex_slots is not None and seq.tier >= PREEMPTIBLE_RANK and flex >= flex_slots:
                i += 1
                continue  # sits the step out, its cache kept
            length = _whole_images(seq, seq.num_computed, min(seq.num_tokens - seq.num_computed, budget,
                                                              _flex_chunk(seq, flex_slots)))
            if not self._make_room(i, seq.num_computed + length, out):
                continue  # seq itself was preempted (the newest of the worst tier): the next is at i now
            out.chunks.append(self._chunk(seq, seq.num_computed, length))
            budget -= length
            flex += seq.tier >= PREEMPTIBLE_RANK
            i += 1
        return budget

    def _priority_running(self) -> bool:
        """Whether a priority request runs, or ran within PRIORITY_HOLD_S: a priority client's next
        request comes soon after its last one ends, and finds a capped step in flight."""
        if self.flex_beside_priority is None:
            return False
        now = self.clock()
        if any(s.tier == PRIORITY_RANK for s in self.running):
            self._priority_seen_at = now
        return now - self._priority_seen_at < PRIORITY_HOLD_S

    @staticmethod
    def _flex_given(out: SchedulerOutput) -> int:
        return sum(c.seq.tier >= PREEMPTIBLE_RANK for c in out.chunks)

    def _priority_starting(self) -> bool:
        """Whether a priority request waits (first in the queue) or has yet to give its first token."""
        head = self.waiting.peek()
        if head is not None and head.tier == PRIORITY_RANK:
            return True
        return any(s.tier == PRIORITY_RANK and not s.output_ids for s in self.running)

    def speculate(self, out: SchedulerOutput, chunk: Chunk, draft: list[int], probs: Any = None) -> int:
        """Add proposed tokens (and the proposer's distributions over them, if any) to a decode
        chunk, as many as the step's leftover budget and the free blocks allow without
        preempting anyone; return how many were added."""
        seq, end = chunk.seq, chunk.start + chunk.length
        n = min(len(draft), self.max_num_batched_tokens - out.num_tokens)
        while n and self.blocks.blocks_needed(seq.id, end + n) > self.blocks.num_free:
            n -= 1
        if n:
            self.waiting.charge(seq, n)
            self.blocks.append_slots(seq.id, end + n)
            chunk.draft, chunk.input_ids = list(draft[:n]), chunk.input_ids + list(draft[:n])
            chunk.num_logits, chunk.draft_probs = 1 + n, None if probs is None else probs[:n]
            chunk.block_table = self.blocks.table(seq.id)
        return n

    def computed(self, chunk: Chunk, kept: int = 0) -> None:
        """The step ran the chunk: its known tokens, and `kept` of its proposed ones (those the
        sampler accepted), have keys and values in the cache now. Blocks that held only rejected
        proposals go back; the slots of rejected ones in a kept block are overwritten later."""
        seq = chunk.seq
        seq.num_computed = chunk.start + chunk.length - len(chunk.draft) + kept
        if chunk.draft:
            self.blocks.truncate(seq.id, seq.num_computed + 1)

    def _chunk(self, seq: Sequence, start: int, length: int) -> Chunk:
        self.waiting.charge(seq, length)
        self.blocks.append_slots(seq.id, start + length)
        # Register the blocks this chunk fills now, not after the step: a request admitted later
        # in this same step may share them, since every layer writes the step's keys and values
        # to the cache before any attention reads it.
        self.blocks.register(seq.id, seq.cache_ids, start + length)
        end = start + length
        return Chunk(seq, start, seq.token_ids[start:end], self.blocks.table(seq.id), int(end == seq.num_tokens))

    def _make_room(self, i: int, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt running requests not yet given tokens this step (running[i:]), the newest of
        the worst tier first, until running[i] fits; False if running[i] itself went."""
        seq = self.running[i]
        while self.blocks.blocks_needed(seq.id, num_tokens) > self.blocks.num_free:
            rest = self.running[i:]
            worst = max(s.tier for s in rest)
            victim = next(s for s in reversed(rest) if s.tier == worst)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _yield_to_better_tier(self, out: SchedulerOutput) -> int:
        """Preempt running `flex` requests, the newest first, while the next waiting request is of
        a better tier and has no room: no batch slot, or fewer free blocks than its first chunk
        needs (its cached prefix not counted, so this may free a block too many). How many went."""
        head = self.waiting.peek()
        if head is None or head.tier >= PREEMPTIBLE_RANK:
            return 0
        need = self.blocks.blocks_needed(head.id, min(head.num_tokens, self.max_num_batched_tokens))
        gone = 0
        while len(self.running) >= self.max_num_seqs or need > self.blocks.num_free:
            victim = next((s for s in reversed(self.running) if s.tier >= PREEMPTIBLE_RANK), None)
            if victim is None:
                break
            self._preempt(victim, out)
            gone += 1
        return gone

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        """Back to the queue (at its first arrival's place), its blocks freed: recomputed when readmitted."""
        self.running.remove(victim)
        self.blocks.free(victim.id)
        victim.num_computed = 0
        victim.status = Status.PREEMPTED
        self.waiting.add(victim)
        out.preempted.append(victim)
        self.num_preemptions += 1


def _flex_chunk(seq: Sequence, flex_slots: int | None) -> int:
    """The most tokens `seq` gets in a step: FLEX_CHUNK_BESIDE_PRIORITY for a flex request while flex
    is capped, else no limit."""
    return FLEX_CHUNK_BESIDE_PRIORITY if flex_slots is not None and seq.tier >= PREEMPTIBLE_RANK else 1 << 62


def _whole_images(seq: Sequence, start: int, length: int) -> int:
    """A chunk's length, so that it never ends inside an image's tokens: cut before an image that
    starts within it, or, where the image starts at (or, its first blocks cached, before) the
    chunk's start, stretched to the image's end (over the step's budget by less than an image)."""
    image = seq.vision.image_at(start + length) if seq.vision is not None and length > 0 else None
    if image is None or image[0] == start + length:  # no image there, or one that starts there
        return length
    image_start, image_end = image
    return image_start - start if image_start > start else image_end - start
