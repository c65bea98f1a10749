"""The Qwen3-Coder tool format, for models whose chat template asks for XML calls (Qwen3-Coder,
Qwen3-Coder-Next, Qwen3.5). The template renders `tools` itself and asks for
  <tool_call>
  <function=get_weather>
  <parameter=city>
  Paris
  </parameter>
  </function>
  </tool_call>
one block per call, each parameter's value as plain text (api/core/parsers/qwen3_coder_reply.py
reads it back, typed by the parameter's schema). The reply is constrained by a Lark grammar: call
blocks only under `required` or a named function, one block under a named function or without
`parallel_tool_calls`; under `auto`, the blocks or a plain answer that does not begin with "<". A
call writes its function's parameters in the schema's order, the required ones always, no other;
a string parameter's value is free text without "</parameter>" (within its enum, const,
minLength and maxLength; `pattern` and `format` are not kept), any other's is JSON under its
closed schema. Earlier calls go back to the template with their arguments as a mapping of the
values' texts, as the model wrote them.
"""
from __future__ import annotations

import copy
import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from api.core.parsers.base import ToolFormat
from api.core.parsers.qwen3_coder_reply import JSON, TEXT, CallStream, parse
from api.core.parsers.registry import register
from api.core.tools import NO_PARAMETERS, Tool, ToolChoice, arguments_of, closed, parallel_calls
from shared.structured import JSON_LAYOUT, StructuredOutputs

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

_PROBE = {"type": "function", "function": {"name": "streamq_probe_tool", "parameters": {
    "type": "object", "properties": {"streamq_probe_parameter": {"type": "string"}}}}}
_DEFS = ("$defs", "definitions")


