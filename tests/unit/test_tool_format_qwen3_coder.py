"""The Qwen3-Coder tool format without a model (api/core/parsers/qwen3_coder.py, qwen3_coder_reply.py):
which templates it knows, what its grammar lets a model write for each tool_choice and parameter
type, what it reads out of a reply, whole, cut or streamed in any pieces, and the prompt's side on
Qwen3-Coder-30B-A3B-Instruct's own chat template (tests/data/chat_templates/qwen3_coder.jinja)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from api.core.chat import ChatMessage
from api.core.parsers import hermes, qwen3_coder, registry
from api.core.parsers.base import Delta, read_reply
from api.core.parsers.qwen3_coder_reply import CallStream, parse
from api.core.tools import NamedToolChoice, Tool
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_tokenizer

TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "qwen3_coder.jinja"


def _tool(name: str, properties: dict, required: list[str], **extra) -> Tool:
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required, **extra}}})


WEATHER = _tool("get_weather", {"city": {"type": "string", "maxLength": 12},
                                "days": {"type": "integer", "minimum": 1, "maximum": 7}}, ["city"])
EVERY = _tool("every", {
    "code": {"type": "string"},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "ratio": {"type": "number"},
    "exact": {"type": "boolean"},
    "point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "shape": {"$ref": "#/$defs/shape"},
}, ["code"], **{"$defs": {"shape": {"type": "string", "enum": ["circle", "square"]}}})
NOW = Tool.model_validate({"type": "function", "function": {"name": "now"}})
KINDS = {t.function.name: qwen3_coder.kinds_of(t) for t in (WEATHER, EVERY, NOW)}.get


def _call(name: str, **values: str) -> str:
    """A call block as the model writes it, each value's text as given."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


PARIS = _call("get_weather", city="Paris", days="3")
EVERYTHING = _call("every", code="42", unit="celsius", ratio="0.5", exact="true", point='{"x": 1}',
                   tags='["a", "</parameter>"]', shape="circle")
REPLY = "\n".join([PARIS, EVERYTHING, _call("now")])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("qwen3-coder")
    build_tokenizer(folder, chat_template=TEMPLATE.read_text())
    return Tokenizer(folder)


def test_only_a_template_that_asks_for_function_blocks_is_qwen3_coder(tokenizer, tokenizers):
    assert qwen3_coder.knows(tokenizer)
    assert not qwen3_coder.knows(tokenizers["hermes"]) and not qwen3_coder.knows(tokenizers["generic"])


def test_hermes_does_not_claim_the_qwen3_coder_template(tokenizer):
    assert not hermes.knows(tokenizer)
    assert registry.choose("auto", "m", tokenizer).name == "qwen3_coder"


def test_calls_parse_into_openai_tool_calls_typed_by_their_schemas():
    content, calls = parse(REPLY, KINDS)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "every", "now"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris", "days": 3},
        {"code": "42", "unit": "celsius", "ratio": 0.5, "exact": True, "point": {"x": 1},
         "tags": ["a", "</parameter>"], "shape": "circle"},  # a string stays one, whatever it reads as
        {}]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"]["arguments"] == json.dumps({"city": "Paris", "days": 3})
    # values span lines; one newline either side is the layout's
    _, [call] = parse(_call("every", code="\nline 1\nline 2\n"), KINDS)
    assert json.loads(call["function"]["arguments"]) == {"code": "\nline 1\nline 2\n"}


def test_a_function_not_known_has_its_values_read_as_json_where_they_are():
    _, [call] = parse(_call("other", n="3", s="Paris", o='{"a": [1]}'), KINDS)
    assert json.loads(call["function"]["arguments"]) == {"n": 3, "s": "Paris", "o": {"a": [1]}}


def test_a_plain_answer_is_content_whatever_it_holds():
    assert parse("Let me look.\n" + PARIS, KINDS) == ("Let me look.\n" + PARIS, [])
    assert parse("sunny", KINDS) == ("sunny", []) and parse("", KINDS) == (None, [])


