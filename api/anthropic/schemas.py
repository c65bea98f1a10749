"""The Anthropic Messages API's request body, read into the chat request it runs.

`POST /v1/messages` (and `/v1/messages/count_tokens`) take Anthropic's shape: a system prompt,
messages whose content is a string or blocks (text; an assistant's tool_use; a user's
tool_result), max_tokens, temperature, top_p, top_k, stop_sequences, tools and tool_choice.
Each becomes the core's ChatRequest (api/core/chat.py), as an OpenAI chat runs, so templating, tools,
queueing, failover and tenants are that route's. What the engine cannot do is refused with a
400 naming it (documents, server tools; images a model does not take), never ignored; `thinking` is a thinking model's
budget (enabled) or, for a template that reads `enable_thinking`, its thought turned off (disabled); an
assistant's earlier thinking blocks are dropped from the prompt, as Anthropic drops them. `cache_control` is
accepted on any block and needs nothing: every prefix is cached, on every worker (the shared KV
tier). `metadata.user_id` is accepted and kept as the chat request's `user`.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from api.core.chat import ChatRequest
from api.core.errors import ApiError
from shared.sampling import MAX_TOKEN_ID


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = Field(None, max_length=0)  # none: the engine makes none


class ThinkingBlock(_Strict):
    """An assistant's earlier thought, as a Messages answer gave it: not part of the prompt (the
    chat templates of thinking models drop earlier thoughts, as Anthropic drops them)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""
    cache_control: CacheControl | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


class ImageSource(_Strict):
    """An image block's source: base64 data of a media type, or a URL (not fetched here: a 400)."""

    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _whole(self) -> ImageSource:
        if self.type == "base64" and (self.media_type is None or self.data is None):
            raise ValueError("a base64 image source needs media_type and data")
        if self.type == "url" and not self.url:
            raise ValueError("a url image source needs url")
        return self

    def as_url(self) -> str:
        """As an OpenAI image_url (a data URL; a URL as it is, which the api refuses to fetch)."""
        return f"data:{self.media_type};base64,{self.data}" if self.type == "base64" else str(self.url)


class ImageBlock(_Strict):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


Block = TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock | ImageBlock
BLOCK_TYPES = ("text", "thinking", "tool_use", "tool_result", "image")  # no document, redacted thinking, server tool blocks


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Annotated[Block, Field(discriminator="type")]] = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        for block in value if isinstance(value, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise ValueError(f"content blocks of type {kind!r} are not supported here "
                                 f"(only {', '.join(BLOCK_TYPES)})")
        return value


class Tool(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search, bash, ...) are not run here
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(_Strict):
    """`/v1/messages/count_tokens`: the prompt part of a Messages request."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128)
    tool_choice: ToolChoice | None = None

    def chat_request(self, **sampling: Any) -> ChatRequest:
        """The chat request this runs; ApiError 400 with the reason where the chat route refuses it."""
        try:
            body = self._chat_body(sampling)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        try:
            return ChatRequest.model_validate(body)
        except ValidationError as exc:
            raise ApiError(400, "; ".join(_reason(e) for e in exc.errors())) from exc

    def _chat_body(self, sampling: dict[str, Any]) -> dict[str, Any]:
        """The chat body this reads as (ValueError where it cannot)."""
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), **sampling}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                               **({"description": t.description}
                                                                  if t.description else {})}}
                             for t in self.tools]
        if self.tool_choice is not None:
            if not self.tools and self.tool_choice.type != "none":
                raise ValueError("tool_choice needs tools")
            choice = self.tool_choice
            if self.tools:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                    {"type": "function", "function": {"name": _named(choice)}}
                body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return body

    def _messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": self.system if isinstance(self.system, str)
                        else "".join(b.text for b in self.system)})
        for message in self.messages:
            out += _chat_messages(message)
        return out


class Thinking(_Strict):
    """Anthropic's extended thinking: `enabled` with a budget of thought tokens, or `disabled`."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=MAX_TOKEN_ID)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool = False
    cache_control: CacheControl | None = None  # caching is automatic here, every prefix, every worker
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)
    metadata: Metadata | None = None
    # Anthropic's: `auto` the tenant's own tier (shared/service_tier.py), `standard_only` the default tier
    service_tier: Literal["auto", "standard_only"] = "auto"
    thinking: Thinking | None = None

    @field_validator("thinking")
    @classmethod
    def _budget_when_enabled(cls, value: Thinking | None, info) -> Thinking | None:
        if value is None:
            return value
        if (value.type == "enabled") != (value.budget_tokens is not None):
            raise ValueError("thinking.budget_tokens is given with type enabled, and only then")
        if value.budget_tokens is not None and value.budget_tokens >= info.data.get("max_tokens", MAX_TOKEN_ID):
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return value

    def chat(self) -> ChatRequest:
        sampling: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                                    "stop": self.stop_sequences or None,
                                    "service_tier": "default" if self.service_tier == "standard_only" else "auto"}
        if self.top_p is not None:
            sampling["top_p"] = self.top_p
        if self.top_k is not None:
            sampling["top_k"] = self.top_k
        if self.metadata and self.metadata.user_id:
            sampling["user"] = self.metadata.user_id
        if self.thinking is not None and self.thinking.type == "disabled":  # Qwen3's templates read it
            sampling["chat_template_kwargs"] = {"enable_thinking": False}
        if self.thinking is not None and self.thinking.budget_tokens is not None:
            sampling["thinking_token_budget"] = self.thinking.budget_tokens
        return self.chat_request(**sampling)


def _named(choice: ToolChoice) -> str:
    if not choice.name:
        raise ValueError("tool_choice of type 'tool' needs the tool's name")
    return choice.name


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results first, each a tool message
    answering its call, then its text; an assistant's text and its tool calls in one message."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    if message.role == "user":
        if any(isinstance(b, ToolUseBlock | ThinkingBlock) for b in message.content):
            raise ValueError("a user message cannot hold tool_use or thinking blocks")
        out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
               for b in message.content if isinstance(b, ToolResultBlock)]
        if any(isinstance(b, ImageBlock) for b in message.content):  # text and images, in order (api/core/images.py)
            parts = [{"type": "text", "text": b.text} if isinstance(b, TextBlock) else
                     {"type": "image_url", "image_url": {"url": b.source.as_url()}}
                     for b in message.content if isinstance(b, TextBlock | ImageBlock)]
            return [*out, {"role": "user", "content": parts}]
        return out + ([{"role": "user", "content": "".join(texts)}] if texts else [])
    if any(isinstance(b, ToolResultBlock | ImageBlock) for b in message.content):
        raise ValueError("an assistant message cannot hold tool_result or image blocks")
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.content if isinstance(b, ToolUseBlock)]
    return [{"role": "assistant", "content": "".join(texts) or None, **({"tool_calls": calls} if calls else {})}]


def _reason(error: dict) -> str:
    where = ".".join(str(p) for p in error.get("loc", ()))
    return f"{where}: {error.get('msg')}" if where else str(error.get("msg"))
