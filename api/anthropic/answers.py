"""Anthropic's answers as /openapi.json documents them (api/core/openapi.py): a message, a token
count, the error body."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from api.core.openapi import Answer


class TextContent(Answer):
    type: Literal["text"]
    text: str


class ThinkingContent(Answer):
    """A thinking model's thought (STREAMQ_REASONING_PARSER), before its answer; no signature is made here."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class ToolUseContent(Answer):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(Answer):
    input_tokens: int = Field(description="Prompt tokens computed (those not read from a cache).")
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int = Field(description="Prompt tokens a worker took from its prefix cache or the "
                                                     "shared KV tier.")
    service_tier: Literal["standard", "priority", "batch"] = Field(
        description="The service tier that served it (streamq's `default` is `standard`, `flex` is `batch`).")


class MessageAnswer(Answer):
    """The assistant's message: its text, then a tool_use block per call."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"id": "msg_4d2e", "type": "message", "role": "assistant", "model": "SmolLM2-135M-Instruct",
         "content": [{"type": "text", "text": "Paris."}], "stop_reason": "end_turn", "stop_sequence": None,
         "usage": {"input_tokens": 12, "output_tokens": 3, "cache_creation_input_tokens": 0,
                   "cache_read_input_tokens": 0, "service_tier": "standard"}}]})

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(Answer):
    """The prompt's tokens as the model's chat template renders it, tools included."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"input_tokens": 14}]})

    input_tokens: int


class AnthropicErrorDetail(Answer):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, ...")
    message: str


class AnthropicError(Answer):
    """Anthropic's error body: every error of the Messages paths (an invalid request is a 400)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}]})

    type: Literal["error"]
    error: AnthropicErrorDetail


MESSAGE_EVENTS = ("Named events: message_start, then per content block content_block_start, "
                  "content_block_delta (thinking_delta and signature_delta, text_delta or input_json_delta) and "
                  "content_block_stop, ping, "
                  "message_delta (stop_reason, usage), message_stop; `error` for a request that fails.")
MESSAGE_EVENTS_EXAMPLE = ('event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
                          '"delta": {"type": "text_delta", "text": "Paris"}}\n\n'
                          'event: message_stop\ndata: {"type": "message_stop"}\n\n')
