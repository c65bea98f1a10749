"""The body of POST /v1/responses (OpenAI's Responses API), and its conversation as chat messages.

A response runs as one chat request: its input items (and, with `previous_response_id`, the
stored conversation before them) become chat messages, `instructions` a system message first,
function tools chat tools, `text.format` a response_format. So tools, constraints and sampling
are the chat endpoint's, with its checks.

What would change the output and is not implemented is a 400 naming it (built-in tools,
reasoning summaries, `include` values, `truncation: auto`, ...); what cannot change it (`user`,
`stream_options`, ...) is accepted and dropped, as the chat endpoint does. `service_tier` is the
chat endpoint's, and the response names the tier that served it.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from api.core.chat import ChatRequest
from api.core.tools import FunctionDef
from shared.messages import MAX_PRIORITY
from shared.service_tier import Requested
from shared.sampling import MAX_TOKEN_ID

# Fields that change no generated token: accepted and dropped.
IGNORED = frozenset({"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "stream_options"})
# Fields OpenAI has that would change the output, and this server does not implement.
UNSUPPORTED = {"prompt": "stored prompts", "conversation": "conversations",
               "max_tool_calls": "max_tool_calls", "top_logprobs": "top_logprobs", "context_management": "compaction"}

PARTS = ("input_text", "output_text", "input_image")


class _Item(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, max_length=128)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")  # an output_text part sent back carries annotations, logprobs

    type: Literal["input_text", "output_text"]
    text: str


class ImagePart(BaseModel):
    """An input image: a data URL in image_url (the chat endpoint's checks: api/core/images.py), or
    the id of an image the tenant uploaded (`POST /v1/files`, purpose vision or user_data), read
    when the response is created (api/openai/responses/routes.py `_with_files`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = Field(None, max_length=64)
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _a_url(self) -> ImagePart:
        if (self.file_id is None) == (not self.image_url):
            raise ValueError("an input_image needs one of image_url (a data URL) and file_id (an uploaded image)")
        return self

    def chat_part(self) -> dict[str, Any]:
        if not self.image_url:  # its file is read before the chat is built: never here
            raise ValueError(f"the image file {self.file_id!r} was not read")
        return {"type": "image_url", "image_url": {"url": self.image_url, "detail": self.detail}}


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]
    phase: str | None = None  # sent back on an assistant message; changes nothing here

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(p.text for p in self.content if isinstance(p, TextPart))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """Its content as a chat message's: text, or text and image parts in order."""
        if isinstance(self.content, str) or not any(isinstance(p, ImagePart) for p in self.content):
            return self.text()
        return [p.chat_part() if isinstance(p, ImagePart) else {"type": "text", "text": p.text} for p in self.content]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Item):
    """A thinking model's earlier thought, as a response gave it: taken back, and left out of the
    prompt (the chat templates of thinking models drop earlier thoughts)."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list, max_length=0)  # none is written here
    content: list[ReasoningText] | None = None
    encrypted_content: None = None  # none is made here, so none can be read back


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
               "reasoning": ReasoningItem}


def parse_item(value: Any) -> InputItem:
    """One input item by its type (a message may leave it out); ValueError naming an unsupported type."""
    if not isinstance(value, dict):
        raise ValueError("each input item must be an object")
    kind = value.get("type", "message")
    if not isinstance(kind, str) or kind not in _ITEM_TYPES:
        raise ValueError(f"input items of type {kind!r} are not supported (message, function_call, "
                         "function_call_output, reasoning)")
    if kind == "message" and isinstance(value.get("content"), list):
        for part in value["content"]:
            if not isinstance(part, dict) or part.get("type") not in PARTS:
                got = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content parts of type {got!r} are not supported ({', '.join(PARTS)})")
    return _ITEM_TYPES[kind].model_validate(value)


class FunctionTool(FunctionDef):
    """A function tool as the Responses API writes it: the chat tool's function, flat, with its type."""

    type: Literal["function"]


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs a name and a schema")
        if self.type != "json_schema" and (self.name, self.json_schema, self.strict) != (None, None, None):
            raise ValueError(f"name, schema and strict are only for the json_schema format, not {self.type}")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """As the chat endpoint's response_format."""
        if self.type == "json_schema":
            schema = {"name": self.name, "schema": self.json_schema, "description": self.description,
                      "strict": self.strict}
            return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}
        return {"type": self.type}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["medium"] | None = None  # the model's own length: only the default is honoured


