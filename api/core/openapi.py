"""How a route's answers read in /openapi.json: its JSON body's model, its event stream, its errors.

Each route names its answers in its decorator's `responses` (made here), so FastAPI documents the
model without serializing the handler's answer through it: every answer's bytes stay the handler's.
Each protocol's answer models are in its own package (answers.py), on `Answer`.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

EVENT_STREAM = "text/event-stream"


class Answer(BaseModel):
    """An answer's body as documented. Every field an answer has is named (an unknown one fails
    validation), so a test that validates real answers finds a model behind its route."""

    model_config = ConfigDict(extra="forbid")


class Detail(Answer):
    """The error body outside the OpenAI and Anthropic paths (FastAPI's own)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"detail": "no request 'abc'"}]})

    detail: str


def json_answer(model: type[BaseModel], description: str, status: int = 200) -> dict[int | str, dict[str, Any]]:
    """A route's JSON answer: `model` documents its body."""
    return {status: {"model": model, "description": description}}


def event_stream(description: str, example: str) -> dict[str, Any]:
    """The content of an answer sent as Server-Sent Events (api/core/sse.py frames them)."""
    return {EVENT_STREAM: {"schema": {"type": "string", "description": description}, "example": example}}


def json_or_stream(model: type[BaseModel], description: str, stream: str, example: str
                   ) -> dict[int | str, dict[str, Any]]:
    """A route that answers JSON, or with `stream: true` its events, both with 200."""
    return {200: {"model": model, "description": description, "content": event_stream(stream, example)}}


def stream_answer(description: str, example: str) -> dict[int | str, dict[str, Any]]:
    """A route that answers only with its events (its decorator names EventStreamResponse as its
    class, so no JSON body is documented)."""
    return {200: {"description": description, "content": event_stream(description, example)}}


def errors(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    """Every 4xx and 5xx answer of a path family in its one error body."""
    return {code: {"model": model, "description": description} for code in ("4XX", "5XX")}
