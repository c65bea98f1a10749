"""gpt-oss's Harmony format through the whole stack (api/core/parsers/harmony.py), on a tiny llama whose
chat template is gpt-oss's real one (tests/data/chat_templates/gpt_oss.jinja), with the official openai
and anthropic clients. The api picks both parsers itself (STREAMQ_REASONING_PARSER and STREAMQ_TOOL_PARSER
auto): a reply written as an analysis thought then a final answer (a regex constraint writes it: a tiny
model writes no Harmony by itself) comes back with the thought in reasoning_content, never in content;
under tools, the Harmony grammar's calls come back as tool calls whose arguments validate, streamed as
without stream. The tiny tokenizer writes Harmony's markers as text (gpt-oss's own has them as special
tokens: tests/e2e/test_tool_markers.py runs them so)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import anthropic
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from api.core.chat import ChatMessage
from api.core.parsers import harmony, reasoning, registry
from api.core.parsers.harmony import HarmonyFormat
from api.core.tools import Tool
from api.openai.answers import ChatCompletion
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_model
from tests.stack import Stack

# gpt-oss's template, its "Current date" fixed: a tiny model's greedy replies do not change from day to day
TEMPLATE = (Path(__file__).parents[1] / "data" / "chat_templates" / "gpt_oss.jinja").read_text().replace(
    'strftime_now("%Y-%m-%d")', '"2026-01-01"')
assert '"2026-01-01"' in TEMPLATE
THOUGHT, ANSWER = r"[a-z]{3,8} [a-z]{3,8}", r"[a-z]{3,8}"
WRITTEN = {"structured_outputs": {"regex": re.escape("<|channel|>analysis<|message|>") + THOUGHT + re.escape(
    "<|end|><|start|>assistant<|channel|>final<|message|>") + ANSWER}, "temperature": 0}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory) -> Stack:
    """A tiny llama of 4,096 positions (the template's system message and tools take a few hundred) with gpt-oss's template."""
    model = build_model(tmp_path_factory.mktemp("tiny-llama-harmony"), "llama", context=4096, chat_template=TEMPLATE)
    with Stack(redis_url, model, tmp_path_factory.mktemp("harmony")) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(stack) -> Tokenizer:
    return Tokenizer(stack.env["STREAMQ_MODEL"])


@pytest.fixture(scope="module")
def no_thought(tokenizer) -> dict:
    """A bias away from every token that opens with "a": under tools the grammar lets the model think
    first (<|channel|>analysis), where a tiny model wanders until max_tokens; with it, the reply opens
    on the commentary channel, whatever the prompt (whose system message has today's date)."""
    return {"logit_bias": {str(t): -100 for t in range(tokenizer.vocab_size) if tokenizer.decode([t]).startswith("a")}}


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


class Add(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    a: int
    b: int


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {  # no description: the api gives one
    "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
SCHEMAS = {"get_weather": Weather, "add": Add}


def _check(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        SCHEMAS[call.function.name].model_validate_json(call.function.arguments)


def _layout(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return arguments


def _streamed(client, **ask) -> tuple[str, str, list[tuple[str, str]], str]:
    """A streamed reply's thought, content, calls (name, arguments) added up from the deltas, and finish reason."""
    thought, content, calls, reasons = "", "", {}, []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            delta = choice.delta.to_dict()
            thought += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    assert all(r is None for r in reasons[:-1])
    return thought, content, [(e["name"], _layout(e["arguments"])) for _, e in sorted(calls.items())], reasons[-1]


def _whole(client, **ask) -> tuple[str, str, list[tuple[str, str]], str]:
    choice = client.chat.completions.create(**ask).choices[0]
    message = choice.message.to_dict()
    calls = [(c.function.name, _layout(c.function.arguments)) for c in choice.message.tool_calls or []]
    return message.get("reasoning_content") or "", choice.message.content or "", calls, choice.finish_reason


def _prompt_tokens(tokenizer: Tokenizer, tool_format, messages: list[dict], tools: list[dict]) -> int:
    core = [ChatMessage.model_validate(m) for m in messages]
    tools_ = [Tool.model_validate(t) for t in tools]
    rendered = tokenizer.render_chat(tool_format.template_messages(core, tools_, None),
                                     tools=tool_format.template_tools(tools_))
    return len(tokenizer.encode(rendered, add_special_tokens=False))


def test_the_api_reads_the_template_in_harmony(client, model, stack, tokenizer):
    """Under auto, both parsers are Harmony's (the template writes its channels), so the prompt is the
    template's rendering of the tools and of the earlier call and its result, in this format."""
    assert stack.env.get("STREAMQ_TOOL_PARSER", registry.AUTO) == registry.AUTO
    assert stack.env.get("STREAMQ_REASONING_PARSER", reasoning.AUTO) == reasoning.AUTO
    assert registry.choose(registry.AUTO, model, tokenizer) is harmony.FORMAT
    assert reasoning.choose(reasoning.AUTO, model, tokenizer) == HarmonyFormat()
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens == _prompt_tokens(tokenizer, harmony.FORMAT, history, TOOLS)
    core = [ChatMessage.model_validate(m) for m in history]
    rendered = tokenizer.render_chat(harmony.FORMAT.template_messages(core, [], None))
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"' in rendered


def test_the_thought_comes_apart_from_the_answer_whole_and_streamed(client, model):
    whole = client.chat.completions.create(model=model, messages=ASK, max_tokens=120, extra_body=WRITTEN)
    ChatCompletion.model_validate(whole.to_dict())
    message = whole.choices[0].message.to_dict()
    thought, answer = message["reasoning_content"], message["content"]
    assert re.fullmatch(THOUGHT, thought) and re.fullmatch(ANSWER, answer), message
    assert whole.choices[0].finish_reason == "stop"
    reasoning_tokens = whole.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model, messages=ASK, max_tokens=120, extra_body=WRITTEN,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    deltas = [c.choices[0].delta.to_dict() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == answer
    assert not any(set(d.get("content") or "") & set("<|>") for d in deltas)


def test_a_thought_cut_by_max_tokens_is_all_reasoning(client, model):
    cut = client.chat.completions.create(model=model, messages=ASK, max_tokens=30, extra_body=WRITTEN)
    message = cut.choices[0].message.to_dict()
    assert cut.choices[0].finish_reason == "length" and message["content"] is None
    assert message["reasoning_content"] and not set(message["reasoning_content"]) & set("<|>")


def test_required_gives_one_tool_call_whose_arguments_validate(client, model, no_thought):
    choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=200, temperature=0,
                                            extra_body=no_thought).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check(choice.message.tool_calls)


def test_a_named_function_is_called_exactly_once_or_the_reply_says_it_was_cut(client, model, no_thought):
    finished = 0
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
        choice = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS + [ADD],
            tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=150,
            temperature=temperature, seed=seed, extra_body=no_thought).choices[0]
        if choice.finish_reason == "length":  # a thought that ran on, or a call cut
            assert choice.message.tool_calls is None and choice.message.content is None, (seed, choice)
            continue
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert len(choice.message.tool_calls) == 1 and choice.message.tool_calls[0].function.name == "add"
        _check(choice.message.tool_calls)
        finished += 1
    assert finished  # else this test checked no call


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_replies_add_up_to_the_replies_without_stream(client, model, choice, no_thought):
    checked = 0
    for seed, temperature in ((0, 0.0), (1, 1.0)):
        ask = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                   max_tokens=150, temperature=temperature, seed=seed, extra_body=no_thought)
        thought, content, calls, reason = _streamed(client, **ask)
        whole = _whole(client, **ask)
        if reason == "length" and calls:  # a call cut as it streamed: without stream, none
            assert whole[2:] == ([], "length"), seed
            continue
        assert whole == (thought, content, calls, reason), seed
        if reason == "tool_calls":
            assert content == "" and len(calls) == 1
            Weather.model_validate_json(calls[0][1])
            checked += 1
    assert checked


def test_a_two_turn_tool_conversation(client, model, tokenizer, no_thought):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0,
                                           extra_body=no_thought)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=60, temperature=0)
    # The call and its result reached the template (a functions.get_weather message), as it reads them
    assert second.usage.prompt_tokens == _prompt_tokens(tokenizer, harmony.FORMAT, messages, TOOLS)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens // 2
    choice = second.choices[0]
    if choice.message.tool_calls:
        _check(choice.message.tool_calls)
    else:
        assert isinstance(choice.message.content, str) or choice.finish_reason == "length"


WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                 "required": ["city"]}}


