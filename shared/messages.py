"""Messages between api and worker: JSON on the wire, one pydantic model per message type.

A request's events (token, status, final) go both to its token log stream and its pub/sub
channel, encoded the same way, so the relay can merge the two. A message that is not an event
(the request to run, a control message such as a cancel, shared/heartbeat.py's heartbeat, an
offline batch's entry) carries a `version`: a reader refuses a version it does not know, by
name (UnknownVersion), instead of misreading it.
"""
from __future__ import annotations

import enum
import json
import time
from typing import Annotated, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from shared.sampling import MAX_LOGPROBS, SamplingParams
from shared.service_tier import Tier


class RequestStatus(str, enum.Enum):
    """Where a request is. Finished states come last; see FINISHED."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({RequestStatus.DONE, RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.EXPIRED})


class FinishReason(str, enum.Enum):
    STOP = "stop"            # EOS, a stop token or a stop string
    LENGTH = "length"        # max_tokens or the model's context
    CANCELLED = "cancelled"  # the client asked, or went away
    ERROR = "error"          # the worker could not run it
    EXPIRED = "expired"      # it waited in the queue past its timeout, and never ran


# The status a request ends in, for each way it can finish.
STATUS_OF_FINISH = {
    FinishReason.STOP: RequestStatus.DONE,
    FinishReason.LENGTH: RequestStatus.DONE,
    FinishReason.CANCELLED: RequestStatus.CANCELLED,
    FinishReason.ERROR: RequestStatus.FAILED,
    FinishReason.EXPIRED: RequestStatus.EXPIRED,
}


def now() -> float:
    return time.time()


class UnknownVersion(ValueError):
    """A message of a version this process does not read (written by a newer one)."""


class Versioned(BaseModel):
    """A message with a version: `decode` checks it before anything else, so a newer writer's
    message is refused with its version named, never half-read. A message without the field was
    written before versions were: it is version 1, the shape it had then."""

    VERSION: ClassVar[int] = 1
    version: int = 1

    @field_validator("version")
    @classmethod
    def _known(cls, value: int) -> int:
        cls._check(value)
        return value

    @classmethod
    def _check(cls, version: object) -> None:
        if version != cls.VERSION:
            raise UnknownVersion(f"{cls.__name__} version {version}: this process reads version {cls.VERSION}")

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, data: str | bytes) -> Self:
        """The message from its JSON; UnknownVersion for another version, ValidationError for a malformed one."""
        cls._check(_version_of(data))  # before validation, so the error is UnknownVersion itself
        return cls.model_validate_json(data)


def _version_of(data: str | bytes) -> object:
    try:
        value = json.loads(data)
    except ValueError:
        return 1  # not JSON: the validation that follows says what is wrong
    return value.get("version", 1) if isinstance(value, dict) else 1


MAX_PRIORITY = 20  # priorities are -20..20: each one a lane (a stream) per tenant


MAX_POOL_INPUTS = 256  # inputs of one embeddings or rerank request


class PoolSpec(BaseModel):
    """What makes a request a pooling one (embeddings, rerank) instead of a generation: the worker
    runs each input's prompt through the model once and answers vectors or scores, no tokens.
    The inputs lie back to back in the payload's prompt_token_ids, `lengths` long each; each input's
    prompt is `head` + the input + `tail` (a rerank's template and query, written once, not per document)."""

    model_config = ConfigDict(extra="forbid")

    # embed: a vector per input; score: a decoder's yes/no answer (below); classify: an encoder's
    # classification head (a cross-encoder), its first segment `head`, the second the input and `tail`;
    # logprobs: each prompt token's logprob after the tokens before it, and the `top` likeliest there
    task: Literal["embed", "score", "classify", "logprobs"]
    lengths: list[int] = Field(min_length=1, max_length=MAX_POOL_INPUTS)
    # embed: the mean of the final hidden states over the input's tokens, scaled to length 1 where `normalize`
    normalize: bool = True
    # score: P(candidates[0]) / (P(candidates[0]) + P(candidates[1])) at the input's last token (yes / no)
    candidates: list[int] | None = Field(None, min_length=2, max_length=2)
    head: list[int] = Field(default_factory=list)  # the tokens before every input
    tail: list[int] = Field(default_factory=list)  # ... and after it
    # embed on an encoder: skips[i], input i's first tokens (its prompt) left out of its pooling where
    # the model's Pooling says include_prompt false (shared/pooling_model.py); empty: none
    skips: list[int] = Field(default_factory=list, max_length=MAX_POOL_INPUTS)
    top: int = Field(0, ge=0, le=MAX_LOGPROBS)  # logprobs: the likeliest tokens given at each position

    def prompt_tokens(self) -> int:
        """The tokens the model runs for every input: its own, its head's and its tail's."""
        return sum(self.lengths) + len(self.lengths) * (len(self.head) + len(self.tail))

    @field_validator("lengths")
    @classmethod
    def _each_input_has_tokens(cls, value: list[int]) -> list[int]:
        if any(n < 1 for n in value):
            raise ValueError("every input needs at least one token")
        return value

    @model_validator(mode="after")
    def _skips_within_inputs(self) -> PoolSpec:
        if self.skips and (len(self.skips) != len(self.lengths)
                           or any(not 0 <= k < n for k, n in zip(self.skips, self.lengths))):
            raise ValueError("skips gives each input a count of its tokens, fewer than it has")
        return self

    @model_validator(mode="after")
    def _candidates_for_score(self) -> PoolSpec:
        if (self.task == "score") != (self.candidates is not None):
            raise ValueError("candidates are given for task score, and only for it")
        return self


class RequestPayload(Versioned):
    """A request to run, as written to the model's request stream (the entry's `payload` field)."""

    # `tenant` is "owner" on the wire, as entries were written before the code said tenant (a
    # worker of the previous version reads them; the request record keeps "owner" too).
    model_config = ConfigDict(serialize_by_alias=True, validate_by_name=True, validate_by_alias=True)

    type: Literal["request"] = "request"
    id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    created_at: float = Field(default_factory=now)
    expires_at: float | None = None  # not started by then: it expires instead of running
    tenant: str = Field("", alias="owner")  # the tenant that submitted it ("" when auth is off)
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)  # lower runs first, within its tenant's share
    weight: float = Field(1.0, gt=0)  # the tenant's share of a worker's batch, relative to other tenants
    # Its service tier, resolved from the one asked for (shared/service_tier.py): tiers go first across tenants
    service_tier: Tier = "default"
    backend: str | None = Field(None, pattern=r"^[a-z]+$")  # only a worker of this backend may run it (None: any)
    # The worker that holds the prompt's prefix: the request waits in its affinity lane (shared/queue.py)
    affinity: str | None = Field(None, pattern=r"^[^/]+$")
    # The W3C trace context (traceparent, tracestate) of the api span that queued it, where tracing is on
    trace: dict[str, str] | None = Field(None, max_length=4)
    # The LoRA adapter to run it with, by the name the worker serves it under (None: the base model)
    adapter: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[^\s,=]+$")
    # Where the adapter was loaded at run time: the registry entry's revision and folder
    # (shared/lora_registry.py), set by the worker that claims the request from the registry then, so
    # a load under the same name since is never run on the weights loaded before (None: the api's)
    adapter_revision: int | None = Field(None, ge=0)
    adapter_path: str | None = Field(None, min_length=1, max_length=4096)
    pool: PoolSpec | None = None  # an embeddings or rerank request (None: a generation)
    # Its images, in the prompt's order: the sha256 of each one's bytes, kept in Redis
    # (redis_keys.image) for every worker that may run it (a vision-language model's request)
    images: list[str] = Field(default_factory=list, max_length=64)

    @field_validator("images")
    @classmethod
    def _sha256s(cls, value: list[str]) -> list[str]:
        if any(len(h) != 64 or any(c not in "0123456789abcdef" for c in h) for h in value):
            raise ValueError("an image is named by the sha256 of its bytes (64 lower-case hex digits)")
        return value

    @model_validator(mode="after")
    def _pool_inputs_add_up(self) -> RequestPayload:
        if self.pool is not None and sum(self.pool.lengths) != len(self.prompt_token_ids):
            raise ValueError(f"the pool's lengths add up to {sum(self.pool.lengths)}, "
                             f"not to the {len(self.prompt_token_ids)} prompt tokens")
        return self

    def pool_inputs(self) -> list[list[int]]:
        """The token ids of each input of a pooling request, without the pool's head and tail."""
        inputs, start = [], 0
        for n in self.pool.lengths:
            inputs.append(self.prompt_token_ids[start:start + n])
            start += n
        return inputs

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt tokens the model runs: a pooling request's every input whole (head and tail included)."""
        return len(self.prompt_token_ids) if self.pool is None else self.pool.prompt_tokens()

    @property
    def cost_tokens(self) -> int:
        """What it reserves of its tenant's tokens per minute: every prompt token it runs and the most
        it may generate (a pooling request generates none)."""
        return self.num_prompt_tokens + (0 if self.pool is not None else self.params.max_tokens or 0)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from a cache (the prefix cache, the shared tier)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenEvent(BaseModel):
    """One generated token. `text` is the new text it completes; it may be empty while a
    multi-byte character or a possible stop string is still incomplete."""

    type: Literal["token"] = "token"
    index: int = Field(ge=0)
    token_id: int
    text: str
    logprob: float | None = None  # when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), most likely first


