"""The engine of an encoder model (embeddings, cross-encoder scores): a step packs the next
inputs of the waiting pooling requests, in the tenants' fair shares (pooling.Shares), up to the
step's token budget (at least one input, however long), runs them in one forward of the encoder (worker/model/encoders.py)
and ends the requests whose every input is done. There is no KV cache: an input is seen once.

A generation sent to it ends at once with an error (the api refuses one before queueing it).
"""
from __future__ import annotations

import threading
import time

from shared.messages import FinishReason, RequestPayload, TokenEvent, now
from worker.engine.base import BaseEngine
from worker.engine.execution_plan import ExecutionPlan, encoder_plan
from worker.engine import pooling
from worker.engine.pooling import PoolJob
from worker.engine.sequence import Sequence, StepOutput, new_sequence, step_output
from worker.model.encoders import Encoder, Packed

STEP_PHASES = ("forward",)


class EncoderEngine(BaseEngine):
    pools = True

    def __init__(self, encoder: Encoder, tokenizer, batch_size: int, max_num_batched_tokens: int):
        super().__init__(batch_size)
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.max_num_batched_tokens = max_num_batched_tokens
        self.phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self._lock = threading.Lock()
        self._arrivals: list[PoolJob] = []  # added since the last step (the asyncio side writes it)
        self._jobs: list[PoolJob] = []  # those the steps run, oldest first (model thread only)
        self._refused: list[Sequence] = []  # generations, ended at the next step
        self._shares = pooling.Shares()

    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = ()) -> Sequence | PoolJob:
        if payload.pool is None:
            seq = new_sequence(payload, self.tokenizer.decode, resumed)
            with self._lock:
                self._refused.append(seq)
            return seq
        job = PoolJob.of(payload)
        with self._lock:
            self._arrivals.append(job)
        return job

    @property
    def running(self) -> list[Sequence]:
        return []

    @property
    def waiting(self) -> list[Sequence | PoolJob]:
        with self._lock:
            return self._jobs + self._arrivals + self._refused

    @property
    def free_slots(self) -> int:
        return max(0, self.batch_size - len(self.waiting))

    @property
    def plan(self) -> ExecutionPlan:
        return encoder_plan(self.encoder.family, self.encoder.numerics, self.encoder.device.type)

    def step(self) -> list[StepOutput]:
        outputs = self._take_arrivals() + self._end_cancelled()
        picked = self._pick()
        self.last_step_size = len(picked)
        if not picked:
            return outputs
        began, stamp = time.perf_counter(), now()
        for job, _ in picked:
            job.scheduled_at = job.scheduled_at or stamp
        self._run(picked)
        self.phase_seconds["forward"] += time.perf_counter() - began
        outputs += [job.output() for job in self._jobs if job.done]
        self._jobs = [job for job in self._jobs if not job.done]
        return outputs

    def _take_arrivals(self) -> list[StepOutput]:
        with self._lock:
            arrivals, self._arrivals = self._arrivals, []
            refused, self._refused = self._refused, []
        outputs = []
        for seq in refused:
            seq.finish(FinishReason.ERROR, "this model is an encoder (embeddings, scores): it generates no text")
            outputs.append(step_output(seq, None, True))
        for job in arrivals:
            if job.task != ("classify" if self.encoder.description.kind == "classify" else "embed"):
                what = "a cross-encoder: it scores pairs" if self.encoder.description.kind == "classify" \
                    else "an embedding model: it has no classification head"
                outputs.append(job.output(FinishReason.ERROR, f"a {job.task} request cannot run here: this model is {what}"))
            else:
                self._jobs.append(job)
        return outputs

    def _pick(self) -> list[tuple[PoolJob, int]]:
        """The next inputs, as many as the token budget holds (the first always), in the tenants'
        fair shares (pooling.Shares)."""
        return self._shares.pick(self._jobs, self.max_num_batched_tokens)

    def _run(self, picked: list[tuple[PoolJob, int]]) -> None:
        inputs = [(job.tokens(i), len(job.head) if job.task == "classify" else job.length(i)) for job, i in picked]
        packed = Packed.of(inputs, self.encoder.device)
        if picked[0][0].task == "classify":
            values = self.encoder.classify(packed)
        else:
            values = self.encoder.embed(packed, [job.skips[i] if job.skips else 0 for job, i in picked])
        for (job, _), value in zip(picked, values):
            job.put(value)

    # -- what BaseEngine asks of a subclass -------------------------------------------------
    def _running_or_waiting(self) -> list[Sequence]:
        return []

    def _cancel(self, cancelled: set[str]) -> list[StepOutput]:
        with self._lock:
            self._arrivals, gone = pooling.split(self._arrivals, cancelled)
        self._jobs, stopped = pooling.split(self._jobs, cancelled)
        return [job.output(FinishReason.CANCELLED) for job in gone + stopped]

    def fail_all(self, error: str) -> list[StepOutput]:
        with self._lock:
            jobs, self._jobs, self._arrivals = self._jobs + self._arrivals, [], []
        return [job.output(FinishReason.ERROR, error) for job in jobs]

    def _forget(self, seq: Sequence) -> None:
        pass

    def _reset(self) -> None:
        with self._lock:
            self._jobs, self._arrivals, self._refused = [], [], []
