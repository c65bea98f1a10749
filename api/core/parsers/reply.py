"""One reply's chain of output parsers: its text in, as it streams, deltas out (answer text, tool
call pieces); at its end, the whole text read once (`finish`). The chain is the tool format's
stage where the request calls tools; a reasoning stage goes before it where a model thinks
aloud. Chat completions, Responses and Messages read every reply through this class."""
from __future__ import annotations

from api.core.parsers.base import Delta, OutputParser, Reply, ToolFormat


class ReplyParser:
    def __init__(self, tool_format: ToolFormat | None):
        """`tool_format`: the reply's, where it calls tools; None for a reply read as plain text."""
        self.tool_format = tool_format
        self.stages: list[OutputParser] = [tool_format.stream()] if tool_format is not None else []
        self.pieces: list[str] = []
        self.calls = 0  # tool calls streamed so far

    def feed(self, text: str) -> list[Delta]:
        """The deltas the reply's next text gives (none while a stage holds it)."""
        self.pieces.append(text)
        deltas = [Delta(content=text)]
        for stage in self.stages:
            deltas = [out for delta in deltas for out in stage.feed(delta)]
        self.calls += sum(1 for d in deltas if d.call is not None and d.call.name is not None)
        return deltas

    @property
    def holding(self) -> bool:
        """Whether text is held back, to be read whole at the end."""
        return any(stage.holding for stage in self.stages)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def finish(self, finish_reason: str) -> Reply:
        """The whole reply read: its answer or its calls, and the finish reason to report."""
        return read_whole(self.tool_format, self.text, finish_reason)


def read_whole(tool_format: ToolFormat | None, text: str, finish_reason: str) -> Reply:
    """A whole reply read in its tool format; without one, its text as it stands."""
    if tool_format is None:
        return Reply(text, [], finish_reason)
    return tool_format.reply(text, finish_reason)
