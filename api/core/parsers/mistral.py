"""The Mistral tool formats, for models whose chat template renders `[AVAILABLE_TOOLS]` and asks for
calls after a `[TOOL_CALLS]` marker. Mistral's models write them in one of two forms:
  JSON list (Mistral 7B v0.3, Mixtral, Nemo):  [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]
  v11 (Mistral Small 3.x, Magistral, Devstral: tokenizers v11 and later):
                                               [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}
Which one a model writes is its template's: the one that renders earlier calls with `[ARGS]` (and
perhaps `[CALL_ID]`) is v11. A format is chosen per served model but is one object for all of them
(registry.py), and its constraint, prompt and parser read no template, so each form is a format of
its own: `mistral` and `mistral_v11`, each certain (`knows`) only of its own form's templates.
[TOOL_CALLS], [ARGS] and [CALL_ID] are special tokens of Mistral's own tokenizers: there the grammar
names them by id and the reply is decoded with them kept (base.Markers).

The tools go to the template as OpenAI's `tools` list. Earlier calls go back with ids of 9 letters
and digits, as the templates require (OpenAI's `call_...` ids are shortened, the same way for a call
and its result), and arguments as objects; a tool's result as the form reads it: in the JSON list,
where the template writes {"content": <it>, "call_id": ...}, as JSON (a plain text quoted, as
mistral_common writes it), and as plain text in v11. The reply is constrained by a Lark grammar
(llguidance's, each call's arguments under the function's closed schema): calls only under
`required` or a named function, one call under a named function or without `parallel_tool_calls`;
under `auto`, the calls or a plain answer that does not open with `[TOOL_CALLS]`. Either way the
reply is parsed back into OpenAI's `tool_calls`.
"""
from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar

from api.core.parsers.base import ToolFormat, literal
from api.core.parsers.registry import register
from api.core.parsers.tool_calls import ToolCallParser
from api.core.parsers.tool_stream import ToolCallStream, raw_name
from api.core.tools import NO_PARAMETERS, Tool, ToolChoice, arguments_of, call_schemas, closed, openai_call, \
    parallel_calls
from shared.structured import JSON_LAYOUT, StructuredOutputs

ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
MARKER = "[TOOL_CALLS]"  # a call reply opens with it; held while the reply may still be its start (ToolCallParser)
# A v11 call's head, whole: the name (OpenAI's names are [A-Za-z0-9_-]), a call id where the model
# writes one (v13 templates render [CALL_ID] in earlier turns), then its arguments' object opens.
V11_HEAD = re.compile(r"\s*\[TOOL_CALLS\]([A-Za-z0-9_-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

LIST, V11 = "list", "v11"
_PROBE_NAME, _PROBE_ID = "streamq_probe_tool", "streamq01"
_PROBE = {"type": "function", "function": {"name": _PROBE_NAME, "parameters": {"type": "object"}}}
_PROBE_CHAT = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": _PROBE_ID, "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}]},
               {"role": "tool", "content": '"ok"', "tool_call_id": _PROBE_ID}]
_RENDERED = {V11: re.compile(rf"\[TOOL_CALLS\]{_PROBE_NAME}(?:\[CALL_ID\]{_PROBE_ID})?\[ARGS\]"),
             LIST: re.compile(rf'\[TOOL_CALLS\]\s*\[\s*\{{"name": "{_PROBE_NAME}"')}
_ID = re.compile(r"[A-Za-z0-9]{9}")
_BASE62 = string.digits + string.ascii_letters


def template_form(tokenizer: Tokenizer) -> str | None:
    """The form of calls the model's chat template asks for (LIST or V11), or None where it is no
    Mistral tool template."""
    return _form(tokenizer, tokenizer.chat_template)


@lru_cache(maxsize=8)
def _form(tokenizer: Tokenizer, template: str | None) -> str | None:
    if not template or MARKER not in template:
        return None
    try:
        offered = tokenizer.render_chat(_PROBE_CHAT[:1], tools=[_PROBE])
        answered = tokenizer.render_chat(_PROBE_CHAT, tools=[_PROBE])
    except ValueError:  # ChatTemplateError: the template cannot take tools or calls after all
        return None
    if "[AVAILABLE_TOOLS]" not in offered or _PROBE_NAME not in offered:
        return None
    return next((form for form, rendered in _RENDERED.items() if rendered.search(answered)), None)


def _text_not_opening_with(marker: str) -> str:
    """A regex of the texts that go off `marker` at one of its characters: a plain answer. One that
    is only the marker's start is none (parse reads it as a call cut)."""
    return "|".join(re.escape(marker[:i]) + "[^" + ("\\" + c if c in "\\]^-[" else c) + r"][\s\S]*"
                    for i, c in enumerate(marker))


def constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool, form: str,
               lit: Callable[[str], str] = literal) -> StructuredOutputs:
    """The reply's grammar: calls (of `tools`) in `form`, or under "auto" a plain answer instead;
    `lit` writes a literal (its markers by token id, where they are special tokens: Markers)."""
    many = parallel_calls(choice, parallel)
    rules = [f"start: calls{' | TEXT' if choice in (None, 'auto') else ''}"]
    if form == LIST:
        call = {"x-guidance": JSON_LAYOUT, "anyOf": call_schemas(tools)}
        more = ' (", " call)*' if many else ""
        rules += [f'calls: {lit(MARKER)} " "? "[" call{more} "]"', f"call: %json {json.dumps(call)}"]
    else:
        rules += ["calls: call+" if many else "calls: call",
                  f"call: {lit(MARKER)} ({' | '.join(f'args_{i}' for i in range(len(tools)))})"]
        for i, tool in enumerate(tools):
            schema = {**closed(tool.function.parameters or NO_PARAMETERS), "x-guidance": JSON_LAYOUT}
            rules.append(f"args_{i}: {lit(tool.function.name + ARGS)} %json {json.dumps(schema)}")
    rules.append(f"TEXT: /{_text_not_opening_with(MARKER)}/")
    return StructuredOutputs(grammar="\n".join(rules) + "\n")


def short_id(call_id: str) -> str:
    """A call id as Mistral's templates take it, 9 letters and digits: one that is already so, as
    it is; any other, the same 9 for the same id."""
    if _ID.fullmatch(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    return "".join(_BASE62[number // 62 ** i % 62] for i in range(9))


def template_messages(messages: list[Any], form: str) -> list[dict[str, Any]]:
    """The conversation (core ChatMessages) as a Mistral template in `form` reads it. A tool result
    without a tool_call_id answers the earliest call not answered yet."""
    out: list[dict[str, Any]] = []
    unanswered: list[str] = []
    for n, message in enumerate(messages):
        role, text = ("system" if message.role == "developer" else message.role), message.text()
        if role == "assistant" and message.tool_calls:
            calls = [{"id": short_id(c.get("id") or f"{n}.{k}"), "type": "function",
                      "function": {"name": (c.get("function") or {}).get("name"), "arguments": arguments_of(c)}}
                     for k, c in enumerate(message.tool_calls)]
            unanswered += [c["id"] for c in calls]
            out.append({"role": "assistant", "content": text, "tool_calls": calls})
        elif role == "tool":
            call_id = short_id(message.tool_call_id) if message.tool_call_id else \
                unanswered[0] if unanswered else short_id(str(n))
            if call_id in unanswered:
                unanswered.remove(call_id)
            out.append({"role": "tool", "content": text if form == V11 else _as_json(text), "tool_call_id": call_id})
        else:
            out.append({"role": role, "content": text})
    return out


def _as_json(text: str) -> str:
    try:
        json.loads(text)
        return text
    except ValueError:
        return json.dumps(text, ensure_ascii=False)


def parse(text: str, form: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply, read as the grammar wrote it: one that goes off [TOOL_CALLS]
    is a plain answer (content, as far as it got); else it is calls only, and a reply that is not
    whole calls (cut by max_tokens or a stop string, even within the marker, or malformed) has no
    calls and no content."""
    if not text.startswith(MARKER):
        return (None if MARKER.startswith(text) else text), []  # the marker's start: a call, cut
    calls = _list_calls(text) if form == LIST else _v11_calls(text)
    return None, calls or []


def _list_calls(text: str) -> list[dict[str, Any]] | None:
    try:
        value = json.loads(text[len(MARKER):])
    except ValueError:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(item, dict) for item in value):
        return None
    calls = [_call(item.get("name"), item.get("arguments")) for item in value]
    return None if None in calls else calls


def _v11_calls(text: str) -> list[dict[str, Any]] | None:
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while text[pos:].strip():
        head = V11_HEAD.match(text, pos)
        if head is None:
            return None
        try:
            arguments, pos = decoder.raw_decode(text, head.end())
        except ValueError:
            return None
        calls.append(_call(head[1], arguments))
    return None if None in calls else calls


def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    """A call in OpenAI's form, where the model wrote a name and an object of arguments (or that
    object as a JSON string, as some models do); else None."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return openai_call(name, arguments)


class MistralFormat(ToolFormat):
    """Tools rendered by the chat template itself; calls after [TOOL_CALLS] as a JSON list."""

    name = "mistral"
    form: ClassVar[str] = LIST
    MARKERS = (MARKER, ARGS, CALL_ID)  # special tokens of Mistral's own tokenizers

    @classmethod
    def knows(cls, tokenizer: Tokenizer) -> bool:
        return template_form(tokenizer) == cls.form

    def constraint(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
        return constraint(tools, choice, parallel, self.form, self.special.lit)

    def template_messages(self, messages: list[Any], tools: list[Tool], choice: ToolChoice | None
                          ) -> list[dict[str, Any]]:
        return template_messages(messages, self.form)

    def template_tools(self, tools: list[Tool]) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in tools]

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse(text, self.form)

    def stream(self) -> ToolCallParser:
        return ToolCallParser(MARKER, ToolCallStream())


class MistralV11Format(MistralFormat):
    """The same, each call written [TOOL_CALLS]name[ARGS]{...} (tokenizers v11 and later)."""

    name = "mistral_v11"
    form = V11

    def stream(self) -> ToolCallParser:
        return ToolCallParser(MARKER, ToolCallStream(V11_HEAD, raw_name, anchored=True, strip=False))


FORMAT = register(MistralFormat())
FORMAT_V11 = register(MistralV11Format())
