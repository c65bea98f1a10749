"""The DeepSeek-V3 / R1 tool format (api/core/parsers/deepseek_v3.py) without a model: which chat
templates ask for it, what it reads out of a reply, whole or cut, what its grammar lets a model
write under each tool_choice, how it hands earlier turns to the real template, and that its
calls stream as written at every split point, after a thought too."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.core.chat import ChatMessage
from api.core.parsers import deepseek_v3 as ds
from api.core.parsers import registry
from api.core.parsers.base import Reply, read_reply
from api.core.parsers.reasoning import ThinkFormat
from api.core.parsers.reply import ReplyParser
from api.core.tools import NamedToolChoice, Tool
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import CHAT_TEMPLATE, HERMES_TEMPLATE, build_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
DEEPSEEK = (TEMPLATES / "deepseek_v3.jinja").read_text()
OTHER_FAMILIES = sorted(p.name for p in TEMPLATES.glob("*.jinja") if p.name != "deepseek_v3.jinja")
# DeepSeek-V3.1's way, shortened: the same markers, but the name right after the call's marker and
# the arguments without a fence. Not this format.
V31_TEMPLATE = (
    "{{ bos_token }}{% if tools %}## Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments"
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{% for c in m.tool_calls or [] %}<｜tool▁call▁begin｜>"
    "{{ c.function.name }}<｜tool▁sep｜>{{ c.function.arguments | tojson }}<｜tool▁call▁end｜>{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}}}}})
CONVERT = Tool.model_validate({"type": "function", "function": {"name": "convert", "parameters": {
    "type": "object", "required": ["km"],  # open, as users write it: the grammar closes it
    "properties": {"km": {"type": "integer", "minimum": 0, "maximum": 1000}}}}})
NOW = Tool.model_validate({"type": "function", "function": {"name": "now"}})
NAMED_CONVERT = NamedToolChoice.model_validate({"type": "function", "function": {"name": "convert"}})


def call(name: str, arguments: str) -> str:
    return f"{ds.CALL_BEGIN}function{ds.SEP}{name}\n```json\n{arguments}\n```{ds.CALL_END}"


def calls(*written: str) -> str:
    return ds.CALLS_BEGIN + "\n".join(written) + ds.CALLS_END


PARIS = call("get_weather", '{"city": "Paris"}')
KM = call("convert", '{"km": 5}')
TRICKY = {"city": "}{\"<｜tool▁call▁end｜>\\", "list": [1, {"a": "]"}], "é": "✓"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    out = {}
    templates = {"deepseek_v3": DEEPSEEK, "chat": CHAT_TEMPLATE, "hermes": HERMES_TEMPLATE, "v3.1": V31_TEMPLATE,
                 **{name: (TEMPLATES / name).read_text() for name in OTHER_FAMILIES}}
    for name, template in templates.items():
        folder = tmp_path_factory.mktemp(name.replace(".", "_"))
        build_tokenizer(folder, chat_template=template)
        out[name] = Tokenizer(folder)
    return out


def test_the_real_template_renders_the_tools_and_asks_for_this_format(tokenizers):
    tokenizer = tokenizers["deepseek_v3"]
    assert ds.knows(tokenizer) and registry.get("deepseek_v3") is ds.FORMAT
    assert registry.choose("auto", "m", tokenizer) is ds.FORMAT  # auto-detection picks it
    rendered = tokenizer.render_chat([{"role": "user", "content": "Weather?"}], tools=ds.FORMAT.template_tools([WEATHER]))
    assert '"name": "get_weather"' in rendered and rendered.endswith("<｜User｜>Weather?<｜Assistant｜>\n")


@pytest.mark.parametrize("name", ["chat", "hermes", "v3.1", *OTHER_FAMILIES])
def test_no_other_template_is_taken_for_this_format(tokenizers, name):
    assert not ds.knows(tokenizers[name])
    assert registry.choose("auto", "m", tokenizers[name]) is not ds.FORMAT


def test_replies_parse_into_openai_tool_calls():
    content, found = ds.parse(calls(PARIS, KM))
    assert content is None and [c["function"]["name"] for c in found] == ["get_weather", "convert"]
    assert json.loads(found[1]["function"]["arguments"]) == {"km": 5} and found[0]["id"].startswith("call_")
    assert found[0]["id"] != found[1]["id"]
    _, [tricky] = ds.parse(calls(call("get_weather", json.dumps(TRICKY, ensure_ascii=False))))
    assert json.loads(tricky["function"]["arguments"]) == TRICKY
    assert ds.parse(calls(call("now", "{}")) + "\n")[1][0]["function"] == {"name": "now", "arguments": "{}"}


@pytest.mark.parametrize("text", ["sunny", "<b>sunny</b>", "<｜tool▁calls▁be gin", " " + calls(PARIS),
                                  "Let me look.\n" + calls(PARIS)])
def test_a_reply_that_does_not_begin_with_the_marker_is_a_plain_answer(text):
    assert ds.parse(text) == (text, [])


def test_every_cut_of_a_call_reply_has_no_calls_and_no_content():
    whole = calls(PARIS, KM)
    for cut in range(len(whole)):
        assert ds.parse(whole[:cut]) == (None, []), cut


@pytest.mark.parametrize("text", [
    calls(call("get_weather", '{"city": "Paris"')),  # the arguments unclosed
    calls(call("get_weather", "{'city': 'Paris'}")),  # not JSON
    calls(PARIS) + "more",  # text after the calls
    calls(PARIS, "junk"),
    ds.CALLS_BEGIN + PARIS,  # no end marker
    calls(PARIS.replace("function", "fn")),
    calls(PARIS.replace("```json", "```")),
    calls(f"{ds.CALL_BEGIN}get_weather{ds.SEP}{{\"city\": \"Paris\"}}{ds.CALL_END}"),  # V3.1's way
    calls(),
])
def test_a_malformed_call_reply_has_no_calls_and_never_raises(text):
    assert ds.parse(text) == (None, [])


def test_calls_count_only_in_a_reply_that_ended_on_its_own():
    whole = calls(PARIS)
    reply = read_reply(whole, "stop", ds.parse)
    assert reply.finish_reason == "tool_calls" and reply.content is None and len(reply.tool_calls) == 1
    assert ds.FORMAT.reply(whole, "length").tool_calls == [] and ds.FORMAT.reply(whole, "length").content is None
    assert ds.FORMAT.reply(whole[:50], "stop") == Reply(None, [], "stop")  # cut by a stop string
    assert ds.FORMAT.reply("It is", "length").content == "It is"


def _fits(tokenizer: Tokenizer, constraint, text: str) -> bool:
    """Whether a constraint takes `text` whole and may end there (llguidance, as the worker runs it)."""
    from llguidance import LLMatcher, LLTokenizer

    ll = LLTokenizer(tokenizer.rust_tokenizer().to_str(), n_vocab=tokenizer.vocab_size,
                     eos_token=sorted(tokenizer.eos_token_ids))
    matcher = LLMatcher(ll, constraint.grammar_text(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("choice, parallel, text, fits", [
    ("required", True, calls(PARIS), True),
    ("required", True, calls(PARIS, KM), True),
    ("required", True, calls(KM, PARIS, KM), True),
    ("required", False, calls(PARIS, KM), False),  # one call at most
    ("required", False, calls(KM), True),
    ("required", True, "It is sunny.", False),  # calls only
    ("required", True, calls(), False),
    ("required", True, calls(call("get_weather", '{"city": 5}')), False),  # the arguments keep the schema
    ("required", True, calls(call("get_weather", '{"city": "Paris", "x": 1}')), False),  # closed
    ("required", True, calls(call("convert", '{"km": 5, "x": 1}')), False),  # closed by the server
    ("required", True, calls(call("get_news", '{"city": "Paris"}')), False),  # only the tools given
    ("required", True, calls(call("get_weather", '{"city":"Paris"}')), False),  # one JSON layout
    ("required", True, calls(PARIS) + "\n", False),
    ("auto", True, "It is sunny.", True),
    ("auto", True, "<b>sunny</b>", True),  # "<" may begin an answer
    ("auto", True, calls(PARIS, KM), True),
    ("auto", False, calls(PARIS, KM), False),
    ("auto", True, calls(PARIS)[:30], False),  # an answer does not begin like the marker
    ("auto", True, calls(PARIS).replace("get_weather", "nope"), False),
    (None, True, "It is sunny.", True),
    (NAMED_CONVERT, True, calls(KM), True),
    (NAMED_CONVERT, True, calls(KM, KM), False),  # a named function exactly once, parallel or not
    (NAMED_CONVERT, True, calls(PARIS), False),
    (NAMED_CONVERT, True, "It is sunny.", False),
])
def test_the_grammar_takes_calls_and_answers_as_tool_choice_says(tokenizers, choice, parallel, text, fits):
    tools = [WEATHER, CONVERT] if not isinstance(choice, NamedToolChoice) else [CONVERT]
    assert _fits(tokenizers["deepseek_v3"], ds.constraint(tools, choice, parallel), text) is fits


def test_a_function_without_parameters_takes_no_arguments(tokenizers):
    constraint = ds.constraint([NOW], "required", True)
    assert _fits(tokenizers["deepseek_v3"], constraint, calls(call("now", "{}")))
    assert not _fits(tokenizers["deepseek_v3"], constraint, calls(call("now", '{"x": 1}')))


def test_earlier_calls_and_results_reach_the_template_as_it_reads_them(tokenizers):
    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content=[{"type": "text", "text": "Weather?"}]),
                ChatMessage(role="assistant", content=None, tool_calls=[
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "convert", "arguments": '{"km": 5}'}}]),
                ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
                ChatMessage(role="tool", tool_call_id="call_2", content="8 km")]
    shown = ds.FORMAT.template_messages(messages, [WEATHER, CONVERT], None)
    assert shown[2]["tool_calls"][0] == {"type": "function", "function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}
    assert shown[1] == {"role": "user", "content": "Weather?"}
    assert shown[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    rendered = tokenizers["deepseek_v3"].render_chat(shown, tools=ds.FORMAT.template_tools([WEATHER, CONVERT]))
    # the earlier calls exactly as the grammar has the model write them (the template's own blank
    # space between them aside), and both results
    assert ds.CALLS_BEGIN + PARIS in rendered and rendered.index(PARIS) < rendered.index(KM)
    assert rendered[rendered.index(KM) + len(KM):].lstrip().startswith(ds.CALLS_END)
    assert "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>" in rendered and "8 km" in rendered
    assert "Be brief." in rendered and rendered.endswith("<｜tool▁outputs▁end｜>\n\n")  # the model goes on


def _splits(text: str):
    """The text one character at a time, and cut in two at every position."""
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


WRITTEN = [("get_weather", json.dumps(TRICKY, ensure_ascii=False)), ("now", "{}"), ("convert", '{"km": 5}')]


@pytest.mark.parametrize("thought", ["", "<think>I should call get_weather {\"x\": 1}</think>"],
                         ids=["no thought", "after a thought"])
def test_streamed_calls_add_up_to_the_final_ones_at_every_split(thought):
    text = thought + calls(*(call(n, a) for n, a in WRITTEN))
    reasoning = ThinkFormat() if thought else None
    for pieces in _splits(text):
        parser = ReplyParser(ds.FORMAT, reasoning)
        deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.flush()
        reply = parser.finish("stop")
        assert reply.finish_reason == "tool_calls" and reply.content is None
        assert reply.reasoning == (thought[len("<think>"):-len("</think>")] if thought else None)
        assert "".join(d.reasoning for d in deltas) == (reply.reasoning or "")
        assert not any(d.content for d in deltas)  # never the calls' text as content
        streamed = [d.call for d in deltas if d.call is not None]
        heads = [c for c in streamed if c.name is not None]
        assert [(c.index, c.name) for c in heads] == list(enumerate(n for n, _ in WRITTEN))
        assert len({c.id for c in heads}) == len(WRITTEN) and all(c.id.startswith("call_") for c in heads)
        for index, (final, (_, written)) in enumerate(zip(reply.tool_calls, WRITTEN)):
            mine = [c for c in streamed if c.index == index]
            assert "".join(c.arguments for c in mine) == written == final["function"]["arguments"]
            assert [c.closed for c in mine].count(True) == 1 and mine[-1].closed


@pytest.mark.parametrize("text", ["<b>It is</b> sunny, é ✓", "Sunny " + calls(PARIS)])
def test_a_plain_answer_streams_as_it_comes_at_every_split(text):
    for pieces in _splits(text):
        parser = ReplyParser(ds.FORMAT)
        deltas = [d for piece in pieces for d in parser.feed(piece)]
        assert "".join(d.content for d in deltas) == text and not parser.holding
        assert not any(d.call for d in deltas) and parser.finish("stop").content == text


def test_a_cut_call_streams_unclosed_and_its_reply_has_none():
    text = calls(PARIS, KM)[:-len(ds.CALLS_END + ds.CALL_END + "\n```") - 3]  # inside the second call's arguments
    parser = ReplyParser(ds.FORMAT)
    streamed = [d.call for d in parser.feed(text) if d.call is not None]
    assert [c.name for c in streamed if c.name] == ["get_weather", "convert"]
    assert not streamed[-1].closed and parser.holding
    assert parser.finish("length") == read_reply(text, "length", ds.parse) and ds.parse(text) == (None, [])
    held = ReplyParser(ds.FORMAT)
    assert held.feed(ds.CALLS_BEGIN[:9]) == [] and held.holding  # the marker so far decides nothing
    assert held.finish("length").content is None
