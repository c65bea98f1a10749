"""Request bodies of the OpenAI-compatible endpoints, with the extra fields vLLM accepts.

An argument this server does not implement is a 400 naming it, as OpenAI answers one it does
not know: ignoring `functions` would answer plain text to a client that asked for something
else. Only the arguments in IGNORED, which cannot change the output, pass unread.
`response_format` (OpenAI's) and `structured_outputs` (vLLM's) constrain the output
(shared/structured.py); `tools` are kept by such a constraint too (api/tools.py).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from api import hermes
from api import tools as tool_format
from api.tools import Reply, Tool, ToolChoice, chosen, read_reply
from shared.messages import MAX_PRIORITY
from shared.sampling import MAX_LOGPROBS, MAX_SEED, MAX_TOKEN_ID, LogitsProcessor, SamplingParams, TokenId, seed_for
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
    def _compiles(self) -> ResponseFormat:
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
IGNORED = frozenset({"metadata", "store", "service_tier"})


class _Common(BaseModel):
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
    speculative: bool = True  # streamq's: false opts this request out of speculative decoding
    backend: Literal["hf", "vllm", "null"] | None = None  # streamq's: run on a worker of this backend only
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's: json, json_object, regex, choice, grammar

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if k not in IGNORED} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _one_constraint(self) -> _Common:
        if self.structured_outputs is not None and self.response_format and self.response_format.constraint:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def constraint(self) -> StructuredOutputs | None:
        return self.structured_outputs or (self.response_format.constraint if self.response_format else None)

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


class CompletionRequest(_Common):
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to that call

    def for_template(self) -> dict[str, str]:
        """The message as the chat template renders it (tool calls in the generic format)."""
        if self.role == "assistant" and self.tool_calls:
            return {"role": "assistant", "content": tool_format.as_model_turn(self.model_dump())}
        if self.role == "tool":
            return {"role": "tool", "content": f"[{self.tool_call_id or 'tool'}] {self.text()}"}
        return {"role": self.role, "content": self.text()}

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported (text only)")
            if not isinstance(part.get("text", ""), str):
                raise ValueError("a text content part's 'text' must be a string")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

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
    _hermes: bool = PrivateAttr(False)  # the model's template knows Hermes-style tool calls

    @model_validator(mode="after")
    def _tools_alone(self) -> ChatCompletionRequest:
        """The tool format's constraint, built once for every sample; no other constraint beside it."""
        if self.calls_tools:
            if super().constraint() is not None:
                raise ValueError("tools cannot be combined with response_format or structured_outputs")
            self._tool_constraint = tool_format.constraint(chosen(self.tools, self.tool_choice), self.tool_choice,
                                                           self.parallel_tool_calls)
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the reply is in the tool format (tools given, and tool_choice is not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    def constraint(self) -> StructuredOutputs | None:
        return self._tool_constraint if self.calls_tools else super().constraint()

    def in_hermes_format(self) -> None:
        """The model's template knows Hermes-style tool calls: the tools, the earlier calls and
        the reply's constraint take that format (api/hermes.py) instead of the generic one."""
        self._hermes = True
        if self.calls_tools:
            self._tool_constraint = hermes.constraint(chosen(self.tools, self.tool_choice), self.tool_choice,
                                                      self.parallel_tool_calls)

    @property
    def hermes(self) -> bool:
        return self._hermes and self.calls_tools

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders itself (Hermes format), or None."""
        if not self.hermes:
            return None
        return [t.model_dump(exclude_none=True) for t in chosen(self.tools, self.tool_choice)]

    def reply(self, text: str, finish_reason: str) -> Reply:
        """A reply's content, tool calls and finish reason, read in the request's tool format
        (api.tools.read_reply); without tools, its text as it stands."""
        if not self.calls_tools:
            return Reply(text, [], finish_reason)
        return read_reply(text, finish_reason, hermes.parse if self.hermes else tool_format.parse)

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation for the chat template: in the Hermes format the template's own way,
        else with the tools described in a system message."""
        if self.hermes:
            return [hermes.template_message(m.model_dump(), m.text()) for m in self.messages]
        messages = [m.for_template() for m in self.messages]
        if self.calls_tools:
            text = tool_format.system_text(chosen(self.tools, self.tool_choice), self.tool_choice)
            if messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}
            else:
                messages.insert(0, {"role": "system", "content": text})
        return messages

    def wanted_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None
