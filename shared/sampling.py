"""Sampling parameters of one request, validated at the edge and carried to the worker."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.structured import StructuredOutputs

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5
MAX_SEED = 2**63 - 1  # a torch generator takes up to 64 bits; signed keeps it an int64 everywhere
# Far above any vocabulary, far below int64: a payload that skipped the api's vocabulary check
# still fits the sampler's tensors. The api checks the real vocabulary size.
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[int, Field(ge=-MAX_TOKEN_ID, le=MAX_TOKEN_ID)]


def seed_for(seed: int | None, sample: int) -> int | None:
    """The seed of sample `sample` of a request with n samples: seed + sample, wrapped into range."""
    return None if seed is None else (seed + sample) % (MAX_SEED + 1)


class BanTokens(BaseModel):
    """Server-side logits processor: these token ids are never generated."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["ban_tokens"] = "ban_tokens"
    token_ids: list[TokenId] = Field(min_length=1, max_length=1024)


# Logits processors a request may select by name (code cannot travel over the wire).
LogitsProcessor = BanTokens


class ThinkingBudget(BaseModel):
    """A thinking model's budget: once the reply has `tokens` tokens and its thought is still open,
    the tokens of `end` (the end-of-thought tag) are forced, one a step, and the answer follows.
    With `start` (Harmony's `<|channel|>analysis<|message|>`): only a reply that opens with it has
    a thought, and its tokens are counted from after it."""

    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(ge=1, le=MAX_TOKEN_ID)
    end: list[TokenId] = Field(min_length=1, max_length=64)
    start: list[TokenId] = Field(default_factory=list, max_length=64)

    def forced(self, output_ids: list[int]) -> int | None:
        """The token the budget forces next after `output_ids`, or None: the thought has closed
        (or, with `start`, never opened), or the budget is not spent yet. A close already begun (a
        prefix of `end` ending the output) goes on where it is."""
        if self.start:
            if output_ids[:len(self.start)] != self.start:
                return None
            output_ids = output_ids[len(self.start):]
        end, n = self.end, len(output_ids)
        if _holds(output_ids, end):
            return None
        begun = next((k for k in range(min(len(end) - 1, n), 0, -1) if output_ids[n - k:] == end[:k]), 0)
        return end[begun] if n - begun >= self.tokens else None


def _holds(ids: list[int], part: list[int]) -> bool:
    """Whether `part` occurs in `ids` (its first token found by list.index, in C)."""
    start = 0
    while True:
        try:
            start = ids.index(part[0], start)
        except ValueError:
            return False
        if ids[start:start + len(part)] == part:
            return True
        start += 1


class SamplingParams(BaseModel):
    """How to pick tokens. temperature 0 is greedy decoding."""

    # NaN and infinity are refused by name, whatever bound they would happen to miss.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_ID,
                                   description="Most tokens to generate; unset means the server default.")
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_TOKEN_ID,
                       description="Keep the k most likely tokens; -1 or 0 keeps all; at most the vocabulary size.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Same seed, same sample.")
    stop: list[str] = Field(default_factory=list, max_length=16,
                            description="Strings that end generation; they are not part of the output.")
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p times the most likely.")
    repetition_penalty: float = Field(1.0, ge=0.01, le=2.0,
                                      description="Divide positive (multiply negative) logits of tokens already seen.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted once from each generated token.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted per occurrence in the output.")
    logit_bias: dict[TokenId, float] = Field(default_factory=dict, max_length=300,
                                             description="Token id -> bias added to its logit (-100 bans, 100 forces).")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Return the chosen token's log-probability and this many alternatives.")
    logits_processors: list[LogitsProcessor] = Field(default_factory=list, max_length=4)
    speculative: bool = Field(True, description="false: no speculative decoding for this request, "
                                                "where the worker has it on (greedy output is the same either way).")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Constrain the output: one of json (a schema), json_object, regex, choice, grammar.")
    thinking_budget: ThinkingBudget | None = Field(
        None, description="A thinking model's thought closed after this many tokens (Messages' thinking.budget_tokens).")
    skip_special_tokens: bool = Field(True, description="false: the text keeps the special tokens the model "
                                      "writes (the api asks so where a reply's format marks calls with them).")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        for s in value:
            if not s or len(s) > 256:
                raise ValueError("each stop string must have 1 to 256 characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, value: dict[int, float]) -> dict[int, float]:
        for token, bias in value.items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias for token {token} is {bias}; it must be within [-100, 100]")
        return value

    @property
    def greedy(self) -> bool:
        # Below this, dividing by the temperature overflows: it is greedy in all but name (as vLLM).
        return self.temperature < GREEDY_BELOW

    @property
    def needs_history(self) -> bool:
        """Whether sampling depends on the tokens so far (penalties, a thinking budget)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.thinking_budget is not None)
