"""OpenAI tool calling through the whole stack in the Llama 3.x JSON format (api/core/parsers/llama3_json.py),
on a tiny llama whose chat template is Llama 3.1's real JSON tool template (tests/data/chat_templates/), with the
official openai and anthropic clients. The api picks the format itself (STREAMQ_TOOL_PARSER=auto): the template
renders the tools and the earlier calls, and the replies, {"name": ..., "parameters": ...} under its grammar,
come back as tool calls whose arguments validate; streamed, the same calls as without stream."""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest
from pydantic import BaseModel, ConfigDict, Field

from api.core.chat import ChatMessage
from api.core.parsers import llama3_json, registry
from api.core.tools import Tool
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_model
from tests.stack import Stack

TEMPLATE = (Path(__file__).parents[1] / "data" / "chat_templates" / "llama3.1_json.jinja").read_text()
# The template writes today's date (strftime_now) into the prompt: one date, for prompts that compare
DATE = {"chat_template_kwargs": {"date_string": "26 Jul 2024"}}


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory) -> Stack:
    """A tiny llama of 4,096 positions (the template renders each tool as indented JSON) with Llama 3.1's template."""
    model = build_model(tmp_path_factory.mktemp("tiny-llama-llama3-json"), "llama", context=4096,
                        chat_template=TEMPLATE)
    with Stack(redis_url, model, tmp_path_factory.mktemp("tools-llama3-json")) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(stack) -> Tokenizer:
    return Tokenizer(stack.env["STREAMQ_MODEL"])


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


class Convert(BaseModel):
    model_config = ConfigDict(extra="forbid")

    km: int = Field(ge=0, le=1000)


class Add(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    a: int
    b: int


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["city", "days"],
             "properties": {"city": {"type": "string", "maxLength": 12},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
         {"type": "function", "function": {"name": "convert", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["km"],
             "properties": {"km": {"type": "integer", "minimum": 0, "maximum": 1000}}}}}]
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMAS = {"get_weather": Weather, "convert": Convert, "add": Add}


def _check(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        SCHEMAS[call.function.name].model_validate_json(call.function.arguments)


def _streamed(client, **ask) -> tuple[str, list[tuple[str, str]], str, list[int]]:
    """A streamed reply's content, its calls (name, arguments) added up from the deltas, its finish
    reason (the last chunk's), and each call's count of argument deltas."""
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
                entry["id"] = entry["id"] or delta.id
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
                entry["pieces"] += bool(delta.function.arguments)
    assert all(e["id"].startswith("call_") for e in calls.values())
    assert all(r is None for r in reasons[:-1])
    ordered = [e for _, e in sorted(calls.items())]
    return content, [(e["name"], _layout(e["arguments"])) for e in ordered], reasons[-1], [e["pieces"] for e in ordered]


def _whole(client, **ask) -> tuple[str, list[tuple[str, str]], str]:
    choice = client.chat.completions.create(**ask).choices[0]
    calls = [(c.function.name, _layout(c.function.arguments)) for c in choice.message.tool_calls or []]
    return choice.message.content or "", calls, choice.finish_reason


def _layout(arguments: str) -> str:
    """Whole JSON arguments in one layout (a stream sends the model's own characters, which may
    escape what json.dumps does not); a cut call's as they are."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return arguments


def _prompt_tokens(tokenizer: Tokenizer, tool_format, messages: list[dict], tools: list[dict]) -> int:
    """The prompt's token count, rendered by the template in `tool_format`."""
    core = [ChatMessage.model_validate(m) for m in messages]
    tools_ = [Tool.model_validate(t) for t in tools]
    rendered = tokenizer.render_chat(tool_format.template_messages(core, tools_, None),
                                     tools=tool_format.template_tools(tools_), extra=DATE["chat_template_kwargs"])
    return len(tokenizer.encode(rendered, add_special_tokens=False))


def test_the_api_reads_the_template_in_llama3_json(client, model, stack, tokenizer):
    """Under auto, the api serves the model in llama3_json (the template asks for it), so the
    prompt is the template's rendering of the tools and of the earlier call and its result, in
    this format; in the generic one it would be another."""
    assert stack.env.get("STREAMQ_TOOL_PARSER", registry.AUTO) == registry.AUTO
    assert registry.choose(registry.AUTO, model, tokenizer) is llama3_json.FORMAT
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=1, temperature=0,
                                           extra_body=DATE)
    expected = _prompt_tokens(tokenizer, llama3_json.FORMAT, history, TOOLS)
    assert reply.usage.prompt_tokens == expected
    assert expected != _prompt_tokens(tokenizer, registry.get(registry.FALLBACK), history, TOOLS)


