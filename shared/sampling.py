"""Sampling parameters of one request, validated at the edge and carried to the worker."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How to pick tokens. temperature 0 is greedy decoding."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate; unset means the server default.")
    temperature: float = Field(1.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 or 0 keeps all.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same sample.")
    stop: list[str] = Field(default_factory=list, max_length=16,
                            description="Strings that end generation; they are not part of the output.")
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
