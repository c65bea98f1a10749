"""Harmony's messages read as gpt-oss writes them, whatever the pieces its text comes in
(api/core/parsers/harmony.py reads its thought and its tool calls out of them).

A reply is one or more messages. The first one's `<|start|>assistant` is the prompt's (the chat
template's generation prompt), so the reply opens with the rest of its header; each later one
opens with `<|start|>assistant`. A header names the channel (analysis, commentary, final), and may
name a recipient (`to=functions.NAME`, before or after the channel) and the content type (` json`
or `<|constrain|>json`); `<|message|>` ends it. The body runs to `<|end|>`, `<|call|>` (a tool
call's end) or `<|return|>` (the reply's), or to the text's end (a stop token the decoding dropped,
or max_tokens). A reply that does not open like a header is not Harmony: all of it is plain text.

The reader never gives a piece of a marker as body text: it keeps back what may be a marker's
start until the next text says (`flush` gives it at the end), as the <think> stage keeps back a tag.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)  # special tokens of gpt-oss's tokenizer
OPENS = (CHANNEL, START, " to=")  # how a header may open: the reply's first one has no <|start|>
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>([^\s<]+)")
_TYPE = re.compile(r"<\|constrain\|>\s*([^\s<]+)|<\|channel\|>[^\s<]+\s+(?!to=)([^\s<]+)")


@dataclass(frozen=True)
class Header:
    """A message's header: its channel, recipient and content type where it names them, and its
    text as written (through <|message|>; empty for plain text, which has no header)."""

    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    text: str = ""

    @property
    def function(self) -> str | None:
        """The function it calls, for a message to `functions.NAME`."""
        if self.recipient is not None and self.recipient.startswith("functions."):
            return self.recipient.removeprefix("functions.")
        return None


def header(text: str) -> Header:
    """A header read from its text (from its <|start|> or its reply's start, through <|message|>)."""
    recipient, channel, content_type = _RECIPIENT.search(text), _CHANNEL.search(text), _TYPE.search(text)
    return Header(channel[1] if channel else None, recipient[1] if recipient else None,
                  next((g for g in content_type.groups() if g), None) if content_type else None, text)


@dataclass(frozen=True)
class Event:
    """What the reader gives: a message's `header` once it is whole, then its `body` text in
    pieces, then its `end` (the marker that ends it; empty where the next <|start|> does)."""

    kind: str  # "header", "body" or "end"
    text: str = ""
    header: Header | None = None


class MessageReader:
    def __init__(self) -> None:
        # "open": where a message may begin (the reply's start, or after a message's end); "header",
        # "body"; "plain": a reply (or what follows a message) that is not Harmony, read as text
        self.state = "open"
        self.pending = ""
        self.cut = False  # the text ended inside a header (`flush` says)

    def feed(self, text: str) -> list[Event]:
        """The events that `text`, the reply's next characters, completes."""
        self.pending += text
        out: list[Event] = []
        while self.pending:
            if self.state == "open":
                if any(o.startswith(self.pending) for o in OPENS if len(self.pending) < len(o)):
                    break  # perhaps a header's opening: not decided yet
                if self.pending.startswith(OPENS):
                    self.state = "header"
                else:
                    self.state = "plain"
                    out.append(Event("header", header=Header()))
            elif self.state == "header":
                at = self.pending.find(MESSAGE)
                if at < 0:
                    break
                text, self.pending = self.pending[:at + len(MESSAGE)], self.pending[at + len(MESSAGE):]
                out.append(Event("header", header=header(text)))
                self.state = "body"
            elif self.state == "body":
                out += self._body()
                if self.state == "body":
                    break
            else:
                out.append(Event("body", self.pending))
                self.pending = ""
        return out

    def _body(self) -> list[Event]:
        found = [(at, marker) for marker in (*ENDS, START) if (at := self.pending.find(marker)) >= 0]
        if not found:
            keep = _marker_start(self.pending)
            text, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
            return [Event("body", text)] if text else []
        at, marker = min(found)
        text = self.pending[:at]
        ended = marker if marker != START else ""  # a <|start|> with no end before it: the next message
        self.pending = self.pending[at + len(ended):]
        self.state = "open"
        return [*([Event("body", text)] if text else []), Event("end", ended)]

    def flush(self) -> list[Event]:
        """What is kept back, at the reply's end: a body's last characters, or a reply (or the text
        after a message) that was only the start of a header's opening. A cut header gives nothing."""
        text, self.pending = self.pending, ""
        self.cut = self.state == "header" and bool(text)
        if not text or self.state == "header":
            return []
        if self.state == "open":
            self.state = "plain"
            return [Event("header", header=Header()), Event("body", text)]
        return [Event("body", text)]


def _marker_start(text: str) -> int:
    """The length of the longest end of `text` that may be the start of an end marker or <|start|>."""
    for n in range(min(len(text), max(map(len, (*ENDS, START))) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in (*ENDS, START)):
            return n
    return 0


def messages(text: str) -> tuple[list[tuple[Header, str, str | None]], bool]:
    """A whole reply's messages: (header, body, the marker that ended it, or None where the text ended
    first); and whether the text ended inside a header (that message is not there)."""
    reader, out = MessageReader(), []
    for event in reader.feed(text) + reader.flush():
        if event.kind == "header":
            out.append([event.header, "", None])
        elif event.kind == "body":
            out[-1][1] += event.text
        else:
            out[-1][2] = event.text
    return [(h, body, end) for h, body, end in out], reader.cut
