"""The streaming stage of a tool format: a tool reply's text is held, to be read whole at the end
(ToolFormat.parse), while its calls stream as they are written (api/core/parsers/tool_stream.py).
In a format whose calls open with known text (`call_opens`: a character, or a marker such as
Mistral's [TOOL_CALLS]), a reply that opens with anything else is a plain answer (the format's
grammar allows no other), so it streams from there on; the reply's first characters decide, once,
as soon as they can no longer be the start of an opening."""
from __future__ import annotations

from api.core.parsers.base import Delta, OutputParser
from api.core.parsers.tool_stream import ToolCallStream


class ToolCallParser(OutputParser):
    def __init__(self, call_opens: str | tuple[str, ...] | None, calls: ToolCallStream | None = None):
        """`call_opens`: what a call reply opens with (None: every reply is calls, held to its end);
        `calls`: the format's reading of its calls (by default {"name", "arguments"} JSON)."""
        self.call_opens = (call_opens,) if isinstance(call_opens, str) else call_opens
        self.answering: bool | None = None if call_opens else False  # None until the first characters decide
        self.text = ""
        self.calls = calls or ToolCallStream()

    @property
    def holding(self) -> bool:
        return not self.answering

    def feed(self, delta: Delta) -> list[Delta]:
        if not self.holding:
            return [delta]
        if not delta.content:
            return []
        self.text += delta.content
        if self.answering is None:
            if any(opening.startswith(self.text) for opening in self.call_opens):
                return []  # an opening so far, or all of it: the next text decides
            self.answering = not self.text.startswith(self.call_opens)
            if self.answering:  # what was held goes out at once
                return [Delta(content=self.text)]
            return [Delta(call=call) for call in self.calls.feed(self.text)]
        return [Delta(call=call) for call in self.calls.feed(delta.content)]
