"""Tool calls read as they are written (api/core/parsers/tool_stream.py): in both formats and any chunking, the
arguments' deltas add up to each call's JSON, nothing is sent twice, and a string holding the
opening of a call is no call."""
from __future__ import annotations

import json
import random

import pytest

from api.core.parsers.tool_stream import ToolCallStream

CALLS = [("get_weather", {"city": "Paris {x}", "days": 3}),
         ("add", {"a": 1, "b": [2, {"c": "\"}]\\"}]}),
         ("no_args", {})]
GENERIC = json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in CALLS]})
HERMES = "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in CALLS)


def _read(text: str, seed: int):
    rng, stream, deltas, i = random.Random(seed), ToolCallStream(), [], 0
    while i < len(text):
        step = rng.randint(1, 7)
        deltas += stream.feed(text[i:i + step])
        i += step
    return deltas


@pytest.mark.parametrize("text", [GENERIC, HERMES], ids=["generic", "hermes"])
@pytest.mark.parametrize("seed", range(20))
def test_the_deltas_add_up_to_each_calls_arguments_in_any_chunking(text, seed):
    deltas = _read(text, seed)
    names = [(d.index, d.name) for d in deltas if d.name is not None]
    assert names == [(i, n) for i, (n, _) in enumerate(CALLS)]
    assert len({d.id for d in deltas if d.id}) == len(CALLS)
    for i, (_, arguments) in enumerate(CALLS):
        mine = [d for d in deltas if d.index == i]
        assert json.loads("".join(d.arguments for d in mine)) == arguments
        assert [d.closed for d in mine].count(True) == 1 and mine[-1].closed


def test_a_long_call_streams_in_several_deltas_and_a_cut_one_stays_open():
    text = json.dumps({"tool_calls": [{"name": "f", "arguments": {"text": "x" * 40}}]})
    stream = ToolCallStream()
    deltas = [d for i in range(0, len(text), 4) for d in stream.feed(text[i:i + 4])]
    assert sum(1 for d in deltas if d.arguments) >= 2
    cut = ToolCallStream().feed(text[:60])  # inside the arguments
    assert cut[-1].arguments and not cut[-1].closed


def test_an_answer_that_quotes_a_call_is_no_call():
    answer = json.dumps({"response": 'write {"name": "f", "arguments": {"a": 1}} to call'})
    assert _read(answer, 0) == []


def test_the_arguments_open_with_their_value_whatever_spacing_comes_first():
    stream = ToolCallStream()
    deltas = stream.feed('{"name": "f", "arguments":') + stream.feed(" ") + stream.feed(' {"a"') + stream.feed(": 1}")
    pieces = [d.arguments for d in deltas if d.arguments]
    assert pieces[0].startswith("{") and "".join(pieces) == '{"a": 1}'
