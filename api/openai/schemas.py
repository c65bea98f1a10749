"""Request bodies of the OpenAI-compatible generation endpoints: a completion, and a chat (the
core's ChatRequest, api/core/chat.py), with the extra fields vLLM accepts."""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from api.core.chat import ChatRequest, SamplingFields
from api.core.generation import Prompt
from shared.sampling import MAX_LOGPROBS, MAX_TOKEN_ID


MAX_PROMPTS = 64  # requests one completion may queue: its prompts times each one's samples


class CompletionRequest(SamplingFields):
    """OpenAI's completion body: `prompt` in any of OpenAI's forms, a text, texts, token ids, or
    lists of token ids; each prompt runs its `n` (or `best_of`) samples, and the choices come
    prompt by prompt (`choices[].index` = prompt × n + sample)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # The prompt back before the completion; with logprobs, each prompt token's too (the first: null)
    echo: bool = False
    # 0 only with echo: the prompt scored, nothing generated (what lm-eval's loglikelihood asks)
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKEN_ID)
    logprobs: int | None = Field(None, ge=0, le=5)
    # vLLM's field: each prompt token's logprob and the n likeliest tokens there (choices[].prompt_logprobs)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=16)
    suffix: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, value: int | None, info) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens 0 returns nothing without echo: give echo true to score the prompt")
        return value

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of} must be at least n={self.n}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of cannot be used with stream")
        if self.suffix:
            raise ValueError("suffix is not supported")
        prompts = self.prompts()
        if not prompts:
            raise ValueError("prompt must hold at least one prompt")
        if len(prompts) * self.samples_per_prompt > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts times samples (n or best_of) in one request; got "
                             f"{len(prompts)} x {self.samples_per_prompt}")
        if any(isinstance(p, list) and not p for p in prompts):
            raise ValueError("a prompt of token ids needs at least one token")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)

    @property
    def samples_per_prompt(self) -> int:
        return self.best_of or self.n

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's own logprobs are asked for (echo with logprobs, or prompt_logprobs)."""
        return self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)

    def as_prompts(self) -> list[Prompt]:
        """What this completion runs: each prompt's text or token ids, `n` (or `best_of`) samples each
        (with max_tokens 0 nothing is generated: the samples' parameters only carry the prompt's checks)."""
        samples = self.samples_per_prompt
        logprobs = self.logprobs if self.logprobs is not None else (0 if samples > self.n else None)
        return [Prompt(self.model, self.samples(samples, 1 if self.max_tokens == 0 else self.max_tokens, logprobs),
                       text=p if isinstance(p, str) else None, token_ids=p if isinstance(p, list) else None,
                       priority=self.priority, backend=self.backend, constraint_param=self.constraint_param(),
                       service_tier=self.service_tier or "auto")
                for p in self.prompts()]

    def as_prompt(self) -> Prompt:
        """The one prompt's Prompt (ValueError for several: a batch line holds one)."""
        prompts = self.as_prompts()
        if len(prompts) != 1:
            raise ValueError("one prompt per batch request")
        return prompts[0]


class ChatCompletionRequest(ChatRequest):
    """OpenAI's chat completion body: the core chat request, as it is."""
