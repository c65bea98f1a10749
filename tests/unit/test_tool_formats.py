"""The two tool formats' own parts, without a model: what each reads out of a reply, whole or cut,
the closing of the functions' schemas, and what each format's constraint lets a model write
(api/core/tools.py, api/core/parsers/hermes.py)."""
from __future__ import annotations

import copy
import json

import pytest

from api.core.parsers import hermes
from api.core.parsers import generic
from api.core.parsers.base import read_reply
from api.core.tools import NamedToolChoice, Tool, closed
from shared.tokenizer import Tokenizer

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}}}}})
CONVERT = Tool.model_validate({"type": "function", "function": {"name": "convert", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["km"],
    "properties": {"km": {"type": "integer", "minimum": 0, "maximum": 1000}}}}})
ADD = Tool.model_validate({"type": "function", "function": {"name": "add", "parameters": {  # open, as users write it
    "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}})
NO_ARGUMENTS = Tool.model_validate({"type": "function", "function": {"name": "now"}})
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
KM = '<tool_call>\n{"name": "convert", "arguments": {"km": 5}}\n</tool_call>'


def test_only_a_template_that_renders_tools_and_asks_for_call_blocks_is_hermes(tokenizers):
    assert hermes.knows(tokenizers["hermes"]) and not hermes.knows(tokenizers["generic"])


def test_hermes_replies_parse_into_openai_tool_calls():
    content, calls = hermes.parse(PARIS + "\n" + KM)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "convert"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"km": 5} and calls[0]["id"].startswith("call_")
    # a reply not opening with "<" is the grammar's plain answer, whatever it holds
    assert hermes.parse("Let me look.\n" + PARIS) == ("Let me look.\n" + PARIS, [])
    assert hermes.parse("sunny") == ("sunny", []) and hermes.parse("") == (None, [])


@pytest.mark.parametrize("cut", [PARIS[:40], PARIS[:-1], PARIS + "\n" + KM[:30], PARIS + "\n<"])
def test_a_cut_hermes_reply_has_no_calls_and_no_content(cut):
    assert hermes.parse(cut) == (None, [])


def test_generic_replies_parse_into_openai_tool_calls():
    content, calls = generic.parse('{"tool_calls": [{"name": "convert", "arguments": {"km": 5}}]}')
    assert content is None and calls[0]["function"]["name"] == "convert"
    assert generic.parse('{"response": "hi"}') == ("hi", [])


@pytest.mark.parametrize("cut, answer", [
    ('{"tool_calls": [', None),
    ('{"tool_calls": [{"name": "convert", "arguments": {"km": 5}}]', None),  # whole calls, unclosed reply
    ('{"resp', None),
    ('{"response": ', None),
    ('{"response": "', ""),
    ('{"response": "It is sun', "It is sun"),
    ('{"response": "It is \\"sun', 'It is "sun'),  # a whole escape is kept
    ('{"response": "It is \\', "It is "),  # a cut one dropped
    ('{"response": "caf\\u00e', "caf"),
    ('{"response": "\\ud83d\\ude00 \\ud83d', "\U0001f600 "),  # half a surrogate pair dropped
    ('{"response": "sunny"', "sunny"),
])
def test_a_cut_generic_reply_is_the_answer_so_far_or_nothing(cut, answer):
    assert generic.parse(cut) == (answer, [])


def test_calls_count_only_in_a_reply_that_ended_on_its_own():
    whole = '{"tool_calls": [{"name": "convert", "arguments": {"km": 5}}]}'
    reply = read_reply(whole, "stop", generic.parse)
    assert reply.finish_reason == "tool_calls" and reply.content is None and len(reply.tool_calls) == 1
    assert read_reply(whole, "length", generic.parse) == generic.Reply(None, [], "length")  # the model had not ended
    assert read_reply(whole[:30], "length", generic.parse) == generic.Reply(None, [], "length")
    assert read_reply(whole[:30], "stop", generic.parse) == generic.Reply(None, [], "stop")  # cut by a stop string
    assert read_reply('{"response": "It is', "length", generic.parse) == generic.Reply("It is", [], "length")
    assert read_reply(PARIS, "stop", hermes.parse).finish_reason == "tool_calls"
    assert read_reply(PARIS, "length", hermes.parse) == generic.Reply(None, [], "length")
    assert read_reply(PARIS[:30], "length", hermes.parse) == generic.Reply(None, [], "length")
    assert read_reply("It is", "length", hermes.parse) == generic.Reply("It is", [], "length")


def test_every_object_in_a_schema_is_closed_unless_it_says_otherwise():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    schema = {"type": "object", "properties": {
        "at": point,
        "path": {"type": "array", "items": point, "prefixItems": [point]},
        "shape": {"anyOf": [{"$ref": "#/$defs/circle"}, {"type": "string"}, point]},
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},  # a map, as it says
        "extra": {"type": "object", "additionalProperties": True},
        "enum": {"enum": [{"type": "object"}]},  # values, not schemas
    }, "$defs": {"circle": {"properties": {"r": {"type": "number"}}}}}
    before = copy.deepcopy(schema)
    shut = {**point, "additionalProperties": False}
    assert closed(schema) == {"type": "object", "additionalProperties": False, "properties": {
        "at": shut,
        "path": {"type": "array", "items": shut, "prefixItems": [shut]},
        "shape": {"anyOf": [{"$ref": "#/$defs/circle"}, {"type": "string"}, shut]},
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},
        "extra": {"type": "object", "additionalProperties": True},
        "enum": {"enum": [{"type": "object"}]},
    }, "$defs": {"circle": {"properties": {"r": {"type": "number"}}, "additionalProperties": False}}}
    assert schema == before  # the caller's schema is not touched


def test_an_object_whose_parts_name_keys_is_left_open_and_its_parts_too():
    """Each part closed would forbid the other parts' keys (only {} would be left); the objects
    inside the parts are closed. Parts that name no keys (only `required`) leave it closed."""
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    schema = {"type": "object", "allOf": [{"properties": {"a": point}}, {"properties": {"b": {"type": "string"}}}]}
    assert closed(schema) == {"type": "object", "allOf": [
        {"properties": {"a": {**point, "additionalProperties": False}}}, {"properties": {"b": {"type": "string"}}}]}
    tagged = {"type": "object", "properties": {"kind": {"type": "string"}},
              "oneOf": [{"properties": {"r": {"type": "number"}}}, {"allOf": [{"$ref": "#/$defs/w"}]}]}
    assert closed(tagged) == tagged
    either = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
              "anyOf": [{"type": "object", "required": ["a"]}, {"required": ["b"]}]}
    assert closed(either) == {**either, "additionalProperties": False}


