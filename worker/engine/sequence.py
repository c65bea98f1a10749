"""One request inside the worker: its tokens so far and how it ends (pure Python)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from shared.messages import FinishReason, RequestPayload, TokenEvent
from shared import service_tier
from shared.queue import lane_of
from shared.sampling import SamplingParams
from worker.engine.detokenizer import Detokenizer


class Status(enum.Enum):
    """Where a request is in the engine (vLLM's RequestStatus, without the finish reasons;
    WAITING_FOR_GRAMMAR is its WAITING_FOR_FSM)."""

    WAITING = "waiting"  # not yet admitted to the batch
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # queued while its matcher builds: the batcher passes it over
    RUNNING = "running"  # in the batch, with KV blocks
    PREEMPTED = "preempted"  # put back in the queue, its blocks given up; recomputed when readmitted
    FINISHED = "finished"  # ended: finish_reason says how


@dataclass(eq=False)
class Sequence:
    """The engine's own request: what it needs of the wire payload (RequestPayload), taken once
    (Sequence.of), and the state it keeps while the request runs."""

    id: str
    params: SamplingParams
    prompt_ids: list[int]
    detokenizer: Detokenizer
    tenant: str = ""  # for fair scheduling
    priority: int = 0
    weight: float = 1.0  # its tenant's share of the batch
    created_at: float = 0.0  # when the api accepted it (wall clock)
    lane: str = ""  # the queue lane it came from (shared/queue.py), where its entry is acked
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt then output: what the model has seen or will
    num_computed: int = 0  # leading token_ids whose keys and values are in the KV cache
    reused_tokens: int | None = None  # of its tokens at admission here, those whose KV came from a cache
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival: int = -1  # order of first arrival at the batcher (a preempted request keeps it)
    scheduled_at: float | None = None  # wall clock of the first step that ran it here (not when claimed)
    adapter: str | None = None  # its LoRA adapter's name (None: the base model)
    adapter_revision: int | None = None  # which of its loads: the registry's, claimed with; the held one's once held
    adapter_path: str | None = None  # that load's folder (None: a configured adapter's)
    kv_root: int | None = None  # its prefix-cache chain root: its tenant's and adapter's, set when the engine takes it in (worker/model/lora.py)
    tier: int = service_tier.RANK["default"]  # its service tier's rank: lower runs first, across tenants
    images: list[bytes] = field(default_factory=list)  # a vision-language model's request: its images' bytes, in order
    image_keys: list[str] = field(default_factory=list)  # their sha256s (RequestPayload.images)
    vision: Any = None  # the paged engine's Images (worker/engine/vision.py): where they sit, set when taken in

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids) + list(self.output_ids)

    @classmethod
    def of(cls, payload: RequestPayload, detokenizer: Detokenizer) -> Sequence:
        return cls(payload.id, payload.params, list(payload.prompt_token_ids), detokenizer, payload.tenant,
                   payload.priority, payload.weight, payload.created_at, lane_of(payload), adapter=payload.adapter,
                   adapter_revision=payload.adapter_revision, adapter_path=payload.adapter_path,
                   tier=service_tier.RANK[payload.service_tier], image_keys=list(payload.images))

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error

    @property
    def cache_ids(self) -> list[int]:
        """Its tokens as the prefix cache hashes them: an image's tokens keyed by the image."""
        return self.token_ids if self.vision is None else self.vision.cache_ids(self.token_ids)

    def rope_positions(self, start: int, end: int) -> list[list[int]] | None:
        """M-RoPE's positions of its tokens start .. end (worker/model/batch.py ChunkRequest)."""
        return None if self.vision is None else self.vision.rope_positions(start, end)

    def attention_ends(self, start: int, end: int) -> list[int] | None:
        """The last key each of its tokens start .. end attends to (worker/model/batch.py ChunkRequest)."""
        return None if self.vision is None else self.vision.attention_ends(start, end)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)

    def accept(self, token_id: int, eos_ids: frozenset[int], context_length: int) -> str:
        """Record a generated token, decide whether the request ends; return its text delta."""
        params = self.params
        self.append(token_id)
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_ids):
            self.finish(FinishReason.STOP)
            return self.detokenizer.flush()
        text = self.detokenizer.push(token_id)
        if self.detokenizer.stopped:
            self.finish(FinishReason.STOP)
            return text
        limit = params.max_tokens or context_length
        if len(self.output_ids) >= limit or self.num_tokens >= context_length:
            self.finish(FinishReason.LENGTH)
            return text + self.detokenizer.flush()
        return text


def new_sequence(payload: RequestPayload, decode, resumed: list[TokenEvent] | tuple = (),
                 decode_stream=None) -> Sequence:
    """A request as the engine takes it: fresh, or continuing after the tokens another worker
    already delivered (they are prefilled with the prompt, and indices carry on after them).
    `decode_stream` is `Tokenizer.decode_stream` where the tokenizer has one."""
    if not payload.params.skip_special_tokens:  # its format reads markers that are special tokens
        decode = partial(decode, skip_special_tokens=False)
        decode_stream = partial(decode_stream, False) if decode_stream is not None else None
    seq = Sequence.of(payload, Detokenizer(decode, payload.params.stop, decode_stream))
    if resumed:
        for event in resumed:
            seq.append(event.token_id)
        seq.detokenizer.resume([e.token_id for e in resumed], sum(len(e.text) for e in resumed))
    return seq


@dataclass
class Logprobs:
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, most likely first


def token_event(seq: Sequence, token: int, text: str, lp: Logprobs | None) -> TokenEvent:
    """The event for the token `seq` just accepted."""
    return TokenEvent(index=len(seq.output_ids) - 1, token_id=token, text=text,
                      logprob=lp.logprob if lp else None, top_logprobs=lp.top if lp else None)


@dataclass(frozen=True)
class RequestEnd:
    """How a request ended, as the publisher and the metrics record it."""

    finish_reason: FinishReason
    error: str | None
    text: str  # the whole output text
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int = 0  # tokens (prompt, and on a continuation those delivered before) taken from a cache
    pooled: tuple[str, ...] | None = None  # a pooling request's results (FinalEvent.pooled)
    code: str | None = None  # the error's kind (FinalEvent.code)


@dataclass(frozen=True)
class StepOutput:
    """One new token of a request, or none, and maybe its end: a plain record, taken from the
    request when the step emitted it (step_output). A step may emit several tokens of one request
    (speculative decoding): one StepOutput each, in order."""

    request_id: str
    token: TokenEvent | None
    finished: bool
    created_at: float = 0.0  # when the api accepted the request
    scheduled_at: float | None = None  # when its first step here began (None: the backend does not say)
    lane: str = ""  # its queue lane, where the worker acks its entry
    end: RequestEnd | None = None  # where finished


def step_output(seq: Sequence, token: TokenEvent | None, finished: bool) -> StepOutput:
    """The record of `seq`'s new token (or none), and of its end where `finished`."""
    end = None
    if finished:
        end = RequestEnd(seq.finish_reason, seq.error, seq.detokenizer.text, len(seq.prompt_ids), len(seq.output_ids),
                         seq.reused_tokens or 0)
    return StepOutput(seq.id, token, finished, seq.created_at, seq.scheduled_at, seq.lane, end)


def refused(payload: RequestPayload, error: str, code: str | None = None) -> StepOutput:
    """The end of a request its worker cannot run at all (its backend lacks what it asks for, its
    adapter was unloaded: `code` says so)."""
    end = RequestEnd(FinishReason.ERROR, error, "", payload.num_prompt_tokens, 0, code=code)
    return StepOutput(payload.id, None, True, payload.created_at, None, lane_of(payload), end)
