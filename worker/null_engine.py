"""The null backend: an engine without a model that emits tokens at a set rate.

It exercises everything around the model (intake, publishing, the api's relay, clients) at
rates a real model cannot reach on a CPU, for load tests of the serving path. Each token's text
is the time it was emitted (`time.time()`, then a space), so a client can measure delivery
latency from worker to screen.
"""
from __future__ import annotations

import threading
import time

from shared.messages import FinishReason, RequestPayload, TokenEvent, now
from worker.cancels import CancelInbox
from worker.fair_queue import FairQueue
from worker.backend import Counts
from worker.sequence import Sequence, StepOutput, new_sequence

NULL_TOKEN = 0  # every token the null backend emits has this id


class NullEngine:
    def __init__(self, batch_size: int, tokens_per_s: float):
        self.batch_size = batch_size
        self.interval = 1.0 / tokens_per_s
        self._running: list[Sequence] = []
        self._waiting = FairQueue()  # tenants share the batch as in the real engine
        self.cancels = CancelInbox()
        self._lock = threading.Lock()
        self._next = time.monotonic()
        self.last_step_size = 0

    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = ()) -> Sequence:
        seq = new_sequence(payload, lambda ids: "", resumed)
        with self._lock:
            self._waiting.add(seq)
        return seq

    def cancel(self, request_id: str) -> None:
        self.cancels.add(request_id)

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting)

    @property
    def free_slots(self) -> int:
        return max(0, self.batch_size - len(self._running) - len(self._waiting))

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def kv_blocks(self) -> None:
        return None  # no paged cache

    def counts(self) -> Counts:
        return Counts()

    def step(self) -> list[StepOutput]:
        """Wait for the next tick, then give every running request one token."""
        delay = self._next - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self._next = max(self._next + self.interval, time.monotonic())
        outputs = []
        with self._lock:
            while self._waiting and len(self._running) < self.batch_size:
                self._running.append(seq := self._waiting.pop())
                seq.scheduled_at = seq.scheduled_at or now()
        self.last_step_size = len(self._running)
        cancelled = self.cancels.take()
        stamp = f"{time.time():.6f} "
        still = []
        for seq in self._running:
            if seq.id in cancelled:
                seq.finish(FinishReason.CANCELLED)
                outputs.append(StepOutput(seq, None, True))
                continue
            if seq.payload.params.structured_outputs is not None:  # its tokens are not text: nothing to constrain
                seq.finish(FinishReason.ERROR, "the null backend cannot follow structured_outputs")
                outputs.append(StepOutput(seq, None, True))
                continue
            seq.append(NULL_TOKEN)
            self._waiting.charge(seq, 1)
            seq.detokenizer.text += stamp
            if len(seq.output_ids) >= (seq.payload.params.max_tokens or 1):
                seq.finish(FinishReason.LENGTH)
            event = TokenEvent(index=len(seq.output_ids) - 1, token_id=NULL_TOKEN, text=stamp)
            outputs.append(StepOutput(seq, event, seq.finished))
            if not seq.finished:
                still.append(seq)
        self._running = still
        return outputs

    def fail_all(self, error: str) -> list[StepOutput]:
        outputs = []
        for seq in self._running + list(self._waiting):
            seq.finish(FinishReason.ERROR, error)
            outputs.append(StepOutput(seq, None, True))
        self._running, self._waiting = [], FairQueue()
        return outputs
