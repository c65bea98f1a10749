"""One request inside the worker: its tokens so far and how it ends (pure Python)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import FinishReason, RequestPayload, TokenEvent
from worker.detokenizer import Detokenizer


@dataclass
class Sequence:
    payload: RequestPayload
    detokenizer: Detokenizer
    stream_entry: str  # id of the request-stream entry, acked when the request ends
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def id(self) -> str:
        return self.payload.id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_ids(self) -> list[int]:
        return self.payload.prompt_token_ids


@dataclass
class StepOutput:
    """What one step did to one request: at most one new token, and maybe its end."""

    seq: Sequence
    token: TokenEvent | None
    finished: bool
