"""The streaming stage of the Mistral tool formats (api/core/parsers/mistral.py): calls stream as
they are written, an answer as it comes.

A reply that opens with `[TOOL_CALLS]` is calls (the grammar allows nothing else there); any other
is a plain answer. The marker is a dozen characters, which a tokenizer without it as one token
writes in pieces, so the reply is held only while what came is still the marker's start; the
first character off it makes the reply an answer, and what was held goes out at once.
In the JSON-list form the calls are `{"name": ..., "arguments": ...}` objects, which ToolCallStream
reads; in the v11 form each is `[TOOL_CALLS]name[ARGS]{...}`, read here (`V11CallStream`).
"""
from __future__ import annotations

import re
import uuid
from typing import Protocol

from api.core.parsers.base import CallDelta, Delta, OutputParser
from api.core.parsers.tool_stream import ObjectEnd

MARKER = "[TOOL_CALLS]"
# A v11 call's head, whole: the name (OpenAI's names are [A-Za-z0-9_-]), a call id where the model
# writes one (v13 templates render [CALL_ID] in earlier turns), then its arguments' object opens.
V11_HEAD = re.compile(r"\s*\[TOOL_CALLS\]([A-Za-z0-9_-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")


class CallStream(Protocol):
    def feed(self, text: str) -> list[CallDelta]: ...


class MistralCallParser(OutputParser):
    """A reply's stage: `calls` reads the reply from its first character once it opens with the marker."""

    def __init__(self, calls: CallStream):
        self.calls = calls
        self.answering: bool | None = None  # None while the text so far is the marker's start
        self.text = ""

    @property
    def holding(self) -> bool:
        return not self.answering

    def feed(self, delta: Delta) -> list[Delta]:
        if self.answering:
            return [delta]
        if not delta.content:
            return []
        self.text += delta.content
        if self.answering is None:
            if MARKER.startswith(self.text):
                return []  # the marker so far, or all of it: which the reply is, the next text says
            self.answering = not self.text.startswith(MARKER)
            if self.answering:
                return [Delta(content=self.text)]
            return [Delta(call=call) for call in self.calls.feed(self.text)]
        return [Delta(call=call) for call in self.calls.feed(delta.content)]


class V11CallStream:
    """`[TOOL_CALLS]name[ARGS]{...}` calls, one after another: each call's name once its head is
    whole, then its arguments' characters as they come, to where their object closes (strings and
    escapes minded). What is sent is the model's own text and is never taken back; a reply cut in
    the arguments ends with its call unclosed."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # where the scan goes on
        self.calls = 0  # calls started
        self.object: ObjectEnd | None = None  # the open call's arguments, while they are open

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        out: list[CallDelta] = []
        while True:
            if self.object is None:
                head = V11_HEAD.match(self.text, self.pos)
                if head is None:
                    return out  # not whole yet (or not a call: the whole reply's parse says so)
                out.append(CallDelta(self.calls, "", f"call_{uuid.uuid4().hex[:24]}", head[1]))
                self.calls, self.pos, self.object = self.calls + 1, head.end(), ObjectEnd()
            end = self.object.scan(self.text, self.pos)
            piece = self.text[self.pos:end if end is not None else len(self.text)]
            self.pos += len(piece)
            if piece or end is not None:
                out.append(CallDelta(self.calls - 1, piece, closed=end is not None))
            if end is None:
                return out
            self.object = None
