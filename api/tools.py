"""OpenAI tool calling on any model, in a generic JSON format kept by a constraint.

The tools are described to the model in a system message, and its reply is constrained (a JSON
schema, followed by the worker's structured outputs) to one JSON object:
  {"tool_calls": [{"name": <a tool's name>, "arguments": <that tool's parameters>}, ...]}
or, where `tool_choice` is "auto", also {"response": "<a plain answer>"},
as llama.cpp's server does for chat templates that know no tool format. The arguments therefore
always validate against the function's schema, whatever the model. `required` allows tool calls
only, a named function only that one, `parallel_tool_calls: false` one call at most. The reply
is parsed back into OpenAI's `message.tool_calls` (arguments as a JSON string), or `content`.
Earlier turns go back to the model in the same format: an assistant message's `tool_calls` as
that object, a `role: "tool"` message as its content, named by its `tool_call_id`.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.structured import StructuredOutputs

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class _Name(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: _Name


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def chosen(tools: list[Tool], choice: ToolChoice | None) -> list[Tool]:
    """The tools the model may call under `choice` (ValueError naming an unknown one)."""
    if isinstance(choice, NamedToolChoice):
        found = [t for t in tools if t.function.name == choice.function.name]
        if not found:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not one of the tools "
                             f"({', '.join(t.function.name for t in tools)})")
        return found
    return [] if choice == "none" else tools


def call_schemas(tools: list[Tool]) -> list[dict[str, Any]]:
    """One JSON schema per tool for a call of it: {"name": <its name>, "arguments": <its parameters>}
    (both tool formats write a call so)."""
    return [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters or ANY_OBJECT}}
            for t in tools]


def arguments_of(call: dict[str, Any]) -> Any:
    """An earlier OpenAI tool call's arguments as the model wrote them: the JSON string parsed
    (kept as it is where it does not parse)."""
    arguments = (call.get("function") or {}).get("arguments") or "{}"
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def openai_call(name: str, arguments: Any) -> dict[str, Any]:
    """A call the model wrote, in OpenAI's `tool_calls` form, with a fresh id."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
    """The reply's JSON schema: tool calls (of `tools`), or under "auto" a plain answer too."""
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call_schemas(tools)}}
    if not parallel:
        calls["maxItems"] = 1
    call = {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
            "properties": {"tool_calls": calls}}
    if choice in (None, "auto"):
        answer = {"type": "object", "additionalProperties": False, "required": ["response"],
                  "properties": {"response": {"type": "string"}}}
        return StructuredOutputs.model_validate({"json": {"anyOf": [call, answer]}})
    return StructuredOutputs.model_validate({"json": call})


def system_text(tools: list[Tool], choice: ToolChoice | None) -> str:
    """The tools and the reply format, for the system message."""
    lines = ["Tools:"]
    for t in tools:
        f = t.function
        schema = json.dumps(f.parameters or ANY_OBJECT, ensure_ascii=False, separators=(",", ":"))
        lines.append(f"- {f.name}({schema})" + (f": {f.description}" if f.description else ""))
    lines.append('Call tools with {"tool_calls":[{"name":...,"arguments":{...}}]}' +
                 (', or answer with {"response":"..."}.' if choice in (None, "auto") else "."))
    return "\n".join(lines)


def as_model_turn(message: dict[str, Any]) -> str:
    """An assistant message's tool calls, as the model wrote them."""
    calls = [{"name": (call.get("function") or {}).get("name"), "arguments": arguments_of(call)}
             for call in message.get("tool_calls") or []]
    return json.dumps({"tool_calls": calls}, ensure_ascii=False)


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply in the generic format. An unfinished reply (max_tokens)
    is content as it stands."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        return None, [openai_call(c["name"], c["arguments"]) for c in value["tool_calls"]]
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return value["response"], []
    return text, []
