"""A chat request as the api runs it, whatever protocol it came in: OpenAI's chat body with the
extra fields vLLM accepts (`SamplingFields` is what every generation request shares, a completion
too). The Messages and Responses APIs read their requests into a `ChatRequest`.

An argument this server does not implement is a 400 naming it, as OpenAI answers one it does
not know: ignoring `functions` would answer plain text to a client that asked for something
else. Only the arguments in IGNORED, which cannot change the output, pass unread.
`response_format` (OpenAI's) and `structured_outputs` (vLLM's) constrain the output
(shared/structured.py); `tools` are kept by such a constraint too, in the model's tool format
(api/core/parsers/). Reading a body builds its constraint but compiles nothing: the generation
compiles it once the caller is admitted (Generation.payloads, in the grammar pool). `as_prompt`
gives what the generation runs (api/core/generation.Prompt).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from api.core.errors import ApiError
from api.core.generation import Prompt
from api.core.parsers import generic, registry
from api.core.parsers.base import ToolFormat
from api.core.tools import Tool, ToolChoice, chosen
from shared.messages import MAX_PRIORITY
from shared.sampling import MAX_LOGPROBS, MAX_SEED, MAX_TOKEN_ID, LogitsProcessor, SamplingParams, TokenId, seed_for
from shared.service_tier import Requested
from shared.structured import StructuredOutputs


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    _constraint: StructuredOutputs | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _its_constraint(self) -> ResponseFormat:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("type json_schema needs a json_schema object (name, schema)")
            # A schema-less json_schema format (OpenAI allows it) is any JSON value's grammar.
            self._constraint = StructuredOutputs.model_validate({"json": self.json_schema.json_schema or {}})
        elif self.json_schema is not None:
            raise ValueError(f"json_schema is only for type json_schema, not {self.type}")
        elif self.type == "json_object":
            self._constraint = StructuredOutputs(json_object=True)
        return self

    @property
    def constraint(self) -> StructuredOutputs | None:
        return self._constraint


# OpenAI arguments that change no generated token: accepted and dropped (`user` is a field).
IGNORED = frozenset({"metadata", "store"})


class SamplingFields(BaseModel):
    """The fields every generation request shares: sampling, constraints, priority and routing."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)
    # vLLM's extra sampling fields
    top_k: int = Field(-1, ge=-1, le=MAX_TOKEN_ID)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=2.0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    logits_processors: list[LogitsProcessor] | None = None
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)  # vLLM's: lower first (here, within a tenant)
    # OpenAI's: resolved against the tenant's tiers (shared/service_tier.py); the answer names the tier that served it
    service_tier: Requested | None = None
    speculative: bool = True  # streamq's: false opts this request out of speculative decoding
    backend: Literal["hf", "vllm", "null"] | None = None  # streamq's: run on a worker of this backend only
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's: json, json_object, regex, choice, grammar

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if k not in IGNORED} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        if self.structured_outputs is not None and self.response_format and self.response_format.constraint:
            raise ValueError("give response_format or structured_outputs, not both")
        if self.structured_outputs is not None and self.structured_outputs.after_thought is not None:
            raise ValueError("structured_outputs.after_thought is the server's to set (a thinking model's "
                             "thought stays free by itself)")
        return self

    def constraint(self) -> StructuredOutputs | None:
        return self.structured_outputs or (self.response_format.constraint if self.response_format else None)

    def constraint_param(self) -> str:
        """The field the constraint came from, which its compile errors name."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids; got {key!r}")
        return value

    def sampling(self, max_tokens: int | None, logprobs: int | None, seed_offset: int = 0) -> SamplingParams:
        """Our sampling parameters for one of the n samples (each gets its own seed)."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=seed_for(self.seed, seed_offset), stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=logprobs, logits_processors=self.logits_processors or [], speculative=self.speculative,
            structured_outputs=self.constraint())

    def samples(self, count: int, max_tokens: int | None, logprobs: int | None) -> list[SamplingParams]:
        """The sampling parameters of `count` samples, each with its own seed (ApiError 400 where
        they do not hold together)."""
        try:
            return [self.sampling(max_tokens, logprobs, i) for i in range(count)]
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to that call

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") == "image_url":
                raise ValueError("an image goes in a user message")
            if part.get("type") != "text":
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported (text and image_url)")
            if not isinstance(part.get("text", ""), str):
                raise ValueError("a text content part's 'text' must be a string")
            parts.append(part.get("text", ""))
        return "".join(parts)

    def image_urls(self) -> list[str]:
        """The URLs of its image parts (OpenAI's `image_url`: {"url", "detail"}, or the URL alone), in order."""
        if not isinstance(self.content, list):
            return []
        urls = []
        for part in self.content:
            if part.get("type") != "image_url":
                continue
            image = part.get("image_url")
            image = {"url": image} if isinstance(image, str) else image
            if not isinstance(image, dict) or not isinstance(image.get("url"), str):
                raise ValueError("an image_url part needs image_url.url (a data URL)")
            if image.get("detail") not in (None, "auto"):
                raise ValueError(f"image_url.detail {image['detail']!r} is not supported: an image goes in at its "
                                 "model's own resolution (detail 'auto')")
            urls.append(image["url"])
        return urls

    def template_parts(self) -> list[dict[str, str]]:
        """Its content as a vision model's chat template reads it: text and image parts in order."""
        parts = []
        for part in self.content if isinstance(self.content, list) else [{"type": "text", "text": self.text()}]:
            if part.get("type") == "image_url":
                parts.append({"type": "image"})
            elif part.get("type") == "text" and isinstance(part.get("text", ""), str):
                parts.append({"type": "text", "text": part.get("text", "")})
            else:
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported (text and image_url)")
        return parts


