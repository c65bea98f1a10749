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
from worker.engine.fair_queue import FairQueue
from worker.engine.base import BaseEngine
from worker.engine.execution_plan import ExecutionPlan, null_plan
from worker.engine.sequence import Sequence, StepOutput, new_sequence, step_output

NULL_TOKEN = 0  # every token the null backend emits has this id


class NullEngine(BaseEngine):
    def __init__(self, batch_size: int, tokens_per_s: float):
        super().__init__(batch_size)
        self.interval = 1.0 / tokens_per_s
        self._running: list[Sequence] = []
        self._waiting = FairQueue()  # tenants share the batch as in the real engine
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = ()) -> Sequence:
        seq = new_sequence(payload, lambda ids: "", resumed)
        with self._lock:
            self._waiting.add(seq)
        return seq

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting)

    @property
    def free_slots(self) -> int:
        return max(0, self.batch_size - len(self._running) - len(self._waiting))

    @property
    def plan(self) -> ExecutionPlan:
        return null_plan()

    def step(self) -> list[StepOutput]:
        """Wait for the next tick, then give every running request one token."""
        delay = self._next - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self._next = max(self._next + self.interval, time.monotonic())
        outputs = self._end_cancelled()
        with self._lock:
            while self._waiting and len(self._running) < self.batch_size:
                self._running.append(seq := self._waiting.pop())
                seq.scheduled_at = seq.scheduled_at or now()
        self.last_step_size = len(self._running)
        stamp = f"{time.time():.6f} "
        still = []
        for seq in self._running:
            if seq.params.structured_outputs is not None:  # its tokens are not text: nothing to constrain
                seq.finish(FinishReason.ERROR, "the null backend cannot follow structured_outputs")
                outputs.append(step_output(seq, None, True))
                continue
            seq.append(NULL_TOKEN)
            self._waiting.charge(seq, 1)
            seq.detokenizer.text += stamp
            if len(seq.output_ids) >= (seq.params.max_tokens or 1):
                seq.finish(FinishReason.LENGTH)
            event = TokenEvent(index=len(seq.output_ids) - 1, token_id=NULL_TOKEN, text=stamp)
            outputs.append(step_output(seq, event, seq.finished))
            if not seq.finished:
                still.append(seq)
        self._running = still
        return outputs

    def _running_or_waiting(self) -> list[Sequence]:
        with self._lock:
            return self._running + list(self._waiting)

    def _forget(self, seq: Sequence) -> None:
        with self._lock:
            if seq in self._running:
                self._running.remove(seq)
            elif seq in self._waiting:
                self._waiting.remove(seq)

    def _reset(self) -> None:
        with self._lock:
            self._running, self._waiting = [], FairQueue()
