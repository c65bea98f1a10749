"""The continuous-batching engine: schedule, execute, update, once per step.

The batcher picks each step's requests and token counts, the speculator (when on) adds
proposed tokens to decodes, the paged runner runs them all in one forward, and the update
samples each request's next tokens and decides whether it ends. A finished or cancelled
request leaves the batch at once and its slot is refilled next step.
"""
from __future__ import annotations

import threading

import torch

from shared.messages import FinishReason, RequestPayload, TokenEvent, now
from shared.tokenizer import Tokenizer
from worker.batcher import Batcher, SchedulerOutput
from worker.model_runner import PagedRunner
from worker.sampler import fail_sampling, make_generator, sample_each
from worker.cancels import CancelInbox
from worker.sequence import Sequence, StepOutput, new_sequence, token_event
from worker.speculation import Speculator


class Engine:
    def __init__(self, runner: PagedRunner, tokenizer: Tokenizer, batcher: Batcher,
                 speculator: Speculator | None = None):
        self.runner = runner
        self.speculator = speculator
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
        seq = new_sequence(payload, stream_entry, self.tokenizer.decode, resumed,
                           self.tokenizer.decode_stream)
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
            stamp = now()
            for chunk in scheduled.chunks:
                if chunk.seq.scheduled_at is None:
                    chunk.seq.scheduled_at = stamp
            spec = self.speculator
            wanted = spec.wanted(scheduled, self.batcher, self.runner.context_length) if spec else []
        if wanted:
            proposals = spec.proposer.propose(wanted)  # unlocked: a draft model's forwards take a while
            with self._lock:
                spec.attach(scheduled, self.batcher, proposals)
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
        if self.speculator:
            self.speculator.forget(seq.id)

    def _update(self, scheduled: SchedulerOutput, logits: torch.Tensor) -> list[StepOutput]:
        chunks = [c for c in scheduled.chunks if c.samples]
        spec = self.speculator
        picked = sample_each(logits, [c.seq for c in chunks], [c.draft for c in chunks],
                             [self._generators[c.seq.id] for c in chunks],
                             [spec.draft_probs(c) if spec else None for c in chunks])
        outputs = []
        eos, context = self.tokenizer.eos_token_ids, self.runner.context_length
        for chunk, result in zip(chunks, picked):
            seq = chunk.seq
            if isinstance(result, Exception):  # its own parameters broke its sampling: it alone fails
                fail_sampling(seq, result)
                self._remove(seq)
                outputs.append(StepOutput(seq, None, True))
                continue
            tokens, logprobs = result
            if chunk.draft:  # every emitted token but the last was a proposed one, kept
                self.batcher.verified(seq, len(tokens) - 1)
                spec.verified(chunk, len(tokens) - 1)
            for token, lp in zip(tokens, logprobs):
                text = seq.accept(token, eos, context)
                outputs.append(StepOutput(seq, token_event(seq, token, text, lp), seq.finished))
                if seq.finished:
                    self._remove(seq)
                    break
        return outputs