class ChatRequest(SamplingFields):
    """A chat as every protocol runs it (OpenAI's chat body, with vLLM's extra fields): the
    Messages and Responses APIs read their requests into one."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: more variables for the chat template (enable_thinking, ...); OpenAI's reasoning_effort
    # reaches it as `reasoning_effort` (templates that read it, such as gpt-oss's)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=32)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's: a thinking model's thought closed after this many tokens (the answer follows)
    thinking_token_budget: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in value or []]
        if len(set(names)) != len(names):
            raise ValueError("two functions have the same name")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_the_tools(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if value is not None:
            tools = info.data.get("tools")
            if not tools:
                raise ValueError("tool_choice needs tools")
            chosen(tools, value)  # an unknown name is a ValueError
        return value

    _tool_constraint: StructuredOutputs | None = PrivateAttr(None)
    _format: ToolFormat | None = PrivateAttr(None)  # with tools: the generic one, then the model's; else None

    @model_validator(mode="after")
    def _tools_alone(self) -> ChatRequest:
        """The tool format's constraint, built once for every sample; no other constraint beside it."""
        if self.calls_tools:
            if super().constraint() is not None:
                raise ValueError("tools cannot be combined with response_format or structured_outputs")
            self._format = registry.get(registry.FALLBACK)
            self._tool_constraint = self._format.constraint(chosen(self.tools, self.tool_choice), self.tool_choice,
                                                            self.parallel_tool_calls)
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the reply is in the tool format (tools given, and tool_choice is not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def constraint(self) -> StructuredOutputs | None:
        return self._tool_constraint if self.calls_tools else super().constraint()

    def constraint_param(self) -> str:
        return "tools" if self.calls_tools else super().constraint_param()

    def use_tool_format(self, tool_format: ToolFormat) -> None:
        """The model's tool format (api/core/parsers/registry.py): the tools, the earlier calls and
        the reply's constraint take it instead of the generic one (ValueError where its constraint
        cannot be built; it is compiled with the request's, in Generation.payloads)."""
        if tool_format is self._format:  # its constraint was built when the request was read
            return
        self._format = tool_format
        if self.calls_tools:
            self._tool_constraint = tool_format.constraint(chosen(self.tools, self.tool_choice), self.tool_choice,
                                                           self.parallel_tool_calls)

    @property
    def tool_format(self) -> ToolFormat | None:
        """The reply's tool format, where it calls tools, bound to the request's tools."""
        return self._format.bind(chosen(self.tools, self.tool_choice)) if self.calls_tools else None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders itself (in a format that has it do so), or None."""
        if not self.calls_tools:
            return None
        return self._format.template_tools(chosen(self.tools, self.tool_choice))

    def images(self) -> list[tuple[str, str]]:
        """Its image parts, (where in the body, URL) in the prompt's order: in user messages only."""
        out = []
        for i, message in enumerate(self.messages):
            urls = message.image_urls()
            if urls and message.role != "user":
                raise ValueError(f"messages[{i}]: images go in user messages, not {message.role} ones")
            out += [(f"messages[{i}] image {k + 1}", url) for k, url in enumerate(urls)]
        return out

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation for the chat template, in the reply's tool format (the generic one
        renders earlier calls, and describes the tools in a system message); a message with images
        as parts (text and `{"type": "image"}`), as vision models' templates read them."""
        with_images = [bool(m.image_urls()) for m in self.messages]
        if not self.calls_tools:
            return [{"role": m.role, "content": m.template_parts()} if images else generic.template_message(m)
                    for m, images in zip(self.messages, with_images)]
        if not any(with_images):
            return self._format.template_messages(self.messages, chosen(self.tools, self.tool_choice),
                                                  self.tool_choice)
        # The tool format writes the conversation from text: each user message with images goes in
        # as a mark of its own, and comes out with its parts where the format wrote the mark as a
        # message's whole content.
        marks = {f"\x00streamq-images-{i}\x00": m for i, (m, images) in enumerate(zip(self.messages, with_images))
                 if images}
        stand_ins = [m.model_copy(update={"content": mark}) for mark, m in marks.items()]
        it = iter(stand_ins)
        written = self._format.template_messages([next(it) if images else m for m, images in
                                                  zip(self.messages, with_images)],
                                                 chosen(self.tools, self.tool_choice), self.tool_choice)
        out, placed = [], set()
        for message in written:
            mark = message.get("content")
            if isinstance(mark, str) and mark in marks:
                message = {**message, "content": marks[mark].template_parts()}
                placed.add(mark)
            out.append(message)
        if placed != set(marks):
            raise ValueError(f"the {self._format.name} tool format cannot carry images in this conversation; "
                             "send the images without tools")
        return out

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort unless they set it."""
        extra = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", self.reasoning_effort)
        return extra or None

    def wanted_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def as_prompt(self, tool_format: ToolFormat) -> Prompt:
        """What this chat runs on a model whose replies with tool calls are in `tool_format`
        (api/core/parsers/registry.py): ApiError 400 where the tools' grammar cannot be built in
        it, or where the messages or the sampling cannot be read (the constraint compiles later,
        in Generation.payloads)."""
        if self.calls_tools:
            try:
                self.use_tool_format(tool_format)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="tools") from exc
        try:
            logprobs = self.wanted_logprobs()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        prompt = Prompt(self.model, self.samples(self.n, self.max_completion_tokens or self.max_tokens, logprobs),
                        tools=self.template_tools(), priority=self.priority, backend=self.backend,
                        tool_format=self.tool_format, constraint_param=self.constraint_param(),
                        service_tier=self.service_tier or "auto", template_kwargs=self.template_kwargs(),
                        thinking_budget=self.thinking_token_budget)
        try:
            prompt.images = self.images()
            prompt.messages = self.template_messages()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        return prompt
