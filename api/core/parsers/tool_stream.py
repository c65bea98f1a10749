"""Tool calls read as the model writes them, for streaming: each call's name once it is whole, then
its arguments' new characters as they come.

A format's call opens with a head its pattern matches (`opening`, the name in its first group),
and its arguments are a JSON value right after it. The Hermes and generic formats write each call
as `{"name": "<name>", "arguments": <a JSON object>}` (the default pattern: the generic one inside
{"tool_calls": [...]}, the Hermes one inside <tool_call> blocks), in that key order, under a
grammar; Llama 3, DeepSeek and Mistral's v11 give patterns of their own. So a call starts where its
head matches (never inside a JSON string, whose quotes are escaped) and its arguments end where
their brackets close, strings and escapes minded, whatever the chunks the text comes in. What is
sent is never taken back: the arguments' characters are the model's own, so once the object
closes they are its JSON text exactly; a reply cut by max_tokens ends with its last call unclosed
(finish reason `length`), as OpenAI's does.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable

from api.core.parsers.base import CallDelta

_CALL = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def json_name(head: re.Match) -> str:
    """A head's name written as the inside of a JSON string (its escapes read)."""
    return json.loads(f'"{head[1]}"')


def raw_name(head: re.Match) -> str:
    """A head's name as it stands (a format whose names carry no escapes)."""
    return head[1]


class ToolCallStream:
    def __init__(self, opening: re.Pattern = _CALL, name: Callable[[re.Match], str] = json_name,
                 anchored: bool = False, strip: bool = True) -> None:
        """`anchored`: the next head must start where the last call ended (else it is searched
        for); `strip`: spacing before the arguments' value is left out of its first piece."""
        self.opening, self.name, self.anchored, self.strip = opening, name, anchored, strip
        self.text = ""
        self.pos = 0  # where the scan goes on
        self.calls = 0  # calls started
        self.value: ObjectEnd | None = None  # the open call's arguments, while they are open
        self.started = False

    def feed(self, text: str) -> list[CallDelta]:
        """The deltas that `text`, the reply's next characters, completes."""
        self.text += text
        out: list[CallDelta] = []
        while True:
            if self.value is None:
                head = (self.opening.match if self.anchored else self.opening.search)(self.text, self.pos)
                if head is None:
                    return out
                self.pos, self.value, self.started = head.end(), ObjectEnd(), not self.strip
                out.append(CallDelta(self.calls, "", f"call_{uuid.uuid4().hex[:24]}", self.name(head)))
                self.calls += 1
            start, end = self.pos, self.value.scan(self.text, self.pos)
            piece = self.text[start:end if end is not None else len(self.text)]
            self.pos = end if end is not None else len(self.text)
            if not self.started:  # the value opens past any spacing the pattern could not see yet
                piece = piece.lstrip()
                self.started = bool(piece)
            if piece or end is not None:
                out.append(CallDelta(self.calls - 1, piece, closed=end is not None))
            if end is None:
                return out
            self.value = None


class ObjectEnd:
    """Where a JSON value that opens with a bracket closes, read in pieces: brackets counted,
    strings and their escapes minded (every tool format's streaming stage reads arguments so)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def scan(self, text: str, start: int) -> int | None:
        """Past the value's last character, or None where `text` ends before it (read on from there)."""
        for i in range(start, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None
