"""Bodies of the native api."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.messages import MAX_PRIORITY
from shared.service_tier import Requested
from shared.sampling import SamplingParams


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class SubmitRequest(SamplingParams):
    """A prompt or chat messages, and how to sample. `stream: true` answers with SSE."""

    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    model: str | None = Field(None, description="Model to use; the served model when unset.")
    stream: bool = Field(False, description="Answer with the event stream; leaving it cancels the request.")
    backend: Literal["hf", "vllm", "null"] | None = Field(
        None, description="Run on a worker of this backend only (404 when none is live); any when unset.")
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY,
                          description="Lower runs first among this tenant's requests (tenants share workers fairly).")
    service_tier: Requested = Field("auto", description="The service tier: priority, default or flex, among "
                                                        "those the tenant may use; auto: the tenant's own.")

    @model_validator(mode="after")
    def _one_input(self) -> SubmitRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self

    def sampling(self) -> SamplingParams:
        return SamplingParams(**self.model_dump(include=set(SamplingParams.model_fields)))
