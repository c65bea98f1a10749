"""The Mistral tool formats without a model (api/core/parsers/mistral.py): which templates they know,
on real Mistral templates (tests/data/chat_templates: Mistral Nemo's JSON list, Mistral Small 3.2's
v11 form); what each reads out of a reply, whole or cut; what its grammar lets a model write under
each tool_choice; the conversation as the templates read it; and the stream's deltas."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from api.core.chat import ChatMessage
from api.core.parsers import mistral, registry
from api.core.parsers.base import Delta, read_reply
from api.core.tools import NamedToolChoice, Tool
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import CHAT_TEMPLATE, HERMES_TEMPLATE, build_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
FORMATS = {"list": mistral.FORMAT, "v11": mistral.FORMAT_V11}
WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}}}}})
CONVERT = Tool.model_validate({"type": "function", "function": {"name": "convert", "parameters": {
    "type": "object", "required": ["km"], "properties": {"km": {"type": "integer", "minimum": 0}}}}})  # open
NOW = Tool.model_validate({"type": "function", "function": {"name": "now"}})
CALLS = [("get_weather", {"city": "Paris {x}"}), ("convert", {"km": 5}),
         ("add", {"a": 1, "b": [2, {"c": "\"}][TOOL_CALLS]x[ARGS]\\"}]}), ("now", {})]


def written(form: str, calls: list[tuple[str, dict]], space: str = "") -> str:
    """Calls as a Mistral model writes them in `form` (JSON as the grammar lays it out)."""
    if form == "list":
        return mistral.MARKER + space + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    return "".join(f"{mistral.MARKER}{n}[ARGS]{json.dumps(a)}" for n, a in calls)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    """A tiny tokenizer per template: the two Mistral ones, the tests' others, and every other
    family's real template kept beside them."""
    templates = {"list": (TEMPLATES / "mistral.jinja").read_text(), "v11": (TEMPLATES / "mistral_v11.jinja").read_text(),
                 "hermes": HERMES_TEMPLATE, "generic": CHAT_TEMPLATE}
    templates.update({path.stem: path.read_text() for path in sorted(TEMPLATES.glob("*.jinja"))
                      if not path.stem.startswith("mistral")})
    out = {}
    for name, template in templates.items():
        folder = tmp_path_factory.mktemp(name.replace(".", "_"))
        build_tokenizer(folder, chat_template=template)
        out[name] = Tokenizer(folder)
    return out


def test_each_format_knows_only_its_own_form_of_mistral_template(tokenizers):
    assert mistral.FORMAT.knows(tokenizers["list"]) and not mistral.FORMAT_V11.knows(tokenizers["list"])
    assert mistral.FORMAT_V11.knows(tokenizers["v11"]) and not mistral.FORMAT.knows(tokenizers["v11"])
    others = [name for name in tokenizers if name not in FORMATS]
    assert {"hermes", "generic"} <= set(others)
    for name in others:
        assert mistral.template_form(tokenizers[name]) is None, name


def test_auto_detection_chooses_the_templates_form(tokenizers):
    assert registry.choose("auto", "m", tokenizers["list"]) is mistral.FORMAT
    assert registry.choose("auto", "m", tokenizers["v11"]) is mistral.FORMAT_V11
    assert registry.choose("auto", "m", tokenizers["generic"]).name == "generic"


@pytest.mark.parametrize("form", ["list", "v11"])
@pytest.mark.parametrize("count", [1, 4])
def test_calls_parse_into_openai_tool_calls(form, count):
    content, calls = FORMATS[form].parse(written(form, CALLS[:count]))
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == CALLS[:count]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == count


def test_what_mistral_models_write_beside_the_grammar_parses_too():
    """A space after the marker (Mistral 7B v0.3's template writes one), ids in the list (as the
    templates render earlier calls), a v13 [CALL_ID], arguments as a JSON string."""
    listed = '[TOOL_CALLS] [{"name": "convert", "arguments": {"km": 5}, "id": "abcdefghi"}]'
    assert [c["function"]["arguments"] for c in mistral.parse(listed, "list")[1]] == ['{"km": 5}']
    v13 = '[TOOL_CALLS]convert[CALL_ID]abcdefghi[ARGS]{"km": 5}'
    assert [c["function"]["name"] for c in mistral.parse(v13, "v11")[1]] == ["convert"]
    stringed = '[TOOL_CALLS][{"name": "convert", "arguments": "{\\"km\\": 5}"}]'
    assert json.loads(mistral.parse(stringed, "list")[1][0]["function"]["arguments"]) == {"km": 5}


@pytest.mark.parametrize("form", ["list", "v11"])
def test_a_plain_answer_is_content_whatever_it_holds(form):
    fmt = FORMATS[form]
    assert fmt.parse("It is sunny.") == ("It is sunny.", [])
    assert fmt.parse("[1] It is " + written(form, CALLS[:1])) == ("[1] It is " + written(form, CALLS[:1]), [])
    assert fmt.parse("[TOOL] x") == ("[TOOL] x", []) and fmt.parse("") == (None, [])