def test_required_gives_tool_calls_whose_arguments_validate(client, model):
    choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=200, temperature=0, extra_body=DATE).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check(choice.message.tool_calls)


@pytest.mark.parametrize("parallel", [True, False])
def test_a_named_function_is_called_exactly_once_or_the_reply_says_it_was_cut(client, model, parallel):
    finished = 0
    for seed in range(4):
        choice = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS + [ADD],
            tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=parallel,
            max_tokens=90, temperature=1.0, seed=seed, extra_body=DATE).choices[0]
        if choice.finish_reason == "length":
            assert choice.message.tool_calls is None and choice.message.content is None, (seed, choice)
            continue
        assert choice.finish_reason == "tool_calls", (seed, choice)
        calls = choice.message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "add", (seed, calls)
        _check(calls)
        finished += 1
    assert finished  # else this test checked no call


def test_auto_answers_with_calls_or_with_text_that_cannot_be_read_as_a_call(client, model):
    kinds = set()
    for seed in range(4):
        choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=120,
                                                temperature=1.0, seed=seed, extra_body=DATE).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _check(choice.message.tool_calls)
            kinds.add("calls")
        elif choice.message.content is None:
            assert choice.finish_reason == "length"  # a call, cut
        else:
            assert choice.finish_reason in ("stop", "length")
            assert not choice.message.content[:1].isspace() and choice.message.content[:1] not in "{<"
            kinds.add("text")
    assert kinds  # else this test checked no reply


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_tool_call_deltas_add_up_to_the_calls_without_stream(client, model, choice):
    """Greedy, and at temperature 1 with the same seed: the same content, calls and finish reason
    with stream as without; the arguments stream as the model writes them, in pieces."""
    checked = 0
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
        ask = dict(model=model, messages=ASK, tools=TOOLS + [ADD], tool_choice=choice, max_tokens=200,
                   temperature=temperature, seed=seed, extra_body=DATE)
        content, calls, reason, pieces = _streamed(client, **ask)
        whole = _whole(client, **ask)
        if reason == "length" and calls:  # a call cut as it streamed: without stream, none
            assert whole == ("", [], "length"), seed
            continue
        assert whole == (content, calls, reason), seed
        if reason == "tool_calls":
            assert content == ""
            for (name, arguments), count in zip(calls, pieces):
                SCHEMAS[name].model_validate_json(arguments)
                assert count >= (2 if len(arguments) >= 20 else 1), (arguments, count)
            checked += 1
    assert checked or choice == "auto"


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_calls_are_separated_as_llama_writes_them(client, model, tokenizer, parallel):
    """Leaning (a bias) towards ";", which begins another call after one: several calls, each
    valid, streamed as without stream, where parallel_tool_calls allows them; one call where not."""
    semicolons = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]).startswith(";")]
    counts = []
    for seed in range(4):
        ask = dict(model=model, messages=ASK, tools=TOOLS + [ADD], tool_choice="required", max_tokens=300,
                   temperature=1.0, seed=seed, parallel_tool_calls=parallel,
                   extra_body={**DATE, "logit_bias": {str(t): 3 for t in semicolons}})
        content, calls, reason, _ = _streamed(client, **ask)
        if reason == "length":
            continue
        assert reason == "tool_calls" and _whole(client, **ask) == (content, calls, reason), seed
        for name, arguments in calls:
            SCHEMAS[name].model_validate_json(arguments)
        counts.append(len(calls))
    assert counts and (max(counts) > 1 if parallel else set(counts) == {1}), counts


def test_a_two_turn_tool_conversation(client, model, tokenizer):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=0, extra_body=DATE)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=60,
                                            temperature=0, extra_body=DATE)
    # The call and its result reached the template (an ipython turn), as it reads them
    assert second.usage.prompt_tokens == _prompt_tokens(tokenizer, llama3_json.FORMAT, messages, TOOLS)
    choice = second.choices[0]
    if choice.message.tool_calls:
        _check(choice.message.tool_calls)
    else:
        assert isinstance(choice.message.content, str) or choice.finish_reason == "length"


WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                 "required": ["city"]}}


def test_a_tool_round_trip_through_the_messages_api(stack):
    client = anthropic.Anthropic(base_url=stack.urls[0], api_key="unused", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=stack.model_name, max_tokens=200, extra_body={"temperature": 0},
                                   tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=ask)
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and set(calls[0].input) == {"city"}
    assert isinstance(calls[0].input["city"], str) and len(calls[0].input["city"]) <= 12
    follow = client.messages.create(model=stack.model_name, max_tokens=16, extra_body={"temperature": 0},
                                    tools=[WEATHER_TOOL], messages=[
        *ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the call and its result are in the prompt now: more than the first prompt and its call
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > (
        first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens // 2)
