"""The generic tool format: OpenAI tool calling on any model, in a JSON format kept by a constraint.

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
from typing import Any

from api.core.parsers.base import Reply, ToolFormat
from api.core.parsers.registry import register
from api.core.parsers.tool_calls import ToolCallParser
from api.core.tools import NO_PARAMETERS, Tool, ToolChoice, arguments_of, call_schemas, openai_call, parallel_calls
from shared.structured import StructuredOutputs

__all__ = ["FORMAT", "Reply", "as_model_turn", "constraint", "parse", "system_text", "template_message"]


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


def template_message(message: Any) -> dict[str, str]:
    """An earlier message (a core ChatMessage) as the chat template renders it, its tool calls in
    this format."""
    if message.role == "assistant" and message.tool_calls:
        return {"role": "assistant", "content": as_model_turn(message.model_dump())}
    if message.role == "tool":
        return {"role": "tool", "content": f"[{message.tool_call_id or 'tool'}] {message.text()}"}
    return {"role": message.role, "content": message.text()}


class GenericFormat(ToolFormat):
    """Tools described in a system message; the reply one JSON object under a JSON schema."""

    name = "generic"

    def constraint(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
        return constraint(tools, choice, parallel)

    def template_messages(self, messages: list[Any], tools: list[Tool], choice: ToolChoice | None
                          ) -> list[dict[str, Any]]:
        out = [template_message(m) for m in messages]
        text = system_text(tools, choice)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
        return out

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse(text)

    def stream(self) -> ToolCallParser:
        return ToolCallParser(call_opens=None)  # the reply is one JSON object: held to its end


FORMAT = register(GenericFormat())