@pytest.mark.parametrize("cut", range(1, len(REPLY)))
def test_a_cut_reply_has_no_calls_and_no_content(cut):
    text = REPLY[:cut]
    if text.rstrip() in (PARIS, "\n".join([PARIS, EVERYTHING])):  # whole calls, cut between them
        assert len(parse(text, KINDS)[1]) == text.count("<tool_call>")
    else:
        assert parse(text, KINDS) == (None, [])


@pytest.mark.parametrize("text", [
    PARIS + "\nsunny",  # text after the calls
    PARIS.replace("</function>", "</func>"),
    PARIS.replace("<parameter=days>\n3", "<parameter=city>\nRome"),  # a parameter twice
    _call("every", code="1", point="{not json"),
    PARIS.replace("<tool_call>\n<function=get_weather>", "<tool_call>\n<function=>"),
    "<b>sunny</b>",
])
def test_a_malformed_reply_has_no_calls_and_never_raises(text):
    assert parse(text, KINDS) == (None, [])


def test_calls_count_only_in_a_reply_that_ended_on_its_own():
    def read(text):
        return parse(text, KINDS)
    assert read_reply(PARIS, "stop", read).finish_reason == "tool_calls"
    assert read_reply(PARIS, "length", read).tool_calls == [] and read_reply(PARIS[:30], "stop", read).content is None


def _stream(pieces: list[str]) -> list:
    stream, out = CallStream(KINDS), []
    for piece in pieces:
        out += stream.feed(Delta(content=piece))
    return out


def _check_stream(deltas: list, text: str) -> None:
    _, calls = parse(text, KINDS)
    assert all(d.call is not None and not d.content for d in deltas)
    deltas = [d.call for d in deltas]
    assert [(d.index, d.name) for d in deltas if d.name] == [(i, c["function"]["name"]) for i, c in enumerate(calls)]
    for i, call in enumerate(calls):
        mine = [d for d in deltas if d.index == i]
        assert "".join(d.arguments for d in mine) == call["function"]["arguments"]  # the very string
        assert [d.closed for d in mine] == [False] * (len(mine) - 1) + [True] and mine[0].id.startswith("call_")


@pytest.mark.parametrize("split", range(1, len(REPLY)))
def test_streamed_deltas_add_up_to_the_calls_at_every_split_point(split):
    _check_stream(_stream([REPLY[:split], REPLY[split:]]), REPLY)


@pytest.mark.parametrize("seed", range(10))
def test_streamed_deltas_add_up_in_any_pieces(seed):
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(REPLY):
        step = rng.randint(1, 6)
        pieces.append(REPLY[i:i + step])
        i += step
    _check_stream(_stream(pieces), REPLY)
    _check_stream(_stream(list(REPLY)), REPLY)


def test_arguments_stream_a_parameter_at_a_time_and_a_cut_call_stays_open():
    deltas = [d.call for d in _stream([PARIS[:70], PARIS[70:]])]
    assert [d.arguments for d in deltas] == ["", '{"city": "Paris"', ', "days": 3', "}"]
    cut = [d.call for d in _stream([PARIS[:70]])]
    assert cut[-1].arguments == '{"city": "Paris"' and not any(d.closed for d in cut)


def test_a_plain_answer_streams_as_it_comes():
    stream = CallStream(KINDS)
    assert stream.feed(Delta(content="It is")) == [Delta(content="It is")] and not stream.holding
    assert stream.feed(Delta(content=" <b>")) == [Delta(content=" <b>")]
    held = CallStream(KINDS)
    assert held.feed(Delta(content="<tool")) == [] and held.holding


def _fits(tokenizer: Tokenizer, constraint, text: str) -> bool:
    """Whether a constraint takes `text` whole and may end there."""
    from llguidance import LLMatcher, LLTokenizer

    assert constraint.compile_error() == ""
    ll = LLTokenizer(tokenizer.rust_tokenizer().to_str(), n_vocab=tokenizer.vocab_size,
                     eos_token=sorted(tokenizer.eos_token_ids))
    matcher = LLMatcher(ll, constraint.grammar_text(), log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})


