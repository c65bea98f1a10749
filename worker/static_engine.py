"""The static-batch engine: the slower path for architectures the paged runner lacks.

A batch is formed from the waiting requests when the previous one has drained; its rows
share one transformers KV cache (worker/runner.py). A finished or cancelled row stops
producing tokens at once; its slot is reused when the batch drains. Llama-family and OPT
models use the continuous engine (worker/engine.py) instead.
"""
from __future__ import annotations

from collections import deque

import torch

from shared.messages import FinishReason, RequestPayload, TokenEvent, now
from shared.tokenizer import Tokenizer
from worker.runner import BatchRunner
from worker.sampler import SamplingBatch, SamplingRow, fail_sampling, sample_each
from worker.cancels import CancelInbox
from worker.backend import Counts
from worker.sequence import Sequence, StepOutput, new_sequence, token_event


class StaticEngine:
    def __init__(self, runner: BatchRunner, tokenizer: Tokenizer, batch_size: int):
        self.runner = runner
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.waiting: deque[Sequence] = deque()
        self.rows: list[Sequence] = []  # the current batch, finished rows included
        self._sampling: dict[str, SamplingRow] = {}
        self.cancels = CancelInbox()

    # -- called from the asyncio side ------------------------------------------------------
    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = ()) -> Sequence:
        seq = new_sequence(payload, self.tokenizer.decode, resumed, self.tokenizer.decode_stream)
        self.waiting.append(seq)
        return seq

    def cancel(self, request_id: str) -> None:
        self.cancels.add(request_id)

    @property
    def free_slots(self) -> int:
        """How many requests the engine can take now: a whole batch once the last one drained."""
        return 0 if self.running or self.waiting else self.batch_size

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.rows if not s.finished]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_blocks(self) -> None:
        return None  # no paged cache

    def counts(self) -> Counts:
        return Counts()

    # -- one step, run in the model thread -------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs = self._apply_cancels()
        started = self._schedule()
        if self.running:
            logits = self._execute(started)
            outputs += self._update(logits)
        if self.rows and not self.running:
            self.rows = []
            self.runner.release()
        return outputs

    def fail_all(self, error: str) -> list[StepOutput]:
        """End every admitted request with an error (the step itself failed)."""
        outputs = []
        for seq in self.running + list(self.waiting):
            seq.finish(FinishReason.ERROR, error)
            outputs.append(StepOutput(seq, None, True))
        self.rows, self.waiting = [], deque()
        self.runner.release()
        return outputs

    def _apply_cancels(self) -> list[StepOutput]:
        cancelled = self.cancels.take()
        outputs = []
        for seq in self.running + list(self.waiting):
            if seq.id in cancelled:
                seq.finish(FinishReason.CANCELLED)
                outputs.append(StepOutput(seq, None, True))
        self.waiting = deque(s for s in self.waiting if not s.finished)
        return outputs

    def _schedule(self) -> bool:
        """Start a new batch if the last one drained; True if one started."""
        if self.rows or not self.waiting:
            return False
        while self.waiting and len(self.rows) < self.batch_size:
            seq = self.waiting.popleft()
            seq.scheduled_at = now()
            self._sampling[seq.id] = SamplingRow.of(seq, self.runner.device)
            self.rows.append(seq)
        return True

    def _execute(self, new_batch: bool) -> torch.Tensor:
        if new_batch:
            return self.runner.prefill([s.token_ids for s in self.rows])
        pad = self.runner.pad_id
        return self.runner.decode([s.output_ids[-1] if s.output_ids else pad for s in self.rows])

    def _update(self, logits: torch.Tensor) -> list[StepOutput]:
        rows = [(row, seq) for row, seq in enumerate(self.rows) if not seq.finished]
        seqs = [seq for _, seq in rows]
        picked = sample_each(logits[[row for row, _ in rows]], SamplingBatch([self._sampling[s.id] for s in seqs]))
        outputs = []
        for seq, result in zip(seqs, picked):
            if isinstance(result, Exception):  # its own parameters broke its sampling: it alone fails
                fail_sampling(seq, result)
                self._sampling.pop(seq.id, None)
                outputs.append(StepOutput(seq, None, True))
                continue
            ([token], [lp]) = result
            text = seq.accept(token, self.tokenizer.eos_token_ids, self.runner.context_length)
            if seq.finished:
                self._sampling.pop(seq.id, None)
            outputs.append(StepOutput(seq, token_event(seq, token, text, lp), seq.finished))
        return outputs
