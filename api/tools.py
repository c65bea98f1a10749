"""OpenAI tool calling on any model, in a generic JSON format kept by a constraint.

The tools are described to the model in a system message, and its reply is constrained (a JSON
schema, followed by the worker's structured outputs) to one JSON object:
  {"tool_calls": [{"name": <a tool's name>, "arguments": <that tool's parameters>}, ...]}
or, where `tool_choice` is "auto", also {"response": "<a plain answer>"},
as llama.cpp's server does for chat templates that know no tool format. The arguments therefore
always validate against the function's schema, closed as OpenAI's strict mode closes it (`closed`),
whatever the model. `required` allows tool calls only, a named function exactly one call of it,
`parallel_tool_calls: false` one call at most. The reply is read back (`read_reply`, for both
formats) into OpenAI's `message.tool_calls` (arguments as a JSON string), or `content`; one cut
by max_tokens holds no call, and is never passed off as text.
Earlier turns go back to the model in the same format: an assistant message's `tool_calls` as
that object, a `role: "tool"` message as its content, named by its `tool_call_id`.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from shared.structured import StructuredOutputs

# OpenAI: "Omitting parameters defines a function with an empty parameter list."
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


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


def parallel_calls(choice: ToolChoice | None, parallel: bool) -> bool:
    """Whether a reply may hold more than one call: never under a named tool_choice (exactly one
    call of it, as OpenAI and vLLM give), else as `parallel_tool_calls` says."""
    return parallel and not isinstance(choice, NamedToolChoice)


# Keywords whose schemas describe the same instance as the schema holding them (its parts), the
# alternatives for it (parts too, beside an object's own type or within a part), and the values
# inside it. `not` is left alone: closing it would widen it.
_PARTS = ("allOf", "if", "then", "else", "dependentSchemas")
_ALTERNATIVES = ("anyOf", "oneOf")
_INSIDE = ("properties", "patternProperties", "$defs", "definitions", "items", "prefixItems", "additionalItems",
           "contains", "additionalProperties", "unevaluatedItems", "unevaluatedProperties")
_BY_NAME = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # {name: schema}


def closed(schema: Any, part: bool = False) -> Any:
    """A copy of a JSON schema in which every object schema (type object, or with properties) that
    does not set additionalProperties gets false, as OpenAI's strict mode asks, at any depth. An
    object whose parts (allOf, if/then/else, dependentSchemas, anyOf/oneOf beside its own type)
    name keys of their own is left open, and its parts are never closed: closed, each would forbid
    the others' keys, leaving only {}. The objects inside them are closed."""
    if isinstance(schema, list):
        return [closed(s, part) for s in schema]
    if not isinstance(schema, dict):
        return schema
    is_object = _is_object(schema)
    out = {}
    for key, value in schema.items():
        if key in _PARTS + _ALTERNATIVES + _INSIDE:
            inner = key in _PARTS or (key in _ALTERNATIVES and (is_object or part))
            value = ({k: closed(v, inner) for k, v in value.items()} if key in _BY_NAME and isinstance(value, dict)
                     else closed(value, inner))
        out[key] = value
    if (is_object and not part and "additionalProperties" not in schema
            and not any(_names_keys(p) for p in _parts(schema, is_object))):
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict[str, Any]) -> bool:
    types = schema.get("type")
    return "object" in (types if isinstance(types, list) else [types]) or "properties" in schema


def _parts(schema: dict[str, Any], alternatives: bool) -> list[Any]:
    """The schemas that describe the same instance as `schema`."""
    out: list[Any] = []
    for key in _PARTS + (_ALTERNATIVES if alternatives else ()):
        value = schema.get(key)
        if isinstance(value, dict) and key == "dependentSchemas":
            out += value.values()
        elif value is not None:
            out += value if isinstance(value, list) else [value]
    return out


def _names_keys(part: Any) -> bool:
    """Whether a part names keys of the object (properties, or a $ref that may), or its parts do."""
    return isinstance(part, dict) and (any(k in part for k in ("properties", "patternProperties", "$ref"))
                                       or any(_names_keys(p) for p in _parts(part, True)))


def call_schemas(tools: list[Tool]) -> list[dict[str, Any]]:
    """One JSON schema per tool for a call of it: {"name": <its name>, "arguments": <its parameters,
    closed>} (both tool formats write a call so)."""
    return [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": t.function.name},
                            "arguments": closed(t.function.parameters or NO_PARAMETERS)}}
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
    if not parallel_calls(choice, parallel):
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
        schema = json.dumps(f.parameters or NO_PARAMETERS, ensure_ascii=False, separators=(",", ":"))
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
    """(content, tool_calls) of a reply in the generic format. A reply that is not whole JSON (cut
    by max_tokens or a stop string) has no calls: its content is the plain answer as far as it
    got, or None where it was not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return _answer_so_far(text), []
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        return None, [openai_call(c["name"], c["arguments"]) for c in value["tool_calls"]]
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return value["response"], []
    return None, []


_ANSWER = re.compile(r'\s*\{\s*"response"\s*:\s*(?=")')


def _answer_so_far(text: str) -> str | None:
    """The "response" string of an unfinished {"response": "..."}, decoded up to its last whole
    character (a cut escape is dropped); None for any other reply."""
    opening = _ANSWER.match(text)
    if opening is None:
        return None
    string = text[opening.end():]
    try:
        return json.JSONDecoder().raw_decode(string)[0]  # the string is whole, the object is not
    except ValueError:
        pass
    for cut in range(len(string), max(0, len(string) - 6), -1):  # an escape is at most 6 characters
        try:
            answer = json.loads(string[:cut] + '"')
        except ValueError:
            continue
        return answer[:-1] if answer and "\ud800" <= answer[-1] <= "\udbff" else answer  # half a pair
    return None


@dataclass(frozen=True)
class Reply:
    """A reply read in its tool format: the answer or the calls, and the finish reason to report."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str


def read_reply(text: str, finish_reason: str,
               parse: Callable[[str], tuple[str | None, list[dict[str, Any]]]] = parse) -> Reply:
    """A reply's content, tool calls and finish reason, by its format's `parse` (this module's, or
    api.hermes.parse). Calls count only in a reply that ended on its own (finish reason stop, then
    reported as tool_calls): one cut by max_tokens is finish reason length with no calls, even where
    the calls so far are whole, and a cut call is never content (that is the answer so far, or None)."""
    content, calls = parse(text)
    if calls and finish_reason == "stop":
        return Reply(None, calls, "tool_calls")
    return Reply(content, [], finish_reason)
