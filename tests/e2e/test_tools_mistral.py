"""OpenAI tool calling in the Mistral formats through the whole stack (api/core/parsers/mistral.py),
on the tiny llama with a real Mistral chat template (Nemo's JSON list, Mistral Small 3.2's v11 form),
with the official openai and anthropic clients. The api chooses the format itself (the tool parser
setting is left "auto"). The tiny tokenizer has no [TOOL_CALLS] token: the model writes the marker
as text, under the grammar."""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest
from pydantic import BaseModel, ConfigDict, Field

from api.core.chat import ChatMessage
from api.core.parsers import mistral
from api.core.tools import Tool
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_model
from tests.stack import Stack

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
FORMATS = {"mistral": mistral.FORMAT, "mistral_v11": mistral.FORMAT_V11}


@pytest.fixture(scope="module", params=["mistral", "mistral_v11"])
def stack(request, redis_url, tmp_path_factory) -> Stack:
    """A tiny llama of 4,096 positions (Mistral Small 3.2's template writes a long system prompt)
    with a real Mistral template; STREAMQ_TOOL_PARSER unset, so "auto"."""
    model = build_model(tmp_path_factory.mktemp(f"tiny-llama-{request.param}"), "llama", context=4096,
                        chat_template=(TEMPLATES / f"{request.param}.jinja").read_text())
    with Stack(redis_url, model, tmp_path_factory.mktemp("tools-mistral"), env={"STREAMQ_TOOL_PARSER": ""}) as running:
        running.tool_format = FORMATS[request.param]
        yield running


@pytest.fixture(scope="module")
def tokenizer(stack) -> Tokenizer:
    return Tokenizer(stack.env["STREAMQ_MODEL"])


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


class Add(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    a: int
    b: int


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "required": ["city", "days"],
             "properties": {"city": {"type": "string", "maxLength": 12},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
             "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"},
                                                                    "b": {"type": "integer"}}}}}]
SCHEMAS = {"get_weather": Weather, "add": Add}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _check(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        SCHEMAS[call.function.name].model_validate_json(call.function.arguments)


def test_the_api_chose_the_templates_format(client, model, stack, tokenizer):
    """The prompt is the template's rendering of the conversation in the Mistral format (earlier
    calls with 9-character ids, the tools in [AVAILABLE_TOOLS]), not the generic format's."""
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    tools = [Tool.model_validate(t) for t in TOOLS]
    core = [ChatMessage.model_validate(m) for m in history]
    mine = tokenizer.render_chat(stack.tool_format.template_messages(core, tools, None),
                                 tools=stack.tool_format.template_tools(tools))
    assert "[AVAILABLE_TOOLS]" in mine and '"name": "add"' in mine and "[TOOL_CALLS]" in mine
    assert mistral.short_id("call_1") in mine and "sunny" in mine
    assert reply.usage.prompt_tokens == len(tokenizer.encode(mine, add_special_tokens=False))


@pytest.mark.parametrize("parallel", [False, True])
def test_required_gives_tool_calls_whose_arguments_validate(client, model, parallel):
    """One call, or with parallel_tool_calls as many as the model writes: the random tiny model may
    go on adding calls in the JSON list until max_tokens (finish reason length, and no calls)."""
    choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=parallel, max_tokens=200, temperature=0).choices[0]
    if parallel and choice.finish_reason == "length":
        assert choice.message.tool_calls is None and choice.message.content is None
        return
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert parallel or len(choice.message.tool_calls) == 1
    _check(choice.message.tool_calls)


def test_a_named_function_is_called_exactly_once(client, model):
    finished = 0
    for seed in range(3):
        choice = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=120, temperature=1.0,
            seed=seed).choices[0]
        if choice.finish_reason == "length":  # cut: neither a call nor content
            assert choice.message.tool_calls is None and choice.message.content is None, (seed, choice)
            continue
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert [c.function.name for c in choice.message.tool_calls] == ["add"]
        _check(choice.message.tool_calls)
        finished += 1
    assert finished  # else this test checked no call


def test_auto_answers_with_calls_or_with_text(client, model):
    for seed in range(3):
        choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=120,
                                                temperature=1.0, seed=seed).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            _check(choice.message.tool_calls)
        elif choice.message.content is None:
            assert choice.finish_reason == "length"  # a call, cut
        else:
            assert choice.finish_reason in ("stop", "length")
            assert not choice.message.content.startswith(mistral.MARKER)


def _streamed(client, **ask) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed reply's content, its calls (name, arguments added up from the deltas) and its
    finish reason."""
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or delta.id
                entry["name"] += (delta.function and delta.function.name) or ""
                entry["arguments"] += (delta.function and delta.function.arguments) or ""
    assert all(e["id"].startswith("call_") for e in calls.values())
    assert all(r is None for r in reasons[:-1])
    return content, [(e["name"], _layout(e["arguments"])) for _, e in sorted(calls.items())], reasons[-1]


def _whole(client, **ask) -> tuple[str, list[tuple[str, str]], str]:
    choice = client.chat.completions.create(**ask).choices[0]
    calls = [(c.function.name, _layout(c.function.arguments)) for c in choice.message.tool_calls or []]
    return choice.message.content or "", calls, choice.finish_reason


def _layout(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments))
    except ValueError:
        return arguments


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_deltas_add_up_to_the_calls_without_stream(client, model, tool_choice):
    ask = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
               max_tokens=200, temperature=0, seed=7)
    content, calls, reason = _streamed(client, **ask)
    assert _whole(client, **ask) == (content, calls, reason)
    if tool_choice == "required":
        assert reason == "tool_calls" and content == "" and calls
        for name, arguments in calls:
            SCHEMAS[name].model_validate_json(arguments)


def test_a_two_turn_conversation_with_a_tool_result(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=0)
    calls = first.choices[0].message.tool_calls
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                      *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls)]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=40,
                                            temperature=0)
    choice = second.choices[0]
    assert choice.message.tool_calls or isinstance(choice.message.content, str) or choice.finish_reason == "length"
    # the calls and their results are in the prompt now (the random tiny model's answer is no test)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens // 2


def test_a_messages_api_tool_round_trip(stack, model):
    client = anthropic.Anthropic(base_url=stack.urls[0], api_key="unused", max_retries=0, timeout=120)
    weather = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=model, max_tokens=200, extra_body={"temperature": 0}, tools=[weather],
                                   tool_choice={"type": "tool", "name": "get_weather"}, messages=ask)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    Weather.model_validate(uses[0].input)
    follow = client.messages.create(model=model, max_tokens=16, extra_body={"temperature": 0}, tools=[weather],
                                    messages=[*ask, {"role": "assistant", "content": [
                                        b.model_dump(exclude_none=True) for b in first.content]},
                                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                                      "content": "Sunny, 21 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens
