"""One sample's reply as it came (`Choice`, what `Generation.collect` gathers), and its finish
reason as the protocols report it."""
from __future__ import annotations

from dataclasses import dataclass, field

from api.core.errors import ApiError
from shared.messages import FinalEvent, FinishReason, TokenEvent


@dataclass
class Choice:
    """One sample's reply as it came: its text pieces, its tokens, its final event."""

    text: list[str] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)
    final: FinalEvent | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob or 0.0 for t in self.tokens)


def finish_reason(final: FinalEvent) -> str:
    """The reply's finish reason (vLLM's "abort" for a cancelled one); a failed or expired request
    is an ApiError (500, 503; 404 where its LoRA adapter was unloaded before it ran)."""
    if final.finish_reason == FinishReason.ERROR and final.code == "model_not_found":
        raise ApiError(404, final.error or "the model is not served here", param="model", code="model_not_found")
    if final.finish_reason == FinishReason.ERROR:
        raise ApiError(500, f"generation failed: {final.error}")
    if final.finish_reason == FinishReason.EXPIRED:
        raise ApiError(503, final.error or "the request expired in the queue", code="expired")
    return "abort" if final.finish_reason == FinishReason.CANCELLED else final.finish_reason.value


def stream_reason(final: FinalEvent) -> str:
    """The finish reason a stream reports: "error" where the request failed."""
    try:
        return finish_reason(final)
    except ApiError:
        return "error"
