"""The streaming stage of a tool format: a tool reply's text is held, to be read whole at the end
(ToolFormat.parse), while its calls stream as they are written (api/core/parsers/tool_stream.py).
In a format whose calls open with a known character (`call_opens`), a reply that opens with any
other is a plain answer (the format's grammar allows no other), so it streams from there on; its
first character decides, once."""
from __future__ import annotations

from api.core.parsers.base import Delta, OutputParser
from api.core.parsers.tool_stream import ToolCallStream


class ToolCallParser(OutputParser):
    def __init__(self, call_opens: str | None):
        self.call_opens = call_opens
        self.answering: bool | None = None if call_opens else False  # None until the first character
        self.text = ""
        self.calls = ToolCallStream()

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
            self.answering = not self.text.startswith(self.call_opens)
            if self.answering:  # what was held goes out at once
                return [Delta(content=self.text)]
        return [Delta(call=call) for call in self.calls.feed(delta.content)]
