"""A Qwen3-Coder reply read back, whole (`parse`) or as it streams (`CallStream`): its calls are
  <tool_call>
  <function=NAME>
  <parameter=KEY>
  VALUE
  </parameter>
  </function>
  </tool_call>
one block per call, each value plain text between a newline after its opening tag and one before
its closing tag. A value is typed by its parameter's schema (`Kinds`): a string parameter's is the
text itself, any other's is JSON (a number, true, an object...). One scanner reads both ways, so a
stream's calls are the whole reply's: each call's arguments stream as the JSON text of the
arguments object, a parameter at a time as each closes, and add up to `json.dumps` of it.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from api.core.parsers.base import CallDelta, Delta, OutputParser
from api.core.tools import openai_call

TEXT, JSON = "text", "json"  # how a parameter's value is written: as it is, or as JSON
# A function's parameters and the kind of each, by the function's name (None: a function not known)
Kinds = Callable[[str], dict[str, str] | None]
Event = tuple[str, ...]  # ("open", name) | ("param", key, value as JSON text) | ("close",)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"([^<>\n]+)>")
_SPACE = re.compile(r"\s*")


def value_of(raw: str, kind: str | None) -> Any:
    """A parameter's value from its text as written (one newline either side is the layout's).
    ValueError where a JSON parameter's text is not JSON; a parameter of no known kind is JSON
    where it reads as such, else text."""
    raw = raw.removeprefix("\n").removesuffix("\n")
    if kind == TEXT:
        return raw
    if kind == JSON:
        return json.loads(raw)
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class Scanner:
    """The events of a reply's call blocks, as its text comes in pieces. Once the text strays
    from the layout it is `broken` and gives nothing more (a reply is never raised over)."""

    def __init__(self, kinds: Kinds):
        self.kinds = kinds
        self.text, self.pos = "", 0
        self.state = "between"  # between calls | call | function | param | after (the function's end)
        self.params: dict[str, str] | None = None  # the open function's parameter kinds
        self.seen: set[str] = set()  # the open function's parameters written so far
        self.key, self.search = "", 0  # the open parameter, and where its closing tag is looked for
        self.calls, self.broken = 0, False

    @property
    def whole(self) -> bool:
        """Whether the text so far is whole calls, at least one."""
        return self.calls > 0 and self.state == "between" and not self.broken and not self.text[self.pos:].strip()

    def feed(self, text: str) -> list[Event]:
        self.text += text
        out: list[Event] = []
        while not self.broken:
            event = self._step()
            if event is None:
                return out
            if event:
                out.append(event)
        return out

    def _step(self) -> Event | tuple[()] | None:
        """The next event; () where a step gave none; None where the text needs more, or strayed."""
        if self.state == "param":  # its text is not copied at each piece: a value may be long
            return self._value()
        self.pos = _SPACE.match(self.text, self.pos).end()
        rest = self.text[self.pos:]
        if self.state == "between":
            return self._tag(rest, OPEN, "call")
        if self.state == "call":
            name = self._named(rest, FUNCTION)
            if name is None:
                return None
            self.params, self.seen, self.state = self.kinds(name), set(), "function"
            return ("open", name)
        if self.state == "function":
            if rest.startswith(FUNCTION_END[:len(rest)]) and not rest.startswith(PARAMETER[:len(rest)]):
                return None if self._tag(rest, FUNCTION_END, "after") is None else ("close",)
            key = self._named(rest, PARAMETER)
            if key is None:
                return None
            if key in self.seen:
                return self._break()
            self.seen.add(key)
            self.key, self.search, self.state = key, self.pos, "param"
            return ()
        self.calls += rest.startswith(CLOSE)  # after a function's end: its block's
        return self._tag(rest, CLOSE, "between")

    def _tag(self, rest: str, tag: str, then: str) -> tuple[()] | None:
        if rest.startswith(tag):
            self.pos += len(tag)
            self.state = then
            return ()
        return None if tag.startswith(rest) else self._break()

    def _named(self, rest: str, tag: str) -> str | None:
        """The name in `<tag=NAME>` at the text's position, consumed."""
        if not rest.startswith(tag):
            return None if tag.startswith(rest) else self._break()
        found = _NAME.match(rest, len(tag))
        if found is None:
            return None if re.fullmatch(r"[^<>\n]*", rest[len(tag):]) else self._break()
        self.pos += found.end()
        return found[1]

    def _value(self) -> Event | None:
        """The open parameter's value, once its closing tag is in: the first one after which a JSON
        parameter's text reads as JSON (a JSON string may hold the tag)."""
        kind = (self.params or {}).get(self.key)
        while (end := self.text.find(PARAMETER_END, self.search)) >= 0:
            self.search = end + 1
            try:
                value = value_of(self.text[self.pos:end], kind)
            except ValueError:
                continue
            self.pos, self.state = end + len(PARAMETER_END), "function"
            return ("param", self.key, json.dumps(value, ensure_ascii=False))
        self.search = max(self.search, len(self.text) - len(PARAMETER_END) + 1)  # a tag cut in two
        return None

    def _break(self) -> None:
        self.broken = True
        return None


def parse(text: str, kinds: Kinds) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole reply, as the grammar wrote it: one that does not open with
    "<" is a plain answer; else it is call blocks only, and one that is not whole blocks (cut by
    max_tokens or a stop string, or malformed) has no calls and no content."""
    if not text.startswith("<"):
        return text or None, []
    scanner = Scanner(kinds)
    calls: list[tuple[str, dict[str, Any]]] = []
    for event in scanner.feed(text):
        if event[0] == "open":
            calls.append((event[1], {}))
        elif event[0] == "param":
            calls[-1][1][event[1]] = json.loads(event[2])
    if not scanner.whole:
        return None, []
    return None, [openai_call(name, arguments) for name, arguments in calls]


class CallStream(OutputParser):
    """A reply's calls as they are written: each call's name once its opening tag is whole, then
    its arguments' JSON text as each parameter closes. A reply that opens with anything but "<" is
    a plain answer (the grammar allows no other), streamed from its first character."""

    def __init__(self, kinds: Kinds):
        self.scanner = Scanner(kinds)
        self.answering: bool | None = None  # None until the first character
        self.index, self.first = -1, True  # the open call, and whether none of its parameters came yet

    @property
    def holding(self) -> bool:
        return not self.answering

    def feed(self, delta: Delta) -> list[Delta]:
        if not self.holding:
            return [delta]
        if not delta.content:
            return []
        if self.answering is None:
            self.answering = not delta.content.startswith("<")
            if self.answering:
                return [delta]
        return [Delta(call=self._call(event)) for event in self.scanner.feed(delta.content)]

    def _call(self, event: Event) -> CallDelta:
        if event[0] == "open":
            self.index, self.first = self.index + 1, True
            return CallDelta(self.index, "", f"call_{uuid.uuid4().hex[:24]}", event[1])
        if event[0] == "param":
            piece = f"{'{' if self.first else ', '}{json.dumps(event[1], ensure_ascii=False)}: {event[2]}"
            self.first = False
            return CallDelta(self.index, piece)
        return CallDelta(self.index, "{}" if self.first else "}", closed=True)
