"""The two tool formats' own parts, without a model: what each parses out of a reply, and what
the Hermes format's grammar lets a model write (api/tools.py, api/hermes.py)."""
from __future__ import annotations

import json

import pytest

from api import hermes
from api import tools as generic
from api.tools import Tool
from shared.tokenizer import Tokenizer
from tests.tiny_models import CHAT_TEMPLATE, HERMES_TEMPLATE, build_tokenizer

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}}}}})
CONVERT = Tool.model_validate({"type": "function", "function": {"name": "convert", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["km"],
    "properties": {"km": {"type": "integer", "minimum": 0, "maximum": 1000}}}}})
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
KM = '<tool_call>\n{"name": "convert", "arguments": {"km": 5}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    out = {}
    for name, template in (("generic", CHAT_TEMPLATE), ("hermes", HERMES_TEMPLATE)):
        folder = tmp_path_factory.mktemp(name)
        build_tokenizer(folder, chat_template=template)
        out[name] = Tokenizer(folder)
    return out


def test_only_a_template_that_renders_tools_and_asks_for_call_blocks_is_hermes(tokenizers):
    assert hermes.knows(tokenizers["hermes"]) and not hermes.knows(tokenizers["generic"])


def test_hermes_replies_parse_into_openai_tool_calls():
    content, calls = hermes.parse(PARIS + "\n" + KM)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "convert"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"km": 5} and calls[0]["id"].startswith("call_")
    content, calls = hermes.parse("Let me look.\n" + PARIS)
    assert content == "Let me look." and len(calls) == 1
    cut = PARIS[:40]  # max_tokens cut the block: it is text as it stands
    assert hermes.parse(cut) == (cut, []) and hermes.parse("sunny") == ("sunny", [])


def test_generic_replies_parse_into_openai_tool_calls():
    content, calls = generic.parse('{"tool_calls": [{"name": "convert", "arguments": {"km": 5}}]}')
    assert content is None and calls[0]["function"]["name"] == "convert"
    assert generic.parse('{"response": "hi"}') == ("hi", [])
    assert generic.parse('{"tool_calls": [') == ('{"tool_calls": [', [])


def _fits(tokenizer: Tokenizer, choice, parallel: bool, text: str) -> bool:
    """Whether the Hermes grammar takes `text` whole and may end there."""
    from llguidance import LLMatcher, LLTokenizer

    ll = LLTokenizer(tokenizer.rust_tokenizer().to_str(), n_vocab=tokenizer.vocab_size,
                     eos_token=sorted(tokenizer.eos_token_ids))
    grammar = hermes.constraint([WEATHER, CONVERT], choice, parallel).grammar_text()
    matcher = LLMatcher(ll, grammar, log_level=0)
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
    assert _fits(tokenizers["hermes"], choice, parallel, text) is fits
