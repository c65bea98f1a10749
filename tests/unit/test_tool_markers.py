"""A tool format's markers that are special tokens of the model (api/core/parsers/base.Markers):
written by token id in the grammar, and kept in the reply's text by the worker's decoding. The
whole path, through the stack, is tests/e2e/test_tool_markers.py."""
from __future__ import annotations

import pytest

from api.core.parsers import harmony, mistral, registry
from api.core.parsers.base import Markers, literal
from api.core.parsers.harmony import HarmonyFormat
from api.core.parsers.reply import read_whole
from api.core.tools import Tool
from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_tokenizer
from worker.engine.sequence import new_sequence
from worker.engine.structured import Grammars

MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
ADD = Tool.model_validate({"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}}})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("markers")
    build_tokenizer(folder, special_tokens=MARKERS)
    return Tokenizer(folder)


@pytest.mark.parametrize("text, written", [
    ("add[ARGS]", '("add" <[6]>)'),
    ("[TOOL_CALLS]", "<[5]>"),
    ("[TOOL_CALLS]add[ARGS]", '(<[5]> "add" <[6]>)'),
    ("no marker", '"no marker"'),
    ("[TOOL_CALL]", '"[TOOL_CALL]"'),
])
def test_a_literal_names_its_special_markers_by_id(text, written):
    assert Markers({"[TOOL_CALLS]": 5, "[ARGS]": 6}).lit(text) == written
    assert Markers().lit(text) == literal(text)  # spelled as text, with a tokenizer that has none


def test_a_format_for_a_tokenizer_with_the_markers_writes_them_as_tokens(tokenizer):
    fmt = mistral.FORMAT_V11.for_tokenizer(tokenizer)
    assert fmt is not mistral.FORMAT_V11 and fmt.keeps_special_tokens
    assert fmt.special.ids == {m: tokenizer.special_tokens[m] for m in MARKERS}
    assert not mistral.FORMAT_V11.keeps_special_tokens  # the registered one is untouched
    matcher = Grammars(tokenizer, tokenizer.vocab_size).matcher(
        SamplingParams(structured_outputs=fmt.constraint([ADD], "required", False)), [])
    spelled = tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False)
    assert len(spelled) == 1 and spelled[0] == tokenizer.special_tokens["[TOOL_CALLS]"]
    assert matcher.consume_tokens([tokenizer.special_tokens["[TOOL_CALLS]"]])
    assert matcher.consume_tokens(tokenizer.encode("add", add_special_tokens=False))
    assert matcher.consume_tokens([tokenizer.special_tokens["[ARGS]"]]) and not matcher.is_error()


def test_the_markers_spelled_as_text_are_refused_where_they_are_tokens(tokenizer):
    fmt = mistral.FORMAT_V11.for_tokenizer(tokenizer)
    matcher = Grammars(tokenizer, tokenizer.vocab_size).matcher(
        SamplingParams(structured_outputs=fmt.constraint([ADD], "required", False)), [])
    bracket = tokenizer.encode("[", add_special_tokens=False)
    assert matcher.validate_tokens(bracket) == 0  # the call opens with the token alone


def test_a_tokenizer_without_the_markers_keeps_the_registered_format(tmp_path):
    build_tokenizer(tmp_path)
    plain = Tokenizer(tmp_path)
    assert mistral.FORMAT.for_tokenizer(plain) is mistral.FORMAT
    assert registry.choose("mistral", "m", plain) is mistral.FORMAT
    assert HarmonyFormat.of(plain) == HarmonyFormat()


def test_a_reply_that_keeps_special_tokens_decodes_them(tokenizer):
    ids = [tokenizer.special_tokens["[TOOL_CALLS]"], *tokenizer.encode("add", add_special_tokens=False),
           tokenizer.special_tokens["[ARGS]"], *tokenizer.encode('{"a": 1}', add_special_tokens=False)]

    def run(params: SamplingParams) -> str:
        payload = RequestPayload(id="r", model="m", prompt_token_ids=[1], params=params)
        seq = new_sequence(payload, tokenizer.decode, decode_stream=tokenizer.decode_stream)
        return "".join(seq.accept(t, frozenset({2}), 4096) for t in ids) + seq.detokenizer.flush()

    kept = run(SamplingParams(max_tokens=64, skip_special_tokens=False))
    assert kept == '[TOOL_CALLS]add[ARGS]{"a": 1}'
    assert mistral.FORMAT_V11.parse(kept)[1][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert run(SamplingParams(max_tokens=64)) == 'add{"a": 1}'  # the default drops them


def test_a_harmony_call_ended_by_its_stop_token_reads_without_it():
    """gpt-oss stops on <|call|>: the stop token is not in the text, and the call is whole."""
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    reply = read_whole(harmony.FORMAT, text, "stop", HarmonyFormat())
    assert reply.finish_reason == "tool_calls"
    assert [c["function"] for c in reply.tool_calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