@pytest.mark.parametrize("form", ["list", "v11"])
def test_a_cut_or_malformed_reply_has_no_calls_and_no_content(form):
    whole = written(form, CALLS)
    for cut in range(1, len(whole)):
        if form == "v11" and whole[cut:].startswith(mistral.MARKER):
            continue  # whole calls so far: the v11 form has no closing bracket
        assert FORMATS[form].parse(whole[:cut]) == (None, []), whole[:cut]
    for bad in ["[TOOL_CALLS]", "[TOOL_CALLS] hi", "[TOOL_CALLS][]", '[TOOL_CALLS][{"name": "f"}]',
                '[TOOL_CALLS][{"name": 5, "arguments": {}}]', "[TOOL_CALLS]f[ARGS][1]",
                '[TOOL_CALLS]f[ARGS]{"a": 1} and more', '[TOOL_CALLS][{"name": "f", "arguments": {}}] and more']:
        assert FORMATS[form].parse(bad) == (None, []), bad


def test_calls_count_only_in_a_reply_that_ended_on_its_own():
    whole = written("v11", CALLS[:2])
    assert read_reply(whole, "stop", mistral.FORMAT_V11.parse).finish_reason == "tool_calls"
    assert read_reply(whole, "length", mistral.FORMAT_V11.parse).tool_calls == []
    assert read_reply(whole[:-3], "stop", mistral.FORMAT_V11.parse).tool_calls == []


def _fits(tokenizer: Tokenizer, constraint, text: str) -> bool:
    """Whether a constraint takes `text` whole and may end there."""
    from llguidance import LLMatcher, LLTokenizer

    ll = LLTokenizer(tokenizer.rust_tokenizer().to_str(), n_vocab=tokenizer.vocab_size,
                     eos_token=sorted(tokenizer.eos_token_ids))
    matcher = LLMatcher(ll, constraint.grammar_text(), log_level=0)
    assert not matcher.get_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


PARIS = [("get_weather", {"city": "Paris"})]
TWO = PARIS + [("convert", {"km": 5})]
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "convert"}})


@pytest.mark.parametrize("form", ["list", "v11"])
@pytest.mark.parametrize("choice, parallel, text, fits", [
    ("required", True, PARIS, True),
    ("required", True, TWO, True),
    ("required", False, TWO, False),  # one call at most
    ("required", True, "It is sunny.", False),  # calls only
    ("required", True, [("get_weather", {"city": 5})], False),  # the arguments keep the schema
    ("required", True, [("get_weather", {"city": "Paris", "days": 2})], False),  # closed, as strict mode
    ("required", True, [("convert", {"km": 5, "miles": 3})], False),  # open as given, closed all the same
    ("required", True, [("get_news", {"city": "Paris"})], False),  # only the tools given
    ("auto", True, PARIS, True),
    ("auto", True, TWO, True),
    ("auto", True, "It is sunny.", True),
    ("auto", True, "[1] a footnote", True),
    ("auto", True, "[TOOL] x", True),  # goes off the marker: an answer
    ("auto", True, "[TOOL_CALLS] It is sunny.", False),  # opens like calls: calls only
    ("auto", True, "[TOOL_CALL", False),  # the marker's start cannot end a reply
    ("auto", True, "", False),
    (NAMED, True, [("convert", {"km": 5})], True),
    (NAMED, True, [("convert", {"km": 5})] * 2, False),  # a named function: exactly one call
    (NAMED, True, PARIS, False),
    (NAMED, True, "5 km", False),
], ids=lambda v: v if isinstance(v, str) and len(v) < 20 else None)
def test_the_grammar_takes_calls_and_answers_as_tool_choice_says(tokenizers, form, choice, parallel, text, fits):
    tools = [WEATHER, CONVERT] if not isinstance(choice, NamedToolChoice) else [CONVERT]
    constraint = FORMATS[form].constraint(tools, choice, parallel)
    reply = text if isinstance(text, str) else written(form, text)
    assert _fits(tokenizers[form], constraint, reply) is fits


def test_the_list_grammar_takes_the_space_mistral_7b_writes_after_the_marker(tokenizers):
    constraint = mistral.FORMAT.constraint([WEATHER], "required", True)
    assert _fits(tokenizers["list"], constraint, written("list", PARIS, space=" "))
    assert not _fits(tokenizers["list"], constraint, written("list", PARIS, space="  "))


@pytest.mark.parametrize("form", ["list", "v11"])
def test_a_function_without_parameters_takes_no_arguments(tokenizers, form):
    constraint = FORMATS[form].constraint([NOW], "required", True)
    assert _fits(tokenizers[form], constraint, written(form, [("now", {})]))
    assert not _fits(tokenizers[form], constraint, written(form, [("now", {"x": 1})]))


