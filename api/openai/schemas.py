"""Request bodies of the OpenAI-compatible generation endpoints: a completion, and a chat (the
core's ChatRequest, api/core/chat.py), with the extra fields vLLM accepts."""
from __future__ import annotations

from pydantic import Field, model_validator

from api.core.chat import ChatRequest, SamplingFields
from api.core.generation import Prompt
from shared.sampling import MAX_TOKEN_ID


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKEN_ID)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=16)
    suffix: str | None = None

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of} must be at least n={self.n}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of cannot be used with stream")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo:
            raise ValueError("echo is not supported")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ValueError("one prompt per request (send several requests, or use n)")
        return self

    def as_prompt(self) -> Prompt:
        """What this completion runs: its text or token ids, `n` (or `best_of`) samples."""
        samples = self.best_of or self.n
        logprobs = self.logprobs if self.logprobs is not None else (0 if samples > self.n else None)
        text = self.prompt if isinstance(self.prompt, str) else None
        if self.prompt and isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            text = self.prompt[0]
        return Prompt(self.model, self.samples(samples, self.max_tokens, logprobs), text=text,
                      token_ids=list(self.prompt) if text is None else None, priority=self.priority,
                      backend=self.backend, constraint_param=self.constraint_param(),
                      service_tier=self.service_tier or "auto")




class ChatCompletionRequest(ChatRequest):
    """OpenAI's chat completion body: the core chat request, as it is."""
