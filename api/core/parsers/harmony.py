"""gpt-oss's Harmony format (OpenAI's harmony response format): its thought, kept apart from the
answer, and its tool calls (api/core/parsers/harmony_stream.py reads the messages).

A reply, after the chat template's generation prompt `<|start|>assistant`, is messages:
  <|channel|>analysis<|message|>…thought…<|end|><|start|>assistant<|channel|>final<|message|>…answer…<|return|>
or, for a tool call, one to a function on the commentary channel with its JSON arguments:
  <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
(the recipient may come before the channel: `<|start|>assistant to=functions.get_weather<|channel|>commentary json`).

The reasoning format (`HarmonyFormat`, STREAMQ_REASONING_PARSER=harmony, or auto for a Harmony
template) gives the analysis channel as reasoning and the final channel (and a commentary
message to no one: a preamble) as content; a message to a recipient passes on as written, for
the tool format. The tool format (`harmony`, auto-detected from the template) renders the tools
and earlier calls through the template and constrains the reply by a Lark grammar (llguidance's):
an optional analysis thought (free text without "<|"), then calls, each a commentary message to
`functions.NAME` whose JSON keeps the function's closed schema, ended by <|call|> (several, each
after <|start|>assistant, where parallel_tool_calls allows), or under `auto` a final message whose
answer opens with neither "<" nor blank space.

Harmony's markers are special tokens of gpt-oss's own tokenizer (o200k_harmony): there the grammar
names them by id and every reply is decoded with them kept (base.Markers), so its text carries
them. A marker that is also a stop token (<|call|>, <|return|>) ends the reply and is not in its
text: the message reader takes the text's end as the message's.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from api.core.parsers.base import CallDelta, Delta, Markers, OutputParser, ToolFormat, literal
from api.core.parsers.harmony_stream import CALL, CHANNEL, END, MARKERS, MESSAGE, START, Event, MessageReader, messages
from api.core.parsers.registry import register
from api.core.parsers.tool_stream import ObjectEnd
from api.core.tools import Tool, ToolChoice, arguments_of, call_schemas, openai_call, parallel_calls
from shared.structured import JSON_LAYOUT, StructuredOutputs

if TYPE_CHECKING:
    from shared.tokenizer import Tokenizer

THOUGHTS_JOINED = "\n"  # between a reply's analysis messages, where it writes several
_PROBE = {"type": "function", "function": {"name": "streamq_probe_tool", "description": "A probe.",
                                           "parameters": {"type": "object", "properties": {}}}}


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes Harmony: assistant turns on channels, analysis among them."""
    return bool(template) and f"{CHANNEL}analysis{MESSAGE}" in template and f"{START}assistant" in template


@dataclass(frozen=True)
class HarmonyFormat:
    """The reasoning format of a Harmony reply: its analysis channel is the thought. The model
    opens each message itself, so the template never opens the thought (`opened`)."""

    opened: bool = False
    keeps_special_tokens: bool = False  # its markers are special tokens of the model (base.Markers)
    key = "harmony"  # its name as a stored response keeps it (reasoning.named)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> HarmonyFormat:
        """The format for a model whose tokenizer is `tokenizer` (gpt-oss's own has the markers as special tokens)."""
        return cls(keeps_special_tokens=bool(Markers.of(MARKERS, tokenizer).ids))

    def stage(self) -> HarmonyStage:
        return HarmonyStage()

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply's thought (None where it has no analysis message) and the rest."""
        stage = HarmonyStage()
        deltas = stage.feed(Delta(content=text)) + stage.flush()
        thought = "".join(d.reasoning for d in deltas) if stage.thoughts else None
        return thought, "".join(d.content for d in deltas)