def knows(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template renders tools and asks for `<function=...>` calls with
    `<parameter=...>` values."""
    return _knows(tokenizer, tokenizer.chat_template)


@lru_cache(maxsize=8)
def _knows(tokenizer: Tokenizer, template: str | None) -> bool:
    if not template or "<function=" not in template or "<parameter=" not in template:
        return False
    try:
        rendered = tokenizer.render_chat([{"role": "user", "content": "hi"}], tools=[_PROBE])
    except ValueError:  # ChatTemplateError: the template cannot take tools after all
        return False
    return all(s in rendered for s in ("streamq_probe_tool", "streamq_probe_parameter", "<function=", "<parameter="))


def parameters(tool: Tool) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """A tool's parameters' schemas (closed) by name in the schema's order, the required ones, and
    the schema's definitions that a $ref in them may name."""
    schema = closed(tool.function.parameters or NO_PARAMETERS)
    properties = schema.get("properties") or {}
    for key in properties:
        if not key or any(c in key for c in "<>\n"):
            raise ValueError(f"{tool.function.name}: parameter {key!r} cannot be written in the Qwen3-Coder format")
    return properties, [k for k in schema.get("required") or [] if k in properties], \
        {k: schema[k] for k in _DEFS if k in schema}


def kind(schema: Any, defs: dict[str, Any]) -> str:
    """TEXT where a parameter's value is a string (written as it is), else JSON."""
    schema = _resolved(schema, defs)
    if not isinstance(schema, dict):
        return JSON
    if "const" in schema:
        return TEXT if isinstance(schema["const"], str) else JSON
    if "enum" in schema:
        return TEXT if schema["enum"] and all(isinstance(v, str) for v in schema["enum"]) else JSON
    return TEXT if schema.get("type") in ("string", ["string"]) else JSON


def kinds_of(tool: Tool) -> dict[str, str]:
    properties, _, defs = parameters(tool)
    return {key: kind(schema, defs) for key, schema in properties.items()}


def _resolved(schema: Any, defs: dict[str, Any]) -> Any:
    """A parameter's schema, past a $ref to the parameters' own definitions."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    for name in _DEFS:
        if isinstance(ref, str) and ref.startswith(f"#/{name}/"):
            return defs.get(name, {}).get(ref.removeprefix(f"#/{name}/"), schema)
    return schema


def _escaped(text: str) -> str:
    """A literal in a regex, every character but letters and digits as a code point."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


def _text_value(schema: dict[str, Any]) -> str:
    """A terminal for a string value and its closing tag: free text (within the schema's words
    for strings) that holds no closing tag before its own."""
    if "const" in schema:
        value = _escaped(schema["const"])
    elif "enum" in schema:
        value = "(?:" + "|".join(_escaped(v) for v in schema["enum"]) + ")"
    elif "minLength" in schema or "maxLength" in schema:
        value = f"(?s:.{{{int(schema.get('minLength', 0))},{schema.get('maxLength', '')}}})"
    else:
        value = "(?s:.*)"
    return rf"/{value}\n<\/parameter>/ & ~/(?s:.*<\/parameter>.+)/"


def function_rules(index: int, tool: Tool) -> list[str]:
    """The grammar's rules for one call of `tool` (rule f{index}), its parameters in order."""
    properties, required, defs = parameters(tool)
    rule, parts, rules = f"f{index}", [], []
    for n, (key, schema) in enumerate(properties.items()):
        opening = json.dumps(f"<parameter={key}>\n")
        if kind(schema, defs) == TEXT:
            rules += [f"{rule}_{n}: {opening} V{index}_{n} \"\\n\"", f"V{index}_{n}: {_text_value(_resolved(schema, defs))}"]
        else:
            value = {"x-guidance": JSON_LAYOUT, **schema, **defs}
            rules.append(f"{rule}_{n}: {opening} %json {json.dumps(value)} {json.dumps(chr(10) + '</parameter>' + chr(10))}")
        parts.append(f"{rule}_{n}" if key in required else f"{rule}_{n}?")
    opening = json.dumps(f"<function={tool.function.name}>\n")
    return [f"{rule}: {opening} {' '.join(parts)} \"</function>\\n\"", *rules]


def constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
    """The reply's grammar: call blocks (of `tools`), or under "auto" a plain answer instead."""
    rules = [f"start: calls{' | TEXT' if choice in (None, 'auto') else ''}",
             'calls: call ("\\n" call)*' if parallel_calls(choice, parallel) else "calls: call",
             f'call: "<tool_call>\\n" ({" | ".join(f"f{i}" for i in range(len(tools)))}) "</tool_call>"',
             r"TEXT: /[^<][\s\S]*/"]
    for i, tool in enumerate(tools):
        rules += function_rules(i, tool)
    return StructuredOutputs(grammar="\n".join(rules) + "\n")


def _written(value: Any) -> str:
    """An argument's value as the model writes it: a string as it is, else its JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def template_message(message: dict[str, Any], text: str) -> dict[str, Any]:
    """An earlier message as the Qwen3-Coder template reads it (`text`: its content as plain
    text): an assistant's calls with their arguments as a mapping of the values' texts."""
    if message["role"] == "assistant" and message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            arguments = arguments_of(call)
            if not isinstance(arguments, dict):
                raise ValueError("an earlier tool call's arguments are not a JSON object")
            calls.append({"type": "function", "function": {"name": (call.get("function") or {}).get("name"),
                                                           "arguments": {k: _written(v) for k, v in arguments.items()}}})
        return {"role": "assistant", "content": text, "tool_calls": calls}
    if message["role"] == "tool":
        return {"role": "tool", "content": text, "tool_call_id": message.get("tool_call_id")}
    return {"role": message["role"], "content": text}


def template_tool(tool: Tool) -> dict[str, Any]:
    """A tool as the template renders it: it reads `parameters.properties` unguarded."""
    out = tool.model_dump(exclude_none=True)
    out["function"]["parameters"] = {"type": "object", "properties": {}, **(tool.function.parameters or {})}
    return out


class Qwen3CoderFormat(ToolFormat):
    """Tools rendered by the chat template itself; calls in <function=...> blocks under a grammar.

    A value's type is its parameter's: the format bound to a request's tools (`bind`, as the chat
    request hands it to the reply's parser) types each value by its schema. The registered format,
    bound to none (a stored response read back on another replica), reads a value as JSON where it
    reads as such, else as text. Nothing is kept between requests: one tenant's tools never type
    another's values."""

    name = "qwen3_coder"

    def __init__(self, kinds_by_name: dict[str, dict[str, str]] | None = None) -> None:
        self.kinds_by_name = kinds_by_name or {}

    @classmethod
    def knows(cls, tokenizer: Tokenizer) -> bool:
        return knows(tokenizer)

    def bind(self, tools: list[Tool]) -> Qwen3CoderFormat:
        bound = copy.copy(self)  # this model's, as for_tokenizer made it
        bound.kinds_by_name = {tool.function.name: kinds_of(tool) for tool in tools}
        return bound

    def kinds(self, name: str) -> dict[str, str] | None:
        return self.kinds_by_name.get(name)

    def constraint(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
        return constraint(tools, choice, parallel)

    def template_messages(self, messages: list[Any], tools: list[Tool], choice: ToolChoice | None
                          ) -> list[dict[str, Any]]:
        return [template_message(m.model_dump(), m.text()) for m in messages]

    def template_tools(self, tools: list[Tool]) -> list[dict[str, Any]]:
        return [template_tool(t) for t in tools]

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse(text, self.kinds)

    def stream(self) -> CallStream:
        return CallStream(self.kinds)


FORMAT = register(Qwen3CoderFormat())