def test_a_tool_round_trip_through_the_messages_api(stack):
    """Messages has no logit_bias: a greedy reply may think first, and a tiny model's thought runs to
    max_tokens (one thinking block); a few asks give one that calls the tool."""
    client = anthropic.Anthropic(base_url=stack.urls[0], api_key="unused", max_retries=0, timeout=120)
    for city in ("Paris", "Seoul", "Rome", "Lima", "Oslo", "Bern", "Kyiv", "Doha"):
        ask = [{"role": "user", "content": f"What is the weather in {city}?"}]
        first = client.messages.create(model=stack.model_name, max_tokens=150, extra_body={"temperature": 0},
                                       tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_weather"},
                                       messages=ask)
        if first.stop_reason == "tool_use":
            break
        assert first.stop_reason == "max_tokens" and [b.type for b in first.content] == ["thinking"], first
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and set(calls[0].input) == {"city"}
    assert isinstance(calls[0].input["city"], str) and len(calls[0].input["city"]) <= 12
    follow = client.messages.create(model=stack.model_name, max_tokens=16, extra_body={"temperature": 0},
                                    tools=[WEATHER_TOOL], messages=[
        *ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > (
        first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens // 2)


def test_a_thinking_budget_needs_the_markers_as_tokens(client, model):
    """This tokenizer spells Harmony's markers as text: a budget could not read where the thought
    opens, so it is refused rather than dropped (tests/e2e/test_tool_markers.py enforces one)."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body={"thinking_token_budget": 8})
    assert refused.value.body["param"] == "thinking_token_budget" and "special tokens" in refused.value.body["message"]
