"""Tool calls read as the model writes them, for streaming: each call's name once it is whole, then
its arguments' new characters as they come.

Both tool formats write each call as `{"name": "<name>", "arguments": <a JSON object>}` (the
generic one inside {"tool_calls": [...]}, the Hermes one inside <tool_call> blocks), in that key
order, under a grammar. So a call starts where that opening matches (never inside a JSON string,
whose quotes are escaped) and its arguments end where their brackets close, strings and escapes
minded, whatever the chunks the text comes in. What is sent is never taken back: the arguments'
characters are the model's own, so once the object closes they are its JSON text exactly; a reply
cut by max_tokens ends with its last call unclosed (finish reason `length`), as OpenAI's does.
"""
from __future__ import annotations

import json
import re
import uuid

from api.core.parsers.base import CallDelta

_CALL = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class ToolCallStream:
    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # where the scan goes on
        self.calls = 0  # calls started
        self.open = False  # inside a call's arguments
        self.value: ObjectEnd | None = None  # the open call's arguments
        self.started = False

    def feed(self, text: str) -> list[CallDelta]:
        """The deltas that `text`, the reply's next characters, completes."""
        self.text += text
        out: list[CallDelta] = []
        while True:
            if not self.open:
                found = _CALL.search(self.text, self.pos)
                if found is None:
                    return out
                self.open, self.pos = True, found.end()
                self.value, self.started = ObjectEnd(), False
                out.append(CallDelta(self.calls, "", f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{found[1]}"')))
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
            self.open = False


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