class HarmonyStage(OutputParser):
    """The streaming reasoning stage: an analysis message's body goes out as reasoning, a final
    (or preamble) message's body as content, a message to a recipient as written (content, for
    the tool format's stage); a reply that is not Harmony is all content. It keeps back only what
    may be a marker's start, and a header until it is whole."""

    def __init__(self) -> None:
        self.reader = MessageReader()
        self.state = "start"  # "think" inside an analysis message; "answer", "call"; "between" messages
        self.thoughts = 0  # analysis messages begun

    @property
    def holding(self) -> bool:
        return False

    def feed(self, delta: Delta) -> list[Delta]:
        if not delta.content:
            return [delta] if delta.call is not None else []
        return self._read(self.reader.feed(delta.content))

    def flush(self) -> list[Delta]:
        """What the reader kept back, at the reply's end."""
        return self._read(self.reader.flush())

    def _read(self, events: list[Event]) -> list[Delta]:
        out = []
        for event in events:
            if event.kind == "header":
                head = event.header
                if head.recipient is not None:
                    self.state = "call"
                    out.append(Delta(content=head.text))
                elif head.channel == "analysis":
                    self.state = "think"
                    if self.thoughts:
                        out.append(Delta(reasoning=THOUGHTS_JOINED))
                    self.thoughts += 1
                else:
                    self.state = "answer"
            elif event.kind == "body":
                out.append(Delta(reasoning=event.text) if self.state == "think" else Delta(content=event.text))
            else:
                if self.state == "call" and event.text:
                    out.append(Delta(content=event.text))
                self.state = "between"
        return out


def knows(tokenizer: Tokenizer) -> bool:
    """Whether the model's chat template writes Harmony and renders tools as its functions namespace."""
    return _knows(tokenizer, tokenizer.chat_template)


@lru_cache(maxsize=8)
def _knows(tokenizer: Tokenizer, template: str | None) -> bool:
    if not is_harmony(template) or "to=" not in template:
        return False
    try:
        rendered = tokenizer.render_chat([{"role": "user", "content": "hi"}], tools=[_PROBE])
    except ValueError:  # ChatTemplateError: the template cannot take tools after all
        return False
    return f"type {_PROBE['function']['name']}" in rendered and "namespace functions" in rendered


def harmony_budget(calls: bool) -> tuple[str, str]:
    """What a thinking budget reads of a Harmony reply: the analysis message's opening (a reply
    that opens otherwise has no thought to close), and the text it forces once the budget is spent:
    the message's end and the next message's start, then under tools no more (the tool grammar
    lets the model call or answer, never think again), else the final channel (a free reply could
    open a second analysis message)."""
    after = START + "assistant" + ("" if calls else CHANNEL + "final" + MESSAGE)
    return CHANNEL + "analysis" + MESSAGE, END + after


def call_header(name: str) -> str:
    """A call's header as the grammar writes it (the reply's first message: no <|start|>)."""
    return f"{CHANNEL}commentary to=functions.{name} <|constrain|>json{MESSAGE}"


def constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool,
               lit: Callable[[str], str] = literal) -> StructuredOutputs:
    """The reply's grammar: an optional thought, then calls (of `tools`), or under "auto" a final
    answer; `lit` writes a literal (its markers by token id, where they are special tokens: Markers)."""
    arguments = [s["properties"]["arguments"] for s in call_schemas(tools)]
    rules = [f"start: thought? ({'calls | answer' if choice in (None, 'auto') else 'calls'})",
             f"thought: {lit(CHANNEL + 'analysis' + MESSAGE)} thought_text {lit(START + 'assistant')}",
             # lazy: the thought ends at its first <|end|> (a greedy run would take the "<" of it, and
             # fail); a special token is no text, so THOUGHT never takes one (and a lazy rule, a
             # lexeme, may not name one)
             f"thought_text[lazy]: THOUGHT {lit(END)}" if lit(END) == literal(END) else f"thought_text: THOUGHT {lit(END)}",
             f"calls: call ({lit(START + 'assistant')} call)*" if parallel_calls(choice, parallel)
             else "calls: call",
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
             *(f"call_{i}: {lit(call_header(t.function.name))} "
               f"%json {json.dumps({'x-guidance': JSON_LAYOUT, **schema})} {lit(CALL)}"
               for i, (t, schema) in enumerate(zip(tools, arguments))),
             f"answer: {lit(CHANNEL + 'final' + MESSAGE)} ANSWER",
             r"THOUGHT: /([^<]|<[^|])*/",
             r"ANSWER: /[^<\s]([^<]|<[^|])*/"]
    return StructuredOutputs(grammar="\n".join(rules) + "\n")


