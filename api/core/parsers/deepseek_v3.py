"""The DeepSeek-V3 / R1 tool format, for models whose chat template asks for it.

The template renders `tools` itself and asks for calls written between DeepSeek's own markers,
the function named outside its JSON:
  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
  ```json
  {"city": "Paris"}
  ```<｜tool▁call▁end｜>
  <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
(the markers' bars are fullwidth, U+FF5C, and their spaces U+2581). Earlier calls go back to the
template the same way (`tool_calls` with arguments as objects, which it writes with `tojson`), and
tool results as `role: "tool"` messages. The reply is constrained by a Lark grammar for llguidance,
each call's arguments under its function's closed schema: calls only under `required` or a named
function, one call under a named function or without `parallel_tool_calls`; under `auto`, the
calls or a plain answer, one that does not begin like `<｜tool▁calls▁begin｜>`. DeepSeek-V3.1's
format names the function without `function` and the ```json fence; it is not this one, and
`knows` tells the two apart by the template's own call.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from api.core.parsers.base import ToolFormat, literal
from api.core.parsers.registry import register
from api.core.parsers.tool_calls import ToolCallParser
from api.core.parsers.tool_stream import ToolCallStream, raw_name
from api.core.tools import Tool, ToolChoice, arguments_of, call_schemas, openai_call, parallel_calls
from shared.structured import JSON_LAYOUT, StructuredOutputs

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"
# A call's head up to its arguments (the name is whole once the fence follows it)
_HEAD = re.compile(re.escape(CALL_BEGIN + "function" + SEP) + r"([A-Za-z0-9_-]+)" + re.escape(FENCE_OPEN))
_TAIL = FENCE_CLOSE + CALL_END
_PROBE_NAME = "streamq_probe_tool"
_PROBE = {"type": "function", "function": {"name": _PROBE_NAME, "parameters": {"type": "object"}}}
_DECODER = json.JSONDecoder()


def knows(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template renders tools, asks for calls in this format, and writes
    an earlier call (its arguments an object) in it too."""
    return _knows(tokenizer, tokenizer.chat_template)


@lru_cache(maxsize=8)
def _knows(tokenizer: Tokenizer, template: str | None) -> bool:
    if not template or CALLS_BEGIN not in template:
        return False
    ask = [{"role": "user", "content": "hi"}]
    earlier = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}]}]
    try:
        asked = tokenizer.render_chat(ask, tools=[_PROBE])
        written = tokenizer.render_chat(earlier, add_generation_prompt=False, tools=[_PROBE])
    except (ValueError, TypeError):  # ChatTemplateError, or a template that reads arguments as a string
        return False
    instructions = re.search(re.escape(CALL_BEGIN + "function" + SEP) + r"[^\n]*" + re.escape(FENCE_OPEN), asked)
    return _PROBE_NAME in asked and instructions is not None and \
        f"{CALL_BEGIN}function{SEP}{_PROBE_NAME}{FENCE_OPEN}{{}}{_TAIL}" in written


def answer_pattern() -> str:
    """A regex for a plain answer: any text that neither begins with CALLS_BEGIN nor stops inside
    it (each alternative leaves the marker at one of its characters)."""
    return "(?:" + "|".join(f"{re.escape(CALLS_BEGIN[:i])}[^{re.escape(c)}]" for i, c in enumerate(CALLS_BEGIN)) \
        + r")[\s\S]*"


def constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool,
               lit: Callable[[str], str] = literal) -> StructuredOutputs:
    """The reply's grammar: calls of `tools` between the markers, or under "auto" a plain answer;
    `lit` writes a literal (its markers by token id, where they are special tokens: Markers)."""
    rules = [f"start: calls{' | TEXT' if choice in (None, 'auto') else ''}",
             f"calls: {lit(CALLS_BEGIN)} call " + ('("\\n" call)* ' if parallel_calls(choice, parallel) else "")
             + lit(CALLS_END),
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, (tool, schema) in enumerate(zip(tools, call_schemas(tools))):
        arguments = {"x-guidance": JSON_LAYOUT, **schema["properties"]["arguments"]}
        head = f"{CALL_BEGIN}function{SEP}{tool.function.name}{FENCE_OPEN}"
        rules.append(f"call_{i}: {lit(head)} %json {json.dumps(arguments)} {lit(_TAIL)}")
    rules.append(f"TEXT: /{answer_pattern()}/")
    return StructuredOutputs(grammar="\n".join(rules) + "\n")


def template_message(message: dict[str, Any], text: str) -> dict[str, Any]:
    """An earlier message as a DeepSeek template reads it (`text`: its content as plain text). An
    assistant's calls carry their type (the template writes it) and arguments as objects; its
    content is "" rather than None, which some of the family's templates cannot read."""
    if message["role"] == "assistant" and message.get("tool_calls"):
        calls = [{"type": "function", "function": {"name": (c.get("function") or {}).get("name"),
                                                   "arguments": arguments_of(c)}} for c in message["tool_calls"]]
        return {"role": "assistant", "content": text or "", "tool_calls": calls}
    if message["role"] == "tool":
        return {"role": "tool", "content": text, "tool_call_id": message.get("tool_call_id")}
    return {"role": message["role"], "content": text}


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply, read as the grammar wrote it: one that begins with
    CALLS_BEGIN is calls only, and one that is not whole calls (cut by max_tokens or a stop string,
    or malformed) has no calls and no content; so has one that stops inside the marker. Any other
    reply is a plain answer."""
    if CALLS_BEGIN.startswith(text):
        return None, []
    if not text.startswith(CALLS_BEGIN):
        return text, []
    return None, _calls(text) or []


def _calls(text: str) -> list[dict[str, Any]] | None:
    """The calls of a reply that begins with CALLS_BEGIN, or None where it is not whole calls."""
    calls, pos = [], len(CALLS_BEGIN)
    while True:
        head = _HEAD.match(text, pos)
        if head is None:
            return None
        try:
            arguments, end = _DECODER.raw_decode(text, head.end())
        except ValueError:
            return None
        if not text.startswith(_TAIL, end):
            return None
        calls.append(openai_call(head[1], arguments))
        pos = end + len(_TAIL)
        rest = text[pos:].lstrip()
        if not rest.startswith(CALL_BEGIN):
            return calls if rest.rstrip() == CALLS_END else None
        pos = len(text) - len(rest)


class DeepSeekV3Format(ToolFormat):
    """Tools rendered by the chat template itself; calls between DeepSeek's markers, under a grammar."""

    name = "deepseek_v3"
    MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    @classmethod
    def knows(cls, tokenizer: Tokenizer) -> bool:
        return knows(tokenizer)

    def constraint(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
        return constraint(tools, choice, parallel, self.special.lit)

    def template_messages(self, messages: list[Any], tools: list[Tool], choice: ToolChoice | None
                          ) -> list[dict[str, Any]]:
        return [template_message(m.model_dump(), m.text()) for m in messages]

    def template_tools(self, tools: list[Tool]) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in tools]

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse(text)

    def stream(self) -> ToolCallParser:
        # held while the reply may still open with the calls' marker; then an answer, or calls as written
        return ToolCallParser(CALLS_BEGIN, ToolCallStream(_HEAD, raw_name, strip=False))


FORMAT = register(DeepSeekV3Format())
