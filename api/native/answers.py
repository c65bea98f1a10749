"""The native api's answers as /openapi.json documents them (api/core/openapi.py): submit, poll,
cancel, the event stream, and the seed tutorials' endpoints."""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from api.core.openapi import Answer

RID = "0b7c6a52-5d1e-4f0e-9a51-3f1f7f0d9c2e"
LINKS = {"self": f"/v1/requests/{RID}", "events": f"/v1/requests/{RID}/events", "cancel": f"/v1/requests/{RID}"}


class Links(Answer):
    self: str = Field(description="Poll it here (GET).")
    events: str = Field(description="Its event stream (GET, SSE).")
    cancel: str = Field(description="Cancel it here (DELETE).")


class Submitted(Answer):
    """A request queued in Redis (202): poll it, stream its events or cancel it at its links."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": RID, "status": "queued", "model": "SmolLM2-135M-Instruct", "prompt_tokens": 5, "max_tokens": 64,
         "links": LINKS}]})

    id: str
    status: Literal["queued"]
    model: str
    prompt_tokens: int
    max_tokens: int
    links: Links


class Timings(Answer):
    created_at: float | None = Field(description="When it was queued (seconds since the epoch).")
    queue_s: float | None = Field(description="From queued until a worker claimed it.")
    scheduled_s: float | None = Field(description="From queued until its first step.")
    ttft_s: float | None = Field(description="From queued until its first token.")
    total_s: float | None = Field(description="From queued until it ended.")


class RequestState(Answer):
    """A request as it stands: its status, its text so far, its counts and timings."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": RID, "status": "done", "model": "SmolLM2-135M-Instruct", "text": " Paris.", "prompt_tokens": 5,
         "completion_tokens": 3, "finish_reason": "stop", "error": None, "worker": "worker-1",
         "timings": {"created_at": 1767225600.0, "queue_s": 0.002, "scheduled_s": 0.003, "ttft_s": 0.021,
                     "total_s": 0.048},
         "links": LINKS}]})

    id: str
    status: Literal["queued", "running", "done", "cancelled", "failed", "expired"]
    model: str | None
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: Literal["stop", "length", "cancelled", "error", "expired"] | None
    error: str | None
    worker: str | None
    timings: Timings
    links: Links


class Cancelled(Answer):
    """`cancelled` for a request still queued; `cancelling` for a running one (it stops within a step)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"id": RID, "status": "cancelling"}]})

    id: str
    status: Literal["cancelled", "cancelling"]


# What the event streams send, for their documentation.
REQUEST_EVENTS = ("One `token` event per token (`id:` is its index; resume after it with Last-Event-ID), "
                  "`status` events, then one `final` event.")
REQUEST_EVENTS_EXAMPLE = ('id: 0\nevent: token\ndata: {"index": 0, "token_id": 7042, "text": " Paris"}\n\n'
                          'event: final\ndata: {"status": "done", "finish_reason": "stop", '
                          '"usage": {"prompt_tokens": 5, "completion_tokens": 1, "cached_tokens": 0}, '
                          '"error": null}\n\n')


class GeneratedText(Answer):
    """/basic_generate: the prompt followed by its greedy continuation."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"generated_text": "The capital of France is Paris."}]})

    generated_text: str


class GeneratedTexts(Answer):
    """/generate: each prompt followed by its continuation, and the id of each one's request."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"generated_texts": ["Hello, world!"], "request_ids": [RID]}]})

    generated_texts: list[str]
    request_ids: list[str]


class VllmTexts(Answer):
    """/generate_vllm: each prompt's continuation (without the prompt)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"generated_texts": [" world!"]}]})

    generated_texts: list[str]


class QueryAnswer(Answer):
    """/generate/: the query's continuation."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"response": " Paris."}]})

    response: str


SEED_EVENTS = "One event per token with text: its text and the request's id."
SEED_EVENTS_EXAMPLE = f'data: {{"token": " Paris", "sequence_id": "{RID}"}}\n\n'
