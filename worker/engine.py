"""The continuous-batching engine: schedule, execute, update, once per step.

The batcher picks each step's requests and token counts, the paged runner runs them in one
forward, and the update samples each request's next token and decides whether it ends. A
finished or cancelled request leaves the batch at once and its slot is refilled next step.
"""
from __future__ import annotations

import threading

import torch

from shared.messages import FinishReason, RequestPayload, TokenEvent
from shared.tokenizer import Tokenizer
from worker.batcher import Batcher, SchedulerOutput
from worker.model_runner import PagedRunner
from worker.sampler import make_generator, sample_batch
from worker.cancels import CancelInbox
from worker.sequence import Sequence, StepOutput, new_sequence, token_event


class Engine:
    def __init__(self, runner: PagedRunner, tokenizer: Tokenizer, batcher: Batcher):
        self.runner = runner
        self.tokenizer = tokenizer
        self.batcher = batcher
        self.batch_size = batcher.max_num_seqs
        self._generators: dict[str, torch.Generator | None] = {}
        self._refused: list[Sequence] = []  # requests that can never fit, ended at the next step
        self.cancels = CancelInbox()
        self.last_step_size = 0  # requests in the last step (prefill chunks and decodes), for metrics
        self._lock = threading.RLock()  # add() and the views come from the event loop, step() from the model thread

    # -- called from the asyncio side ------------------------------------------------------
    def add(self, payload: RequestPayload, stream_entry: str, resumed: list[TokenEvent] | tuple = ()) -> Sequence:
        seq = new_sequence(payload, stream_entry, self.tokenizer.decode, resumed)
        need = len(payload.prompt_token_ids) + (payload.params.max_tokens or 0)
        with self._lock:
            if need > self.batcher.max_tokens_per_request():
                seq.finish_reason = FinishReason.ERROR
                seq.error = (f"the request needs {need} tokens of KV cache; this worker's cache holds "
                             f"{self.batcher.max_tokens_per_request()}")
                self._refused.append(seq)
            else:
                self._generators[seq.id] = make_generator(payload.params, self.runner.device)
                self.batcher.add(seq)
        return seq

    def cancel(self, request_id: str) -> None:
        self.cancels.add(request_id)

    @property
    def running(self) -> list[Sequence]:
        with self._lock:
            return list(self.batcher.running)

    @property
    def waiting(self) -> list[Sequence]:
        with self._lock:
            return list(self.batcher.waiting)

    @property
    def free_slots(self) -> int:
        """Requests to take from the queue now: just enough to fill the batch. The rest stay
        queued in Redis (truthfully 'queued', and free for another worker to take)."""
        return max(0, self.batch_size - len(self.batcher.running) - len(self.batcher.waiting))

    def has_work(self) -> bool:
        return self.batcher.has_work() or bool(self._refused)

    # -- one step, run in the model thread -------------------------------------------------
    def step(self) -> list[StepOutput]:
        with self._lock:
            outputs = self._end_cancelled() + [StepOutput(s, None, True) for s in self._refused]
            self._refused = []
            scheduled = self.batcher.schedule()
            self.last_step_size = len(scheduled.chunks)
        if scheduled.chunks:
            logits = self.runner.execute(scheduled)
            self.batcher.update(scheduled)
            outputs += self._update(scheduled, logits)
        return outputs

    def fail_all(self, error: str) -> list[StepOutput]:
        """End every admitted request with an error (the step itself failed)."""
        outputs = []
        for seq in self.running + self.waiting:
            seq.finish_reason, seq.error = FinishReason.ERROR, error
            self._remove(seq)
            outputs.append(StepOutput(seq, None, True))
        self.batcher.blocks.clear_prefix_cache()  # the failed step may have left them half written
        return outputs

    def _end_cancelled(self) -> list[StepOutput]:
        cancelled = self.cancels.take()
        outputs = []
        for seq in self.running + self.waiting:
            if seq.id in cancelled:
                seq.finish_reason = FinishReason.CANCELLED
                self._remove(seq)
                outputs.append(StepOutput(seq, None, True))
        return outputs

    def _remove(self, seq: Sequence) -> None:
        self.batcher.remove(seq)
        self._generators.pop(seq.id, None)

    def _update(self, scheduled: SchedulerOutput, logits: torch.Tensor) -> list[StepOutput]:
        sampling = [c.seq for c in scheduled.chunks if c.samples]
        tokens, logprobs = sample_batch(logits, sampling, [self._generators[s.id] for s in sampling])
        outputs = []
        eos, context = self.tokenizer.eos_token_ids, self.runner.context_length
        for seq, token, lp in zip(sampling, tokens, logprobs):
            text = seq.accept(token, eos, context)
            if seq.finished:
                self._remove(seq)
            outputs.append(StepOutput(seq, token_event(seq, token, text, lp), seq.finished))
        return outputs

