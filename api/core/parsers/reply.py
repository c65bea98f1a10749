"""One reply's chain of output parsers: its text in, as it streams, deltas out (answer text, tool
call pieces, thought); at its end, the whole text read once (`finish`). The chain is the tool
format's stage where the request calls tools; a reasoning stage goes before it where a model
thinks aloud (its thought passes the tool stage by). Chat completions, Responses and Messages
read every reply through this class."""
from __future__ import annotations

from dataclasses import replace

from api.core.parsers.base import Delta, OutputParser, Reply, ToolFormat
from api.core.parsers.reasoning import ThinkFormat, ThinkStage


class ReplyParser:
    def __init__(self, tool_format: ToolFormat | None, reasoning: ThinkFormat | None = None):
        """`tool_format`: the reply's, where it calls tools; None for a reply read as plain text.
        `reasoning`: the model's reasoning format, whose thought goes out apart, before the rest."""
        self.tool_format = tool_format
        self.reasoning = reasoning
        self.thought: ThinkStage | None = reasoning.stage() if reasoning is not None else None
        self.stages: list[OutputParser] = [tool_format.stream()] if tool_format is not None else []
        self.pieces: list[str] = []
        self.calls = 0  # tool calls streamed so far
        # Of the texts fed (a token's each), those of the thought: after which it still lasts, or
        # that give its last piece
        self.thought_tokens = 0

    def feed(self, text: str) -> list[Delta]:
        """The deltas the reply's next text gives (none while a stage holds it)."""
        self.pieces.append(text)
        first = [Delta(content=text)]
        if self.thought is not None:
            first = self.thought.feed(first[0])
            self.thought_tokens += self.thought.state in ("think", "reopen") or any(d.reasoning for d in first)
        return self._after_thought(first)

    def flush(self) -> list[Delta]:
        """At the reply's end, what the reasoning stage kept back (the start of a tag, perhaps)."""
        return self._after_thought(self.thought.flush()) if self.thought is not None else []

    def _after_thought(self, deltas: list[Delta]) -> list[Delta]:
        out = []
        for delta in deltas:
            if delta.reasoning:  # the thought passes the later stages by
                out.append(delta)
                continue
            pieces = [delta]
            for stage in self.stages:
                pieces = [piece for d in pieces for piece in stage.feed(d)]
            self.calls += sum(1 for d in pieces if d.call is not None and d.call.name is not None)
            out += pieces
        return out

    @property
    def holding(self) -> bool:
        """Whether text is held back, to be read whole at the end."""
        return any(stage.holding for stage in self.stages)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def finish(self, finish_reason: str) -> Reply:
        """The whole reply read: its thought, its answer or its calls, and the finish reason to report."""
        return read_whole(self.tool_format, self.text, finish_reason, self.reasoning)


def read_whole(tool_format: ToolFormat | None, text: str, finish_reason: str,
               reasoning: ThinkFormat | None = None) -> Reply:
    """A whole reply read: its thought apart (in its reasoning format), the rest in its tool
    format; without one, that text as it stands."""
    thought = None
    if reasoning is not None:
        thought, text = reasoning.split(text)
    if tool_format is None:
        reply = Reply(text, [], finish_reason)
    else:
        reply = tool_format.reply(text, finish_reason)
    if thought is None:
        return reply
    return replace(reply, reasoning=thought, content=reply.content or None)
