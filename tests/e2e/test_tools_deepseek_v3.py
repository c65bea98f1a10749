"""The DeepSeek-V3 / R1 tool format through the whole stack (api/core/parsers/deepseek_v3.py): a
tiny llama with DeepSeek-V3's real tool-calling chat template, whose format the api picks by
itself, called with the official openai and anthropic clients. Its tokenizer has none of
DeepSeek's markers as tokens: it writes each in many tokens, under the grammar all the same."""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest
from pydantic import BaseModel, ConfigDict, Field

from api.core.chat import ChatMessage
from api.core.parsers import deepseek_v3, registry
from api.core.tools import Tool
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_model
from tests.stack import Stack

TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "deepseek_v3.jinja"
MAX_TOKENS = 700  # each marker is some 25 tokens of the tiny vocabulary


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory) -> Stack:
    """The tiny llama with DeepSeek-V3's template (4,096 positions: the tools and markers make a
    long prompt), served with the tool parser left to auto-detection."""
    model = build_model(tmp_path_factory.mktemp("tiny-llama-deepseek"), "llama", context=4096,
                        chat_template=TEMPLATE.read_text())
    with Stack(redis_url, model, tmp_path_factory.mktemp("tools-deepseek"),
               env={"STREAMQ_TOOL_PARSER": "auto"}) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(stack) -> Tokenizer:
    return Tokenizer(stack.env["STREAMQ_MODEL"])


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


class Convert(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    km: int = Field(ge=0, le=1000)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {
             "type": "object", "required": ["city", "days"],  # open, as users write it: the server closes it
             "properties": {"city": {"type": "string", "maxLength": 12},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
         {"type": "function", "function": {"name": "convert", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["km"],
             "properties": {"km": {"type": "integer", "minimum": 0, "maximum": 1000}}}}}]
SCHEMAS = {"get_weather": Weather, "convert": Convert}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _check(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        SCHEMAS[call.function.name].model_validate_json(call.function.arguments)


def test_the_api_picks_this_format_for_the_template_by_itself(client, model, tokenizer):
    """The registry's auto choice for this tokenizer is this format, and the prompt the api ran is
    its rendering: the tools by the template, no system message of the generic format's."""
    assert registry.choose("auto", model, tokenizer) is deepseek_v3.FORMAT
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0)
    tools = [Tool.model_validate(t) for t in TOOLS]
    rendered = tokenizer.render_chat(
        deepseek_v3.FORMAT.template_messages([ChatMessage(**m) for m in ASK], tools, None),
        tools=deepseek_v3.FORMAT.template_tools(tools))
    assert '"name": "convert"' in rendered and deepseek_v3.CALLS_BEGIN in rendered
    assert reply.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_required_gives_tool_calls_whose_arguments_validate(client, model):
    choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=MAX_TOKENS,
                                            temperature=0).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check(choice.message.tool_calls)


def test_a_named_function_is_called_exactly_once(client, model):
    finished = 0
    for seed in range(3):
        choice = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "5 miles in km?"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "convert"}}, max_tokens=MAX_TOKENS,
            temperature=1.0, seed=seed).choices[0]
        if choice.finish_reason == "length":  # cut: neither a call nor content
            assert choice.message.tool_calls is None and choice.message.content is None, (seed, choice)
            continue
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert [c.function.name for c in choice.message.tool_calls] == ["convert"]
        _check(choice.message.tool_calls)
        finished += 1
    assert finished  # else this test checked no call


def test_auto_answers_with_calls_or_with_text_that_does_not_open_like_them(client, model):
    kinds = set()
    for seed in range(4):
        choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                                                temperature=1.0, seed=seed).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _check(choice.message.tool_calls)
            kinds.add("calls")
        elif choice.message.content is None:
            assert choice.finish_reason == "length"  # a call, cut
        else:
            assert choice.finish_reason in ("stop", "length")
            text = choice.message.content  # neither the calls' marker nor a piece of it
            assert not text.startswith(deepseek_v3.CALLS_BEGIN) and not deepseek_v3.CALLS_BEGIN.startswith(text)
            kinds.add("text")
    assert kinds  # else no reply here was read as either


def _streamed(client, **ask) -> tuple[str, list[tuple[str, str]], str, list[int]]:
    """A streamed reply's content, its calls (name, arguments) added up from the deltas, its finish
    reason, and each call's count of argument deltas."""
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
                entry["pieces"] += bool(delta.function.arguments)
    assert all(e["id"].startswith("call_") for e in calls.values())
    assert all(r is None for r in reasons[:-1])
    ordered = [e for _, e in sorted(calls.items())]
    return content, [(e["name"], e["arguments"]) for e in ordered], reasons[-1], [e["pieces"] for e in ordered]


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_tool_call_deltas_add_up_to_the_calls_without_stream(client, model, tool_choice):
    ask = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=MAX_TOKENS,
               temperature=0, seed=7)
    content, calls, reason, pieces = _streamed(client, **ask)
    whole = client.chat.completions.create(**ask).choices[0]
    assert reason == whole.finish_reason and content == (whole.message.content or "")
    # the arguments are the model's own characters, as the reply without stream has them
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    if tool_choice == "required":
        assert reason == "tool_calls" and content == ""
        for (name, arguments), count in zip(calls, pieces):
            SCHEMAS[name].model_validate_json(arguments)
            assert count >= (2 if len(arguments) >= 20 else 1), (arguments, count)  # as it was written


def test_a_two_turn_tool_conversation(client, model, tokenizer):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS,
                                            temperature=0)
    choice = second.choices[0]
    if choice.message.tool_calls:
        _check(choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length")
    # The earlier call went back as the model wrote it, and the result after it
    written = (f"{deepseek_v3.CALL_BEGIN}function{deepseek_v3.SEP}{call.function.name}\n```json\n"
               f"{json.dumps(json.loads(call.function.arguments), ensure_ascii=False)}\n```{deepseek_v3.CALL_END}")
    tools = [Tool.model_validate(t) for t in TOOLS]
    rendered = tokenizer.render_chat(deepseek_v3.FORMAT.template_messages([ChatMessage(**m) for m in messages],
                                                                          tools, None),
                                     tools=deepseek_v3.FORMAT.template_tools(tools))
    assert written in rendered and '<｜tool▁output▁begin｜>{"forecast": "sunny"}<｜tool▁output▁end｜>' in rendered
    assert second.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_a_tool_use_through_the_messages_api(stack, model):
    client = anthropic.Anthropic(base_url=stack.urls[0], api_key="unused", max_retries=0, timeout=300)
    weather = {"name": "get_weather", "description": "The weather in a city.",
               "input_schema": TOOLS[0]["function"]["parameters"]}
    message = client.messages.create(model=model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                     tools=[weather], tool_choice={"type": "tool", "name": "get_weather"},
                                     messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert message.stop_reason == "tool_use"
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
    Weather.model_validate(uses[0].input)
