"""OpenAI's function tools as every tool format reads them: the tools and tool_choice of a
request, the closing of their schemas as OpenAI's strict mode closes them (`closed`), each call's
schema, and a call in OpenAI's `tool_calls` form. The formats themselves are output parsers
(api/core/parsers/)."""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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