@pytest.mark.parametrize("choice, parallel, text, fits", [
    ("required", True, PARIS, True),
    ("required", True, PARIS + "\n" + EVERYTHING, True),
    ("required", True, _call("get_weather", city="Paris"), True),  # days is optional
    ("required", False, PARIS + "\n" + PARIS, False),  # one call at most
    ("required", True, "It is sunny.", False),  # calls only
    ("required", True, _call("get_news", city="Paris"), False),  # only the tools given
    ("required", True, _call("get_weather", days="3"), False),  # city is required
    ("required", True, _call("get_weather", city="Paris", country="FR"), False),  # no other parameter
    ("required", True, _call("get_weather", days="3", city="Paris"), False),  # in the schema's order
    ("auto", True, "It is sunny.", True),
    ("auto", True, PARIS, True),
    ("auto", True, "<b>sunny</b>", False),  # a plain answer does not open like a call block
    ("auto", True, "Let me look.\n" + PARIS, True),  # ... and is plain text to its end
    (NAMED, True, PARIS, True),
    (NAMED, True, PARIS + "\n" + PARIS, False),  # a named function exactly once
    (NAMED, True, EVERYTHING, False),
    (NAMED, True, "It is sunny.", False),
])
def test_the_grammar_takes_calls_and_answers_as_tool_choice_says(tokenizer, choice, parallel, text, fits):
    tools = [WEATHER] if isinstance(choice, NamedToolChoice) else [WEATHER, EVERY]
    assert _fits(tokenizer, qwen3_coder.constraint(tools, choice, parallel), text) is fits


@pytest.mark.parametrize("values, fits", [
    ({"code": "a\nmultiline </param> value"}, True),
    ({"code": "42"}, True),
    ({"code": "no </parameter> inside"}, False),
    ({"code": "x", "unit": "fahrenheit"}, True),
    ({"code": "x", "unit": "kelvin"}, False),
    ({"code": "x", "ratio": "-1.5e3"}, True),
    ({"code": "x", "ratio": "half"}, False),
    ({"code": "x", "exact": "false"}, True),
    ({"code": "x", "exact": "yes"}, False),
    ({"code": "x", "point": '{"x": 1}'}, True),
    ({"code": "x", "point": '{"x": 1, "y": 2}'}, False),  # closed
    ({"code": "x", "point": '{"y": 2}'}, False),
    ({"code": "x", "tags": '["a", "b"]'}, True),
    ({"code": "x", "tags": "[1]"}, False),
    ({"code": "x", "shape": "square"}, True),  # a $ref to a string enum
    ({"code": "x", "shape": "oval"}, False),
])
def test_each_value_keeps_its_parameters_type(tokenizer, values, fits):
    assert _fits(tokenizer, qwen3_coder.constraint([EVERY], "required", True), _call("every", **values)) is fits


@pytest.mark.parametrize("city, days, fits", [
    ("Paris", "7", True), ("Rio de Janei", "1", True), ("Rio de Janeiro", "1", False), ("Paris", "8", False),
    ("Paris", "0", False), ("Paris", "2.5", False),
])
def test_string_lengths_and_integer_bounds_hold(tokenizer, city, days, fits):
    assert _fits(tokenizer, qwen3_coder.constraint([WEATHER], "required", True),
                 _call("get_weather", city=city, days=days)) is fits


ODD = _tool("odd", {"e": {"enum": ['a"b', "c/d", "é ü", "x.*"]}, "c": {"const": "1+1"},
                   "n": {"type": ["integer", "null"]}}, ["e"])


@pytest.mark.parametrize("values, fits", [
    ({"e": 'a"b'}, True), ({"e": "c/d"}, True), ({"e": "é ü"}, True), ({"e": "x.*"}, True), ({"e": "xyz"}, False),
    ({"e": "c/d", "c": "1+1"}, True), ({"e": "c/d", "c": "11"}, False),
    ({"e": "c/d", "n": "null"}, True), ({"e": "c/d", "n": "4"}, True), ({"e": "c/d", "n": "four"}, False),
])
def test_enums_and_consts_are_taken_literally(tokenizer, values, fits):
    text = _call("odd", **values)
    assert _fits(tokenizer, qwen3_coder.constraint([ODD], "required", True), text) is fits
    if fits:
        kinds = {"odd": qwen3_coder.kinds_of(ODD)}.get
        assert json.loads(parse(text, kinds)[1][0]["function"]["arguments"]) == {
            k: None if v == "null" else int(v) if k == "n" else v for k, v in values.items()}


