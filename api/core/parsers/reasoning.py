"""Reasoning kept apart: a model that thinks aloud between `<think>` and `</think>` (DeepSeek-R1,
Qwen3, QwQ) writes its thought first and its answer after. The thought goes out as reasoning
(chat completions' `reasoning_content`), never as content, however the stream splits a tag.

A chat template may open the thought itself (its generation prompt ends with `<think>`): the
reply then starts inside the thought. Each chat's own prompt says so (chat_template_kwargs such
as enable_thinking may close the thought in the prompt instead). Otherwise a reply is a thought
only where it opens with `<think>` (after any blank space); any other reply is all answer. A thought never closed (cut
by max_tokens) is all reasoning, with no answer.

The api chooses a format per served model (`choose`): the one STREAMQ_REASONING_PARSER names, or
under "auto" `think` where the chat template knows `</think>` (it drops earlier thoughts, or
writes them), `harmony` where it writes gpt-oss's Harmony channels (api/core/parsers/harmony.py:
the analysis channel is the thought), else none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from api.core.parsers.base import Delta, OutputParser
from api.core.parsers.harmony import HarmonyFormat, is_harmony

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

OPEN, CLOSE = "<think>", "</think>"
AUTO, NONE = "auto", "none"
NAMES = ("think", "harmony")  # the formats there are


@dataclass(frozen=True)
class ThinkFormat:
    """`<think>…</think>` before the answer; `opened`: the chat template opens it itself."""

    opened: bool = False
    keeps_special_tokens = False  # its tags are read as text (HarmonyFormat's markers may be special tokens)

    @property
    def key(self) -> str:
        """Its name as a stored response keeps it (`named` reads it back)."""
        return "think_opened" if self.opened else "think"

    def stage(self) -> ThinkStage:
        return ThinkStage(self.opened)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply's thought (None where it has none) and its answer."""
        rest = text
        if not self.opened:
            if not text.lstrip().startswith(OPEN):
                return None, text
            rest = text.lstrip()[len(OPEN):]
        elif text.startswith(OPEN):  # the template opened it and the model wrote the tag again
            rest = text[len(OPEN):]
        thought, closed, answer = rest.partition(CLOSE)
        return thought, answer if closed else ""


class ThinkStage(OutputParser):
    """The streaming stage: deltas with `reasoning` while the thought lasts, then content. It keeps
    back only what may be the start of a tag, until the next text says (`flush` gives it at the end)."""

    def __init__(self, opened: bool):
        # "start": not yet known whether the reply opens a thought; "reopen": inside the template's
        # thought, where the model may write the tag again; then "think", then "answer".
        self.state = "reopen" if opened else "start"
        self.pending = ""

    @property
    def holding(self) -> bool:
        return False  # never the whole reply: at most a tag's few characters, until the next text

    def feed(self, delta: Delta) -> list[Delta]:
        if not delta.content:
            return [delta] if delta.call is not None else []
        if self.state == "answer":
            return [delta]
        self.pending += delta.content
        if self.state in ("start", "reopen"):
            head = self.pending.lstrip() if self.state == "start" else self.pending
            if len(head) < len(OPEN) and OPEN.startswith(head):
                return []  # blank space or the start of the tag: not decided yet
            if head.startswith(OPEN):
                self.pending = head[len(OPEN):]
            elif self.state == "start":  # no thought: all of it is the answer
                self.state, text, self.pending = "answer", self.pending, ""
                return [Delta(content=text)]
            self.state = "think"
        return self._think()

    def _think(self) -> list[Delta]:
        thought, closed, answer = self.pending.partition(CLOSE)
        if closed:
            self.state, self.pending = "answer", ""
            return [d for d in (Delta(reasoning=thought), Delta(content=answer)) if d.reasoning or d.content]
        keep = _tag_start(self.pending, CLOSE)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return [Delta(reasoning=out)] if out else []

    def flush(self) -> list[Delta]:
        """What is kept back, at the reply's end: a thought's last characters, or a reply that was
        only blank space or the start of the tag."""
        text, self.pending = self.pending, ""
        if not text:
            return []
        return [Delta(reasoning=text)] if self.state in ("think", "reopen") else [Delta(content=text)]


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def named(key: str | None) -> ThinkFormat | HarmonyFormat | None:
    """The format a format's `key` names; None for none (or a record written before there were any)."""
    return {"think": ThinkFormat(False), "think_opened": ThinkFormat(True), "harmony": HarmonyFormat()}.get(key or NONE)


def check(setting: str) -> None:
    """ValueError naming the known formats where the setting names another (said at start)."""
    for part in setting.split(","):
        name = part.partition("=")[2] if "=" in part else part
        if name.strip() not in (AUTO, NONE, *NAMES):
            raise ValueError(f"no reasoning parser {name.strip()!r}; known: {', '.join([AUTO, NONE, *NAMES])}")


def choose(setting: str, model: str, tokenizer: Tokenizer) -> ThinkFormat | HarmonyFormat | None:
    """The reasoning format of `model`'s replies by the setting (a name, or MODEL=NAME pairs);
    under "auto", `think` where its chat template knows `</think>`, `harmony` where it writes
    Harmony. Whether a reply starts inside a <think> thought is each chat's own prompt's to say
    (Generation.reasoning_of)."""
    name = setting.strip()
    if "=" in name:
        pairs = {m.strip(): n.strip() for m, _, n in (p.partition("=") for p in name.split(",") if p.strip())}
        name = pairs.get(model, AUTO)
    template = tokenizer.chat_template or ""
    if name == "harmony" or (name == AUTO and CLOSE not in template and is_harmony(template)):
        return HarmonyFormat.of(tokenizer)
    if name == NONE or (name == AUTO and CLOSE not in template):
        return None
    return ThinkFormat()
