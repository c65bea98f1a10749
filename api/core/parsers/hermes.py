"""The Hermes tool format, for models whose chat template knows it (Qwen2.5, Hermes, and others).

The template renders `tools` itself and asks for calls as
  <tool_call>
  {"name": <a tool's name>, "arguments": <that tool's parameters>}
  </tool_call>
one block per call, so the tools go to the template as OpenAI's `tools` list and the conversation's
earlier calls and tool results as the template reads them (`tool_calls` with arguments as
objects, `role: "tool"` messages). The reply is constrained by a Lark grammar (llguidance's,
with each call's JSON under the function's closed schema): tool call blocks only under `required`
or a named function, one block under a named function or without `parallel_tool_calls`; under
`auto`, the blocks or a plain answer, one that does not begin with "<". Either way the arguments
validate against the function's schema, and the reply is parsed back into OpenAI's `tool_calls`.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from api.core.parsers.base import ToolFormat
from api.core.parsers.registry import register
from api.core.parsers.tool_calls import ToolCallParser
from api.core.tools import Tool, ToolChoice, arguments_of, call_schemas, openai_call, parallel_calls
from shared.structured import JSON_LAYOUT, StructuredOutputs

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_BLOCKS = re.compile(r"(?:<tool_call>.*?</tool_call>\s*)+", re.DOTALL)
_PROBE = {"type": "function", "function": {"name": "streamq_probe_tool", "parameters": {"type": "object"}}}


def knows(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template renders tools and asks for Hermes-style calls."""
    return _knows(tokenizer, tokenizer.chat_template)


@lru_cache(maxsize=8)
def _knows(tokenizer: Tokenizer, template: str | None) -> bool:
    if not template or "<tool_call>" not in template:
        return False
    try:
        rendered = tokenizer.render_chat([{"role": "user", "content": "hi"}], tools=[_PROBE])
    except ValueError:  # ChatTemplateError: the template cannot take tools after all
        return False
    # Qwen3-Coder's template names <tool_call> too, but asks for <function=...> blocks in it
    return _PROBE["function"]["name"] in rendered and "<function=" not in rendered


def constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
    """The reply's grammar: call blocks (of `tools`), or under "auto" a plain answer instead."""
    call = {"x-guidance": JSON_LAYOUT, "anyOf": call_schemas(tools)}
    rules = [f"start: calls{' | TEXT' if choice in (None, 'auto') else ''}",
             'calls: call ("\\n" call)*' if parallel_calls(choice, parallel) else "calls: call",
             f"call: {json.dumps(OPEN)} %json {json.dumps(call)} {json.dumps(CLOSE)}",
             r"TEXT: /[^<][\s\S]*/"]
    return StructuredOutputs(grammar="\n".join(rules) + "\n")


def template_message(message: dict[str, Any], text: str) -> dict[str, Any]:
    """An earlier message as a Hermes template reads it (`text`: its content as plain text)."""
    if message["role"] == "assistant" and message.get("tool_calls"):
        calls = [{"type": "function", "function": {"name": (c.get("function") or {}).get("name"),
                                                   "arguments": arguments_of(c)}} for c in message["tool_calls"]]
        return {"role": "assistant", "content": text, "tool_calls": calls}
    if message["role"] == "tool":
        return {"role": "tool", "content": text, "tool_call_id": message.get("tool_call_id")}
    return {"role": message["role"], "content": text}


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply, read as the grammar wrote it: one that does not open with
    "<" is a plain answer (content, as far as it got); else it is call blocks only, and a reply
    that is not whole blocks (cut by max_tokens or a stop string) has no calls and no content."""
    if not text.startswith("<"):
        return text or None, []
    if not _BLOCKS.fullmatch(text):
        return None, []
    calls = []
    for block in _BLOCK.findall(text):
        try:
            value = json.loads(block)
            name, arguments = value["name"], value["arguments"]
        except (ValueError, KeyError, TypeError):
            return None, []
        calls.append(openai_call(name, arguments))
    return None, calls


class HermesFormat(ToolFormat):
    """Tools rendered by the chat template itself; calls in <tool_call> blocks under a grammar."""

    name = "hermes"

    @classmethod
    def knows(cls, tokenizer: Tokenizer) -> bool:
        return knows(tokenizer)

    def constraint(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
        return constraint(tools, choice, parallel)

    def template_messages(self, messages: list[Any], tools: list[Tool], choice: ToolChoice | None
                          ) -> list[dict[str, Any]]:
        return [template_message(m.model_dump(), m.text()) for m in messages]

    def template_tools(self, tools: list[Tool]) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in tools]

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse(text)

    def stream(self) -> ToolCallParser:
        return ToolCallParser(call_opens="<")  # a reply that opens otherwise is a plain answer


FORMAT = register(HermesFormat())