def test_a_function_without_parameters_takes_none(tokenizer):
    constraint = qwen3_coder.constraint([NOW], "required", True)
    assert _fits(tokenizer, constraint, _call("now")) and not _fits(tokenizer, constraint, _call("now", x="1"))


def test_a_parameter_name_the_format_cannot_write_is_refused():
    with pytest.raises(ValueError, match="cannot be written"):
        qwen3_coder.constraint([_tool("f", {"a>b": {"type": "string"}}, [])], "required", True)


def test_the_format_bound_to_the_tools_reads_values_by_their_schemas():
    fmt = qwen3_coder.Qwen3CoderFormat()
    text = _call("every", code="42")
    assert json.loads(fmt.parse(text)[1][0]["function"]["arguments"]) == {"code": 42}  # not bound: as JSON
    fmt.constraint([EVERY], "auto", True)  # building a constraint binds nothing
    assert json.loads(fmt.parse(text)[1][0]["function"]["arguments"]) == {"code": 42}
    fmt = fmt.bind([EVERY])
    assert json.loads(fmt.parse(text)[1][0]["function"]["arguments"]) == {"code": "42"}
    deltas = [d.call for d in fmt.stream().feed(Delta(content=text))]
    assert "".join(d.arguments for d in deltas) == '{"code": "42"}'


HISTORY = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Weather?"),
           ChatMessage(role="assistant", content=None, tool_calls=[{"id": "call_1", "type": "function", "function": {
               "name": "every", "arguments": json.dumps({"code": "42", "exact": True, "point": {"x": 1}})}}]),
           ChatMessage(role="tool", tool_call_id="call_1", content="sunny")]


def test_the_template_renders_the_tools_and_earlier_calls_as_the_model_writes_them(tokenizer):
    fmt = registry.get("qwen3_coder")
    rendered = tokenizer.render_chat(fmt.template_messages(HISTORY, [EVERY, NOW], None),
                                     tools=fmt.template_tools([EVERY, NOW]))
    assert rendered.startswith("<|im_start|>system\nBe brief.") and "<name>now</name>" in rendered
    assert "<name>point</name>\n<type>object</type>" in rendered
    earlier = _call("every", code="42", exact="true", point='{"x": 1}')
    assert earlier in rendered and "<tool_response>\nsunny\n</tool_response>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    # What the template shows the model as a call is what the grammar lets it write
    assert _fits(tokenizer, fmt.constraint([EVERY], "required", True), earlier)


def test_earlier_arguments_that_are_not_an_object_are_refused():
    message = ChatMessage(role="assistant", tool_calls=[{"type": "function",
                                                         "function": {"name": "now", "arguments": "[1]"}}])
    with pytest.raises(ValueError, match="not a JSON object"):
        registry.get("qwen3_coder").template_messages([message], [NOW], None)


def test_a_format_bound_to_one_requests_tools_types_only_its_values():
    """Bound to a request's tools, values are typed by their schemas; the registered format keeps
    nothing from a request (one tenant's tools never type another's values)."""
    bound = qwen3_coder.FORMAT.bind([WEATHER])
    reply = "<tool_call>\n<function=get_weather>\n<parameter=city>\n75001\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    assert json.loads(bound.parse(reply)[1][0]["function"]["arguments"])["city"] == "75001"  # a string, by its schema
    assert qwen3_coder.FORMAT.kinds("get_weather") is None  # nothing kept by the registered format
    assert json.loads(qwen3_coder.FORMAT.parse(reply)[1][0]["function"]["arguments"])["city"] == 75001  # untyped: JSON
