"""OpenAI tool calling through the whole stack on the tiny llama model, with the official openai
client: the arguments always validate against the function's schema (api/tools.py)."""
from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.stack import Stack
from tests.tiny_models import build_model


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory) -> Stack:
    """A tiny llama of 2,048 positions: the tools' description in the prompt outgrows 256."""
    model = build_model(tmp_path_factory.mktemp("tiny-llama-long"), "llama", context=2048)
    with Stack(redis_url, model, tmp_path_factory.mktemp("tools")) as running:
        yield running


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


class Convert(BaseModel):
    model_config = ConfigDict(extra="forbid")

    km: int = Field(ge=0, le=1000)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["city", "days"],
             "properties": {"city": {"type": "string", "maxLength": 12},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
         {"type": "function", "function": {"name": "convert", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["km"],
             "properties": {"km": {"type": "integer", "minimum": 0, "maximum": 1000}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMAS = {"get_weather": Weather, "convert": Convert}


def _check(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        SCHEMAS[call.function.name].model_validate_json(call.function.arguments)


def test_required_gives_tool_calls_whose_arguments_validate(client, model):
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check(choice.message.tool_calls)


def test_a_named_function_is_the_one_called_once_without_parallel_calls(client, model):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "convert"}}, parallel_tool_calls=False)
        calls = reply.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "convert"
        _check(calls)


def test_auto_answers_with_a_call_or_with_text(client, model):
    for seed in range(3):
        reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=200,
                                               temperature=1.0, seed=seed)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _check(choice.message.tool_calls)
        else:
            assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)


def test_a_two_turn_tool_conversation(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=60,
                                            temperature=0)
    choice = second.choices[0]
    assert choice.message.tool_calls or isinstance(choice.message.content, str)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert isinstance(plain.choices[0].message.content, str)  # the same history without tools


def test_streamed_tool_call_deltas_add_up(client, model):
    stream = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=200, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                if delta.function:
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls" and calls
    for entry in calls.values():
        assert entry["id"].startswith("call_")
        SCHEMAS[entry["name"]].model_validate_json(entry["arguments"])
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=0)
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == \
        [(e["name"], e["arguments"]) for _, e in sorted(calls.items())]


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"response_format": {"type": "json_object"}}, None),
])
def test_bad_tool_arguments_are_400(client, model, extra, param):
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=body)
    assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, tool_choice="auto")
    assert info.value.body["param"] == "tool_choice"