HISTORY = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Nice?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_8f2a0c9d1b3e4f5a6b7c8d9e", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
               {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Nice"}}}]},
           {"role": "tool", "tool_call_id": "abcdefghi", "content": "rain"},
           {"role": "tool", "tool_call_id": "call_8f2a0c9d1b3e4f5a6b7c8d9e", "content": '{"sky": "clear"}'},
           {"role": "assistant", "content": "Clear in Paris, rain in Nice."},
           {"role": "user", "content": "And Lyon?"},
           {"role": "assistant", "tool_calls": [
               {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
           {"role": "tool", "content": "snow"}]


@pytest.mark.parametrize("form", ["list", "v11"])
def test_earlier_calls_go_back_with_ids_the_templates_take(tokenizers, form):
    messages = FORMATS[form].template_messages([ChatMessage.model_validate(m) for m in HISTORY], [WEATHER], None)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    calls = [c for m in messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    results = [m for m in messages if m["role"] == "tool"]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    assert calls[1]["id"] == "abcdefghi" and calls[0]["id"] != calls[1]["id"]
    # each result names its call, the same short id; one without a tool_call_id answers the open call
    assert [r["tool_call_id"] for r in results] == [calls[1]["id"], calls[0]["id"], calls[2]["id"]]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}
    assert [r["content"] for r in results] == (['"rain"', '{"sky": "clear"}', '"snow"'] if form == "list"
                                               else ["rain", '{"sky": "clear"}', "snow"])
    rendered = tokenizers[form].render_chat(messages, tools=FORMATS[form].template_tools([WEATHER]))
    assert '"name": "get_weather"' in rendered and "[AVAILABLE_TOOLS]" in rendered
    if form == "list":
        assert f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{calls[0]["id"]}"}}' \
            in rendered
        assert '[TOOL_RESULTS]{"content": "rain", "call_id": "abcdefghi"}[/TOOL_RESULTS]' in rendered
    else:
        assert f'[TOOL_CALLS]get_weather[CALL_ID]{calls[2]["id"]}[ARGS]{{"city": "Lyon"}}' in rendered
        assert "[TOOL_RESULTS]abcdefghi[TOOL_CONTENT]rain[/TOOL_RESULTS]" in rendered


def test_short_ids_are_the_same_for_the_same_id():
    assert mistral.short_id("call_1") == mistral.short_id("call_1") != mistral.short_id("call_2")
    assert mistral.short_id("A1b2C3d4E") == "A1b2C3d4E"


def _stream(form: str, pieces: list[str]) -> list[Delta]:
    stage = FORMATS[form].stream()
    return [d for piece in pieces for d in stage.feed(Delta(content=piece))]


def _calls_of(deltas: list[Delta]) -> list[tuple[str, str]]:
    out: dict[int, list[str]] = {}
    for d in deltas:
        assert d.call is not None and not d.content
        if d.call.name is not None:
            assert d.call.index == len(out) and d.call.id.startswith("call_")
            out[d.call.index] = [d.call.name, ""]
        out[d.call.index][1] += d.call.arguments
    return [(name, arguments) for name, arguments in out.values()]


@pytest.mark.parametrize("form", ["list", "v11"])
def test_streamed_arguments_add_up_to_the_parsed_ones_at_every_split(form):
    text = written(form, CALLS)
    parsed = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in FORMATS[form].parse(text)[1]]
    expected = [(n, json.dumps(a)) for n, a in CALLS]  # the model's own characters
    assert parsed == CALLS
    for cut in range(len(text) + 1):
        deltas = _stream(form, [text[:cut], text[cut:]])
        assert _calls_of(deltas) == expected, cut
        assert sum(d.call.closed for d in deltas) == len(CALLS)
    one_by_one = _stream(form, list(text))
    assert _calls_of(one_by_one) == expected and sum(1 for d in one_by_one if d.call.arguments) > len(CALLS)


@pytest.mark.parametrize("form", ["list", "v11"])
def test_a_streamed_cut_call_stays_open_and_the_stage_holds_the_reply(form):
    text = written(form, CALLS[:1])
    stage = FORMATS[form].stream()
    deltas = stage.feed(Delta(content=text[:-4]))
    assert stage.holding and deltas[-1].call.arguments and not deltas[-1].call.closed


@pytest.mark.parametrize("form", ["list", "v11"])
@pytest.mark.parametrize("answer", ["It is sunny.", "[1] a note", "[TOOL] x", "[TOOL_CALLS"])
def test_a_plain_answer_streams_once_it_goes_off_the_marker(form, answer):
    for cut in range(len(answer) + 1):
        stage = FORMATS[form].stream()
        deltas = [d for piece in (answer[:cut], answer[cut:]) for d in stage.feed(Delta(content=piece))]
        if mistral.MARKER.startswith(answer):  # still the marker's start: held, to be read whole
            assert deltas == [] and stage.holding
        else:
            assert "".join(d.content for d in deltas) == answer and not stage.holding
            assert all(d.call is None for d in deltas)