def _fits(tokenizer: Tokenizer, constraint, text: str) -> bool:
    """Whether a tool format's constraint takes `text` whole and may end there."""
    from llguidance import LLMatcher, LLTokenizer

    ll = LLTokenizer(tokenizer.rust_tokenizer().to_str(), n_vocab=tokenizer.vocab_size,
                     eos_token=sorted(tokenizer.eos_token_ids))
    matcher = LLMatcher(ll, constraint.grammar_text(), log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("choice, parallel, text, fits", [
    ("required", True, PARIS, True),
    ("required", True, PARIS + "\n" + KM, True),
    ("required", False, PARIS + "\n" + KM, False),  # one call at most
    ("required", True, "It is sunny.", False),  # calls only
    ("required", True, PARIS.replace('"Paris"', "5"), False),  # the arguments keep the schema
    ("required", True, PARIS.replace("get_weather", "get_news"), False),  # only the tools given
    ("auto", True, "It is sunny.", True),
    ("auto", True, PARIS, True),
    ("auto", True, "<b>sunny</b>", False),  # a plain answer does not open like a call block
])
def test_the_hermes_grammar_takes_calls_and_answers_as_tool_choice_says(tokenizers, choice, parallel, text, fits):
    assert _fits(tokenizers["hermes"], hermes.constraint([WEATHER, CONVERT], choice, parallel), text) is fits


ADDS = [{"name": "add", "arguments": {"a": 1, "b": 2}}]
NAMED_ADD = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})


@pytest.mark.parametrize("calls, fits", [
    (ADDS, True),
    (ADDS * 2, False),  # a named function is called exactly once, parallel_tool_calls or not
    ([{"name": "add", "arguments": {"a": 1, "b": 2, "type": "sum"}}], False),  # the arguments are closed
    ([], False),
])
def test_a_named_function_is_one_closed_call_in_both_formats(tokenizers, calls, fits):
    generic_text = json.dumps({"tool_calls": calls})
    hermes_text = "\n".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in calls)
    assert _fits(tokenizers["generic"], generic.constraint([ADD], NAMED_ADD, True), generic_text) is fits
    assert _fits(tokenizers["hermes"], hermes.constraint([ADD], NAMED_ADD, True), hermes_text) is fits


def test_a_function_without_parameters_takes_no_arguments(tokenizers):
    """OpenAI: omitting parameters defines a function with an empty parameter list."""
    constraint = generic.constraint([NO_ARGUMENTS], "required", True)
    assert _fits(tokenizers["generic"], constraint, '{"tool_calls": [{"name": "now", "arguments": {}}]}')
    assert not _fits(tokenizers["generic"], constraint, '{"tool_calls": [{"name": "now", "arguments": {"x": 1}}]}')
