"""What every engine shares (the paged Engine, StaticEngine, NullEngine; the Backend protocol of
worker/engine/backend.py): its batch size, the cancels inbox the event loop writes, the size of the last
step for the metrics, and how a request leaves: cancelled, failed by its own sampling, failed
with every other when a step fails, or done after its last token.

A subclass says which requests it holds (`_running_or_waiting`, `_held`), what a request's leaving
frees (`_forget`), what a failed step resets (`_reset`) and the paths it takes (`plan`); what it
may have that others lack it declares (`pools`, `batch_invariant`, `adapters`, `phase_seconds`,
`kv_blocks`, `counts`), so that worker/engine/backend.py's Threaded never probes for it. `generate` runs requests to their ends in
the caller's thread, for in-process use (tests, benchmarks) where no worker loop steps it.
"""
from __future__ import annotations

import abc
import logging
import uuid
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from shared.messages import FinishReason, RequestPayload, TokenEvent
from shared.sampling import SamplingParams
from worker.engine.backend import Counts
from worker.engine.cancels import CancelInbox
from worker.engine.execution_plan import ExecutionPlan
from worker.engine.sequence import Sequence, StepOutput, step_output, token_event
from worker.engine.structured import follow_grammar

if TYPE_CHECKING:
    from worker.model.lora import Adapters

log = logging.getLogger(__name__)


@dataclass
class Generated:
    """One request's result from `generate`: its output token ids and text (for a continued
    request, the delivered tokens included) and how it ended; `tokens`, the events this run
    emitted, in order (with logprobs where asked for)."""

    request_id: str
    output_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    error: str | None = None
    tokens: list[TokenEvent] = field(default_factory=list)


class BaseEngine(abc.ABC):
    pools: ClassVar[bool] = False  # whether it runs pooling requests (embeddings, rerank): the paged engine only
    lora: ClassVar[bool] = False  # whether it can serve LoRA adapters (`adapters`: whether it does): the paged engine only

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.cancels = CancelInbox()
        self.last_step_size = 0  # requests in the last step, for metrics
        # Seconds its steps spent in each phase, summed (the paged engine's STEP_PHASES; empty: not split)
        self.phase_seconds: dict[str, float] = {}

    @abc.abstractmethod
    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = ()) -> Sequence:
        """Take a request (continuing after `resumed`); it joins at a coming step."""

    @abc.abstractmethod
    def step(self) -> list[StepOutput]:
        """One step, in the model thread: its events."""

    @property
    @abc.abstractmethod
    def plan(self) -> ExecutionPlan:
        """The paths this engine takes (worker/engine/execution_plan.py)."""

    @property
    def batch_invariant(self) -> bool:
        """Whether each token is computed alone (the paged runner's deterministic numerics)."""
        return False

    @property
    def weight_bytes(self) -> int | None:
        """Bytes of weights a step reads, as held (quantized ones packed); None where not counted."""
        return None

    @property
    def adapters(self) -> Adapters | None:
        """The LoRA adapters it serves (None: none; only the paged engine can)."""
        return None

    # -- called from the asyncio side ------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        self.cancels.add(request_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def kv_blocks(self) -> tuple[int, int] | None:
        return None  # no paged cache

    def generate(self, prompts: Iterable[str | list[int] | RequestPayload], params: SamplingParams | None = None,
                 resumed: list[list[TokenEvent]] | None = None) -> list[Generated]:
        """Add each prompt (text, token ids, or a whole RequestPayload, which carries its own id,
        params and adapter) with `params` (default: SamplingParams()), and `resumed[i]` the tokens
        already delivered to request i (a takeover's); step in this thread until the engine holds no
        work (requests added before included); each request's result, in the prompts' order."""
        params = params or SamplingParams()
        payloads = [p if isinstance(p, RequestPayload) else RequestPayload(
            id=uuid.uuid4().hex, model="", params=params,
            prompt_token_ids=self.tokenizer.encode(p) if isinstance(p, str) else list(p)) for p in prompts]
        if any(p.pool is not None for p in payloads):
            raise ValueError("generate runs generations; a pooling request has no tokens to return")
        seqs = [self.add(payload, list(resumed[i]) if resumed else ()) for i, payload in enumerate(payloads)]
        events: dict[str, list[TokenEvent]] = {seq.id: [] for seq in seqs}
        while self.has_work():
            for out in self.step():
                if out.token is not None and out.request_id in events:
                    events[out.request_id].append(out.token)
        return [Generated(seq.id, list(seq.output_ids), seq.detokenizer.text, seq.finish_reason, seq.error,
                          events[seq.id]) for seq in seqs]

    def counts(self) -> Counts:
        return Counts()

    # -- in the model thread ---------------------------------------------------------------
    def fail_all(self, error: str) -> list[StepOutput]:
        """End every request this engine holds with an error (the step itself failed; no step runs now)."""
        outputs = self._end(self._held(), FinishReason.ERROR, error)
        self._reset()
        return outputs

    def _end_cancelled(self) -> list[StepOutput]:
        """End the running or waiting requests whose cancel arrived since the last step."""
        return self._cancel(self.cancels.take())

    def _cancel(self, cancelled: set[str]) -> list[StepOutput]:
        """End the requests of these ids that this engine holds (a subclass adds what else it holds)."""
        return self._end([seq for seq in self._running_or_waiting() if seq.id in cancelled], FinishReason.CANCELLED)

    def _end(self, seqs: list[Sequence], reason: FinishReason, error: str | None = None) -> list[StepOutput]:
        outputs = []
        for seq in seqs:
            seq.finish(reason, error)
            self._forget(seq)
            outputs.append(step_output(seq, None, True))
        return outputs

    def _sampling_failed(self, seq: Sequence, exc: Exception) -> StepOutput:
        """A request whose own parameters broke its sampling (sample_each gave its exception): it
        alone ends, with the error."""
        log.warning("request %s failed in sampling: %r", seq.id, exc)
        seq.finish(FinishReason.ERROR, f"sampling failed: {type(exc).__name__}: {exc}")
        self._forget(seq)
        return step_output(seq, None, True)

    def _emit(self, seq: Sequence, token: int, logprobs) -> StepOutput:
        """The request takes `token` (stop checks, detokenizing, its grammar); its event, and
        whether that ended it (then it is forgotten here)."""
        text = seq.accept(token, self.tokenizer.eos_token_ids, self.runner.context_length)
        matcher = self._sampling[seq.id].matcher
        if matcher is not None:
            follow_grammar(seq, matcher, token)
        if seq.finished:
            self._forget(seq)
        return step_output(seq, token_event(seq, token, text, logprobs), seq.finished)

    # -- what a subclass says --------------------------------------------------------------
    @abc.abstractmethod
    def _running_or_waiting(self) -> list[Sequence]:
        """The requests a step may end: those in the batch and those waiting for it."""

    def _held(self) -> list[Sequence]:
        """Every request this engine holds, those not taken in by a step yet included."""
        return self._running_or_waiting()

    @abc.abstractmethod
    def _forget(self, seq: Sequence) -> None:
        """Free what the ended request `seq` held here."""

    @abc.abstractmethod
    def _reset(self) -> None:
        """After fail_all: hold nothing."""