class ReasoningConfig(BaseModel):
    """OpenAI's `reasoning`: the effort reaches the chat template as `reasoning_effort` (the chat
    endpoint's field; templates that read it, such as gpt-oss's). Summaries are not written (a 400)."""

    model_config = ConfigDict(extra="forbid")

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: None = Field(None, description="not supported: the thought comes back whole, as reasoning_text")
    generate_summary: None = Field(None, description="not supported (OpenAI's older name of summary)")

    @field_validator("summary", "generate_summary", mode="before")
    @classmethod
    def _no_summary(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("reasoning summaries are not written by this server (the thought comes back whole, "
                             "as a reasoning item's reasoning_text)")
        return None


class ResponseCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_ID)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    stream: bool = False
    background: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=128)
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    # streamq's, as on the chat endpoint: a priority within the tenant, a backend to run on
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    backend: Literal["hf", "vllm", "null"] | None = None
    service_tier: Requested | None = None  # OpenAI's, as on the chat endpoint

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, what in UNSUPPORTED.items():
            if data.get(name) is not None:
                raise ValueError(f"{name}: {what} are not supported by this server")
        if data.get("truncation") == "auto":
            raise ValueError("truncation: 'auto' is not supported (the input must fit the context)")
        return {k: v for k, v in data.items() if k not in IGNORED}

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("input must hold at least one item")
            return [parse_item(item) for item in value]
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for tool in value or []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools of type {kind!r} are not supported (function tools only)")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValueError(f"tool_choice of type {value.get('type')!r} is not supported "
                             "(none, auto, required, or a function)")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, text in (value or {}).items():
            if len(key) > 64 or len(text) > 512:
                raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return value

    @field_validator("include")
    @classmethod
    def _nothing_to_include(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(f"include values {value} are not produced by this server")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ResponseCreate:
        if self.background and not self.store:
            raise ValueError("background responses must be stored: background: true needs store: true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools")
        return self

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=[TextPart(type="input_text", text=self.input)])]
        return list(self.input)

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response object repeats them."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction) else (
            self.tool_choice or "auto")
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls,
                "previous_response_id": self.previous_response_id, "store": self.store, "background": self.background,
                "temperature": self.temperature, "top_p": self.top_p, "truncation": "disabled",
                "text": {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)},
                "tool_choice": choice, "tools": [t.model_dump() for t in self.tools or []]}

    def chat_request(self, context: list[InputItem]) -> ChatRequest:
        """The chat request this response runs: `context` (the conversation before, then this
        response's input) as messages. ValueError with the chat endpoint's reason where it refuses it."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += chat_messages(context)
        body: dict[str, Any] = {"messages": messages, "model": self.model, "max_tokens": self.max_output_tokens,
                                "temperature": self.temperature, "top_p": self.top_p,
                                "parallel_tool_calls": self.parallel_tool_calls, "priority": self.priority,
                                "backend": self.backend, "service_tier": self.service_tier}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None and self.tools:
            body["tool_choice"] = ({"type": "function", "function": {"name": self.tool_choice.name}}
                                   if isinstance(self.tool_choice, NamedFunction) else self.tool_choice)
        if (fmt := self.text.format.response_format()) is not None and self.text.format.type != "text":
            body["response_format"] = fmt
        try:
            return ChatRequest.model_validate(body)
        except ValidationError as exc:
            raise ValueError("; ".join(_reason(e) for e in exc.errors())) from exc


def _reason(error: dict) -> str:
    where = ".".join(str(p) for p in error.get("loc", ()))
    return f"{where}: {error.get('msg')}" if where else str(error.get("msg"))


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls as one assistant message's
    tool_calls, a call's output as a tool message answering it."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.chat_content()})
        elif isinstance(item, ReasoningItem):
            continue  # an earlier thought: not part of the prompt
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def dump_items(items: list[InputItem]) -> str:
    return json.dumps([i.model_dump(exclude_none=True) for i in items], ensure_ascii=False)


def load_items(text: str) -> list[InputItem]:
    return [parse_item(value) for value in json.loads(text)]
