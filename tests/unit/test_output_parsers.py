"""The output-parser seam (api/core/parsers/): every registered tool format, fed recorded replies
split at every character, streams what its whole-text read gives: the same answer, the same calls
with the same arguments, each call's name once; and the registry chooses a model's format by the
setting or, under auto, by its chat template."""
from __future__ import annotations

import json

import pytest

from api.core.parsers import registry
from api.core.parsers.base import Delta, OutputParser, ToolFormat
from api.core.parsers.reply import ReplyParser

CALLS = [("get_weather", {"city": "Paris \"{x}\"", "days": 3}), ("add", {"a": 1, "b": [2, {"c": "}]\\"}]})]
HERMES_CALLS = "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in CALLS)
GENERIC_CALLS = json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in CALLS]})
RECORDED = {  # (format, reply text, finish reason)
    "hermes calls": ("hermes", HERMES_CALLS, "stop"),
    "hermes answer": ("hermes", "It is sunny in <b>Paris</b>, é ✓.", "stop"),
    "hermes cut call": ("hermes", HERMES_CALLS[:70], "length"),
    "generic calls": ("generic", GENERIC_CALLS, "stop"),
    "generic answer": ("generic", json.dumps({"response": "Sunny, \"warm\" \\ é ✓"}), "stop"),
    "generic cut answer": ("generic", '{"response": "Sunny, \\"wa', "length"),
    "generic cut call": ("generic", GENERIC_CALLS[:60], "length"),
}


def _splits(text: str):
    """The text one character at a time, and cut in two at every position."""
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def _stream(tool_format: ToolFormat, pieces: list[str], finish_reason: str):
    parser = ReplyParser(tool_format)
    deltas = [d for piece in pieces for d in parser.feed(piece)]
    return parser, deltas, parser.finish(finish_reason)


@pytest.mark.parametrize("case", RECORDED, ids=list(RECORDED))
def test_a_streamed_reply_gives_what_its_whole_text_gives_at_every_split(case):
    name, text, finish_reason = RECORDED[case]
    tool_format = registry.get(name)
    whole = tool_format.reply(text, finish_reason)
    for pieces in _splits(text):
        parser, deltas, reply = _stream(tool_format, pieces, finish_reason)
        assert (reply.content, reply.finish_reason) == (whole.content, whole.finish_reason)
        assert [c["function"] for c in reply.tool_calls] == [c["function"] for c in whole.tool_calls]
        streamed = "".join(d.content for d in deltas)
        # an answer streams as it comes, or (held) comes whole at the end; never both, never a call's text
        assert streamed in ("", whole.content or "")
        if streamed:
            assert not parser.holding and streamed == text
        calls = [d.call for d in deltas if d.call is not None]
        names = [c.name for c in calls if c.name is not None]
        assert parser.calls == len(names)
        if whole.tool_calls:
            assert names == [c["function"]["name"] for c in whole.tool_calls]
            for i, call in enumerate(whole.tool_calls):
                arguments = "".join(c.arguments for c in calls if c.index == i)
                assert json.loads(arguments) == json.loads(call["function"]["arguments"])
                assert [c.closed for c in calls if c.index == i].count(True) == 1


def test_a_hermes_answer_streams_from_its_first_character_and_calls_are_held():
    hermes = registry.get("hermes")
    answer = ReplyParser(hermes)
    assert answer.holding and answer.feed("") == []
    assert answer.feed("It") == [Delta(content="It")] and not answer.holding
    assert answer.feed(" is") == [Delta(content=" is")]
    calls = ReplyParser(hermes)
    assert [d.content for d in calls.feed("<tool_call>\n")] == [] and calls.holding


def test_without_a_tool_format_the_text_passes_as_it_is():
    parser = ReplyParser(None)
    assert parser.feed('{"tool_calls": [') == [Delta(content='{"tool_calls": [')]
    assert not parser.holding and parser.finish("stop").content == '{"tool_calls": ['


def test_auto_chooses_the_format_the_template_certainly_asks_for_else_the_generic_one(tokenizers):
    assert registry.choose("auto", "m", tokenizers["hermes"]).name == "hermes"
    assert registry.choose("auto", "m", tokenizers["generic"]).name == "generic"


def test_a_setting_names_the_format_for_every_model_or_per_model(tokenizers):
    assert registry.choose("generic", "m", tokenizers["hermes"]).name == "generic"
    setting = "a=generic, b=hermes"
    assert registry.choose(setting, "a", tokenizers["hermes"]).name == "generic"
    assert registry.choose(setting, "b", tokenizers["generic"]).name == "hermes"
    assert registry.choose(setting, "c", tokenizers["hermes"]).name == "hermes"  # not named: auto
    with pytest.raises(ValueError, match="no tool format 'nope'; known: auto, deepseek_v3, generic, harmony, hermes, "
                                         "llama3_json, mistral, mistral_v11, qwen3_coder"):
        registry.choose("nope", "m", tokenizers["generic"])
    with pytest.raises(ValueError, match="not MODEL=FORMAT"):
        registry.choose("a=", "a", tokenizers["generic"])


@pytest.mark.parametrize("setting, error", [("nope", "no tool format 'nope'"), ("a=hermes,b=nope", "no tool format 'nope'"),
                                            ("a=", "not MODEL=FORMAT")])
def test_an_app_with_a_wrong_tool_parser_setting_is_refused_before_it_serves(setting, error):
    from api.app import create_app
    from shared.settings import ApiSettings

    with pytest.raises(ValueError, match=error):
        create_app(ApiSettings(tool_parser=setting))
    create_app(ApiSettings(tool_parser="a=hermes, b=generic"))  # a right one builds


def test_a_new_format_is_one_class_and_one_registration(tokenizers):
    class Shouting(OutputParser):
        def feed(self, delta: Delta) -> list[Delta]:
            return [Delta(content=delta.content.upper())]

        @property
        def holding(self) -> bool:
            return False

    class Loud(ToolFormat):
        name = "loud-test"

        def constraint(self, tools, choice, parallel):
            raise NotImplementedError

        def template_messages(self, messages, tools, choice):
            return []

        def parse(self, text):
            return text.upper(), []

        def stream(self) -> OutputParser:
            return Shouting()

    loud = registry.register(Loud())
    try:
        assert registry.choose("loud-test", "m", tokenizers["generic"]) is loud
        assert ReplyParser(loud).feed("hi") == [Delta(content="HI")]
        with pytest.raises(ValueError, match="registered already"):
            registry.register(Loud())
    finally:
        registry._FORMATS.pop("loud-test")
