"""The Llama 3.x JSON tool format (Meta's JSON based tool calling of Llama 3.1, 3.2 and 3.3; vLLM's
`llama3_json` parser), for models whose chat template asks for it.

The template renders `tools` itself (Meta's puts them in the first user message) and asks for a call as
  {"name": <function name>, "parameters": <dictionary of argument name and its value>}
which the model may open with <|python_tag|>; several calls follow one another, separated by "; ",
as vLLM reads them. Earlier calls go back to the template as `tool_calls` with arguments as objects,
one per assistant turn (the template refuses more: a turn of several calls goes back as the text
the model wrote), and tool results as `role: "tool"` messages, which it renders as ipython turns.
The reply is constrained by a Lark grammar (llguidance's, each call's JSON under the function's
closed schema): calls only under `required` or a named function, one call under a named function or
without `parallel_tool_calls`; under `auto`, the calls or a plain answer that opens with neither
"{" nor "<" nor a space, so that it cannot be read as a call. Where <|python_tag|> is a
special token of the model's tokenizer (Llama's own), the grammar lets the calls open with it and
the reply is decoded with it kept (base.Markers); a tokenizer without it never writes it as text.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from api.core.parsers.base import ToolFormat
from api.core.parsers.registry import register
from api.core.parsers.tool_calls import ToolCallParser
from api.core.parsers.tool_stream import ToolCallStream
from api.core.tools import Tool, ToolChoice, arguments_of, call_schemas, openai_call, parallel_calls
from shared.structured import JSON_LAYOUT, StructuredOutputs

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = "; "
CALL_OPENS = ("{", "<")  # a call's first character (its JSON, or <|python_tag|>): any other opens an answer
_PROBE = {"type": "function", "function": {"name": "streamq_probe_tool", "description": "A probe."}}
# The template's request for this format, as Meta words it:
# Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}
_ASKS = re.compile(r'\{"name": [^{}"]+, "parameters": ')
# A call's opening up to its arguments' first character (never inside a JSON string: its quotes are escaped)
_OPENING = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\S)')


def knows(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template renders tools and asks for Llama 3 JSON calls."""
    return _knows(tokenizer, tokenizer.chat_template)


@lru_cache(maxsize=8)
def _knows(tokenizer: Tokenizer, template: str | None) -> bool:
    if not template or "parameters" not in template:
        return False
    try:
        rendered = tokenizer.render_chat([{"role": "user", "content": "hi"}], tools=[_PROBE])
    except ValueError:  # ChatTemplateError: the template cannot take tools after all
        return False
    return _PROBE["function"]["name"] in rendered and _ASKS.search(rendered) is not None


def call_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A call's schema (api/core/tools.py call_schemas) with its arguments under "parameters"."""
    properties = schema["properties"]
    return {**schema, "required": ["name", "parameters"],
            "properties": {"name": properties["name"], "parameters": properties["arguments"]}}


def constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool, tag: str | None = None
               ) -> StructuredOutputs:
    """The reply's grammar: calls (of `tools`) separated by "; ", or under "auto" a plain answer
    instead; `tag`: <|python_tag|> as the grammar names it where it is a special token of the
    model (then the calls may open with it, as Llama's own tokenizer lets the model write them)."""
    call = {"x-guidance": JSON_LAYOUT, "anyOf": [call_schema(s) for s in call_schemas(tools)]}
    opening = f"{tag}? " if tag else ""
    rules = [f"start: {opening}calls{' | TEXT' if choice in (None, 'auto') else ''}",
             f"calls: call ({json.dumps(SEPARATOR)} call)*" if parallel_calls(choice, parallel) else "calls: call",
             f"call: %json {json.dumps(call)}",
             r"TEXT: /[^{<\s][\s\S]*/"]
    return StructuredOutputs(grammar="\n".join(rules) + "\n")


def as_written(calls: list[dict[str, Any]]) -> str:
    """Calls ({"name", "arguments"}) as the model writes them."""
    return SEPARATOR.join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                          for c in calls)


def template_message(message: dict[str, Any], text: str) -> dict[str, Any]:
    """An earlier message as Llama 3.1's template reads it (`text`: its content as plain text). The
    template takes one call per assistant turn, and sees a first message that is not the system's
    as the user's, so a developer message goes as the system's."""
    role = message["role"]
    if role == "assistant" and message.get("tool_calls"):
        calls = [{"name": (c.get("function") or {}).get("name"), "arguments": arguments_of(c)}
                 for c in message["tool_calls"]]
        if len(calls) > 1:
            return {"role": "assistant", "content": as_written(calls)}
        return {"role": "assistant", "content": text, "tool_calls": [{"type": "function", "function": calls[0]}]}
    if role == "tool":
        return {"role": "tool", "content": text, "tool_call_id": message.get("tool_call_id")}
    return {"role": "system" if role == "developer" else role, "content": text}


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply, read as the grammar wrote it: one that opens with neither
    "{" nor "<" is a plain answer (content, as far as it got); else it is calls only, and a reply
    that is not whole calls (cut by max_tokens or a stop string, or malformed) has no calls and no
    content."""
    if not text.startswith(CALL_OPENS):
        return text or None, []
    body = text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text
    try:
        return None, [openai_call(name, arguments) for name, arguments in _calls(body)]
    except ValueError:
        return None, []


def _calls(body: str) -> list[tuple[str, dict[str, Any]]]:
    """Each call's name and arguments in `body`: calls separated by ";" (ValueError where it is not)."""
    decoder, calls = json.JSONDecoder(), []
    pos = _past_space(body, 0)
    while True:
        value, pos = decoder.raw_decode(body, pos)  # a cut call is a ValueError
        keys = list(value) if isinstance(value, dict) else []
        if keys not in (["name", "parameters"], ["name", "arguments"]):
            raise ValueError(f"not a call: {value!r}")
        name, arguments = value["name"], value[keys[1]]
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise ValueError(f"not a call: {value!r}")
        calls.append((name, arguments))
        pos = _past_space(body, pos)
        if pos == len(body):
            return calls
        if body[pos] != ";":
            raise ValueError(f"text after a call: {body[pos:]!r}")
        pos = _past_space(body, pos + 1)


def _past_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip())


class Llama3JsonFormat(ToolFormat):
    """Tools rendered by the chat template itself; calls as {"name", "parameters"} JSON under a grammar."""

    name = "llama3_json"
    MARKERS = (PYTHON_TAG,)

    @classmethod
    def knows(cls, tokenizer: Tokenizer) -> bool:
        return knows(tokenizer)

    def constraint(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
        return constraint(tools, choice, parallel, self.special.lit(PYTHON_TAG) if self.special.ids else None)

    def template_messages(self, messages: list[Any], tools: list[Tool], choice: ToolChoice | None
                          ) -> list[dict[str, Any]]:
        return [template_message(m.model_dump(), m.text()) for m in messages]

    def template_tools(self, tools: list[Tool]) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in tools]

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse(text)

    def stream(self) -> ToolCallParser:
        # its first character decides: an answer, or calls held while they stream
        return ToolCallParser(CALL_OPENS, ToolCallStream(_OPENING))


FORMAT = register(Llama3JsonFormat())