def template_messages(messages_: list[Any]) -> list[dict[str, Any]]:
    """The conversation (core ChatMessages) as gpt-oss's template reads it. It renders one call per
    assistant message and names a tool result's sender by the call before it, so a turn of several
    calls goes as one assistant message per call, each followed by its result (by tool_call_id)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages_):
        message = messages_[i]
        i += 1
        if message.role != "assistant" or not message.tool_calls:
            out.append(_plain(message))
            continue
        results = []
        while i < len(messages_) and messages_[i].role == "tool":
            results.append(messages_[i])
            i += 1
        answered: set[int] = set()
        for n, call in enumerate(message.tool_calls):
            function = call.get("function") or {}
            out.append({"role": "assistant", "content": message.text() if n == 0 else "", "tool_calls": [
                {"type": "function", "function": {"name": function.get("name"), "arguments": arguments_of(call)}}]})
            for k, result in enumerate(results):
                if k not in answered and result.tool_call_id is not None and result.tool_call_id == call.get("id"):
                    out.append(_plain(result))
                    answered.add(k)
        out += [_plain(r) for k, r in enumerate(results) if k not in answered]  # unmatched: after the last call
    return out


def _plain(message: Any) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "tool", "content": message.text(), "tool_call_id": message.tool_call_id}
    return {"role": message.role, "content": message.text()}


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply, its thought left out: the calls are its messages to
    `functions.NAME`, each with a JSON object (a reply where one is not, cut or malformed, or that
    ends inside a header, has no calls and no content); the content is its final and preamble
    messages' text, or a reply that is not Harmony as it stands."""
    content, calls = [], []
    read, cut = messages(text)
    if cut:
        return None, []
    for head, body, _ in read:
        if (name := head.function) is not None:
            try:
                arguments = json.loads(body)
            except ValueError:
                return None, []
            if not isinstance(arguments, dict):
                return None, []
            calls.append(openai_call(name, arguments))
        elif head.recipient is None and head.channel != "analysis":
            content.append(body)
    return "".join(content) or None, calls


class HarmonyToolStream(OutputParser):
    """A reply's streaming tool stage: its first character decides, once, whether it is a plain
    answer (one that opens with neither "<" nor blank space: streamed from there on) or Harmony
    messages (held, to be read whole at the end, while each call streams: its name once its
    header is whole, then its arguments' characters up to where their brackets close)."""

    def __init__(self) -> None:
        self.answering: bool | None = None  # None until the first character
        self.reader = MessageReader()
        self.calls = 0
        self.value: ObjectEnd | None = None  # the open call's arguments, until they close

    @property
    def holding(self) -> bool:
        return not self.answering

    def feed(self, delta: Delta) -> list[Delta]:
        if self.answering:
            return [delta]
        if not delta.content:
            return []
        if self.answering is None:
            self.answering = not (delta.content[0] == "<" or delta.content[0].isspace())
            if self.answering:
                return [delta]
        return [Delta(call=call) for event in self.reader.feed(delta.content) for call in self._call(event)]

    def _call(self, event: Event) -> list[CallDelta]:
        if event.kind == "header":
            self.value = None
            if (name := event.header.function) is None:
                return []
            self.value, self.calls = ObjectEnd(), self.calls + 1
            return [CallDelta(self.calls - 1, "", f"call_{uuid.uuid4().hex[:24]}", name)]
        if event.kind != "body" or self.value is None:
            return []
        text = event.text
        if self.value.depth == 0 and not self.value.in_string:  # the value not opened yet: no blank before it
            text = text.lstrip()
            if not text:
                return []
        end = self.value.scan(text, 0)
        if end is None:
            return [CallDelta(self.calls - 1, text)]
        self.value = None
        return [CallDelta(self.calls - 1, text[:end], closed=True)]


class HarmonyToolFormat(ToolFormat):
    """Tools rendered by gpt-oss's template as its functions namespace; calls as commentary
    messages to functions.NAME under a grammar."""

    name = "harmony"
    MARKERS = MARKERS  # the module's: every Harmony marker

    @classmethod
    def knows(cls, tokenizer: Tokenizer) -> bool:
        return knows(tokenizer)

    def constraint(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool) -> StructuredOutputs:
        return constraint(tools, choice, parallel, self.special.lit)

    def template_messages(self, messages: list[Any], tools: list[Tool], choice: ToolChoice | None
                          ) -> list[dict[str, Any]]:
        return template_messages(messages)

    def template_tools(self, tools: list[Tool]) -> list[dict[str, Any]]:
        """OpenAI's tools; each with a description (the template writes it as a comment, and fails without one)."""
        out = []
        for tool in tools:
            entry = tool.model_dump(exclude_none=True)
            entry["function"].setdefault("description", "")
            out.append(entry)
        return out

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return parse(text)

    def stream(self) -> HarmonyToolStream:
        return HarmonyToolStream()


FORMAT = register(HarmonyToolFormat())