class StatusEvent(BaseModel):
    """A change of status that is not an end (queued → running)."""

    type: Literal["status"] = "status"
    status: RequestStatus
    worker: str | None = None


class FinalEvent(BaseModel):
    """The last event of a request."""

    type: Literal["final"] = "final"
    status: RequestStatus
    finish_reason: FinishReason
    usage: Usage
    error: str | None = None
    # The error's kind where the api answers it other than as a failure (500): "model_not_found",
    # the request's LoRA adapter was unloaded before a worker ran it (a 404, as a request sent then gets)
    code: Literal["model_not_found"] | None = None
    # A pooling request's results, one per input: base64 of little-endian float32 values (a
    # vector for embed, one score for score)
    pooled: list[str] | None = None


Event = Annotated[TokenEvent | StatusEvent | FinalEvent, Field(discriminator="type")]
_EVENT = TypeAdapter(Event)


def encode_event(event: TokenEvent | StatusEvent | FinalEvent) -> str:
    return event.model_dump_json(exclude_none=True)


def decode_event(data: str | bytes) -> TokenEvent | StatusEvent | FinalEvent:
    return _EVENT.validate_json(data)


class Cancel(Versioned):
    """A control message on the cancel channel (shared/redis_keys.cancel_channel): stop this
    request, which some worker runs. Every worker hears it; the one that holds the request stops it."""

    type: Literal["cancel"] = "cancel"
    request_id: str = Field(min_length=1)

    @classmethod
    def decode(cls, data: str | bytes) -> Cancel:
        """Also reads the bare request id an api of the previous version publishes (a request id is
        never JSON: it does not start with a brace)."""
        text = data.decode() if isinstance(data, bytes) else data
        if not text.startswith("{"):
            return cls(request_id=text)
        return super().decode(text)


class KeptResponse(BaseModel):
    """A stored response kept longer than its request's result (shared/redis_keys.kept_responses): the
    api adds it, the scheduler's keep_responses job keeps the request as long and removes it. Its wire
    form is a JSON list, [tenant, response id, request id]: it is a sorted set's member, whose string is
    its identity, so it stays as members were always written."""

    tenant: str
    response_id: str
    request_id: str

    def encode(self) -> str:
        return json.dumps([self.tenant, self.response_id, self.request_id])

    @classmethod
    def decode(cls, data: str | bytes) -> KeptResponse:
        tenant, response_id, request_id = json.loads(data)
        return cls(tenant=tenant, response_id=response_id, request_id=request_id)
