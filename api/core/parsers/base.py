"""The output-parser seam: what a parser takes and gives, and the interface of a tool format.

A reply's generated text passes through a chain of output parsers (api/core/parsers/reply.py):
each takes deltas in and gives deltas out while the reply streams, and the chain reads the
whole text once at the end. Chat completions, Responses and Messages all read replies through
it, so a format (reasoning, tool calls) is written once, in one module, for every protocol.
"""
from __future__ import annotations

import copy
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from api.core.tools import Tool, ToolChoice
    from shared.structured import StructuredOutputs
    from shared.tokenizer import Tokenizer

Parse = Callable[[str], tuple[str | None, list[dict[str, Any]]]]


@dataclass(frozen=True)
class CallDelta:
    """New text of call `index`: its id and name on its first delta, then argument characters."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None
    closed: bool = False  # the arguments' object is whole with this delta


@dataclass(frozen=True)
class Delta:
    """A piece of a reply as a parser gives it: answer text, a piece of a tool call, or of the
    model's thought (api/core/parsers/reasoning.py)."""

    content: str = ""
    call: CallDelta | None = None
    reasoning: str = ""


@dataclass(frozen=True)
class Reply:
    """A reply read in its tool format: the answer or the calls, and the finish reason to report."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    reasoning: str | None = None  # the model's thought, where its reasoning format found one


def read_reply(text: str, finish_reason: str, parse: Parse) -> Reply:
    """A reply's content, tool calls and finish reason, by its format's `parse`. Calls count only
    in a reply that ended on its own (finish reason stop, then reported as tool_calls): one cut by
    max_tokens is finish reason length with no calls, even where the calls so far are whole, and a
    cut call is never content (that is the answer so far, or None)."""
    content, calls = parse(text)
    if calls and finish_reason == "stop":
        return Reply(None, calls, "tool_calls")
    return Reply(content, [], finish_reason)


class OutputParser(ABC):
    """One stage of a reply's chain, made for one reply: deltas in, deltas out as it streams."""

    @abstractmethod
    def feed(self, delta: Delta) -> list[Delta]:
        """What this stage gives for the next delta (nothing while it holds the text)."""

    @property
    @abstractmethod
    def holding(self) -> bool:
        """Whether it holds the reply's text back, to be read whole at the end."""


def literal(text: str) -> str:
    """`text` as a Lark string literal (every marker in it spelled as text)."""
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True)
class Markers:
    """Which of a format's markers are special tokens of the served model's tokenizer (text: id).
    Such a marker is one token the model writes (Mistral's [TOOL_CALLS], Llama's <|python_tag|>,
    Harmony's <|channel|>): a grammar names it by its id, and the reply is decoded with the
    special tokens kept, so that its text carries the marker. With a tokenizer that spells the
    markers as text, none are."""

    ids: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, markers: Iterable[str], tokenizer: Tokenizer) -> Markers:
        return cls({m: tokenizer.special_tokens[m] for m in markers if m in tokenizer.special_tokens})

    def lit(self, text: str) -> str:
        """`text` as a Lark sequence: its markers that are special tokens by id (`<[id]>`, llguidance's
        token syntax; a quoted string never matches a special token), the rest as quoted strings."""
        if not self.ids or not text:
            return literal(text)
        parts, at = [], 0
        for found in re.finditer("|".join(re.escape(m) for m in sorted(self.ids, key=len, reverse=True)), text):
            if found.start() > at:
                parts.append(literal(text[at:found.start()]))
            parts.append(f"<[{self.ids[found.group()]}]>")
            at = found.end()
        if at < len(text):
            parts.append(literal(text[at:]))
        return parts[0] if len(parts) == 1 else "(" + " ".join(parts) + ")"


class ToolFormat(ABC):
    """How one model asks for and writes tool calls: the prompt's side (the tools and earlier
    calls as its chat template reads them, the reply's constraint) and the reply's (its parser).
    Registered by `name` (api/core/parsers/registry.py); `for_tokenizer` gives it for one model."""

    name: ClassVar[str]
    MARKERS: ClassVar[tuple[str, ...]] = ()  # the texts that mark its calls (special tokens in some tokenizers)
    special: Markers = Markers()

    def for_tokenizer(self, tokenizer: Tokenizer) -> ToolFormat:
        """This format for a model whose tokenizer is `tokenizer`: its markers that are special
        tokens there written by id in grammars, and kept in the reply's text."""
        special = Markers.of(self.MARKERS, tokenizer)
        if not special.ids:
            return self
        out = copy.copy(self)
        out.special = special
        return out

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether a reply must be decoded with its special tokens kept (its markers are some)."""
        return bool(self.special.ids)

    @classmethod
    def knows(cls, tokenizer: Tokenizer) -> bool:
        """Whether the model's chat template certainly asks for this format (auto-detection)."""
        return False

    @abstractmethod
    def constraint(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
        """The reply's constraint: calls of `tools` (under "auto", or a plain answer)."""

    @abstractmethod
    def template_messages(self, messages: list[Any], tools: list[Tool], choice: ToolChoice | None
                          ) -> list[dict[str, Any]]:
        """The conversation (core ChatMessages) as the chat template reads it in this format."""

    def template_tools(self, tools: list[Tool]) -> list[dict[str, Any]] | None:
        """The tools the chat template renders itself, or None where the format describes them."""
        return None

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a whole reply."""

    @abstractmethod
    def stream(self) -> OutputParser:
        """A streaming parser for one reply."""

    def bind(self, tools: list[Tool]) -> ToolFormat:
        """This format for one request's tools, for a format whose reading of a reply needs them
        (the Qwen3-Coder one types parameter values by their schemas); by default itself."""
        return self

    def reply(self, text: str, finish_reason: str) -> Reply:
        return read_reply(text, finish_reason, self.parse)
