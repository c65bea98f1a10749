"""Tool calling in the Qwen3-Coder format through the whole stack: a tiny llama with
Qwen3-Coder-30B-A3B-Instruct's own chat template (tests/data/chat_templates/qwen3_coder.jinja),
through the official openai and anthropic clients. The arguments validate against the functions'
schemas with their values typed (an integer is a JSON integer, a string a string); a named function
is called once; a stream's deltas add up to the same calls without stream; a tool result goes back
to the model in the template's own words."""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest
from pydantic import BaseModel, ConfigDict, Field

from api.core.chat import ChatMessage
from api.core.parsers import registry
from api.core.tools import Tool
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_model
from tests.stack import Stack

TEMPLATE = Path(__file__).parents[1] / "data" / "chat_templates" / "qwen3_coder.jinja"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory) -> Stack:
    """A tiny llama of 4,096 positions (the template's tool prompt is long), its replies read in
    the Qwen3-Coder format, which the api picks by itself (STREAMQ_TOOL_PARSER auto)."""
    model = build_model(tmp_path_factory.mktemp("tiny-llama-qwen3-coder"), "llama", context=4096,
                        chat_template=TEMPLATE.read_text())
    with Stack(redis_url, model, tmp_path_factory.mktemp("tools-qwen3-coder")) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(stack) -> Tokenizer:
    return Tokenizer(stack.env["STREAMQ_MODEL"])


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)
    metric: bool | None = None


class Convert(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    km: int = Field(ge=0, le=1000)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {
             "type": "object", "required": ["city", "days"],
             "properties": {"city": {"type": "string", "maxLength": 12},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                            "metric": {"type": "boolean"}}}}},
         {"type": "function", "function": {"name": "convert", "parameters": {
             "type": "object", "required": ["km"],
             "properties": {"km": {"type": "integer", "minimum": 0, "maximum": 1000}}}}}]
SCHEMAS = {"get_weather": Weather, "convert": Convert}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _check(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        SCHEMAS[call.function.name].model_validate_json(call.function.arguments)


def _streamed(client, **ask) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed reply's content, its calls (name, arguments) added up from the deltas, and the
    last chunk's finish reason."""
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert all(e["id"].startswith("call_") for e in calls.values()) and all(r is None for r in reasons[:-1])
    return content, [(e["name"], e["arguments"]) for _, e in sorted(calls.items())], reasons[-1]


def _whole(client, **ask) -> tuple[str, list[tuple[str, str]], str]:
    choice = client.chat.completions.create(**ask).choices[0]
    return (choice.message.content or "", [(c.function.name, c.function.arguments)
                                           for c in choice.message.tool_calls or []], choice.finish_reason)


def test_the_api_reads_this_template_in_the_qwen3_coder_format(stack, tokenizer):
    assert registry.get("qwen3_coder").knows(tokenizer)
    assert registry.choose(stack.env.get("STREAMQ_TOOL_PARSER", "auto"), stack.model_name, tokenizer).name == \
        "qwen3_coder"


def test_the_api_would_pick_qwen3_coder_by_itself(stack, tokenizer):
    """What the api runs for STREAMQ_TOOL_PARSER=auto (api/core/served_models.py)."""
    assert registry.choose("auto", stack.model_name, tokenizer).name == "qwen3_coder"


def test_required_gives_tool_calls_whose_arguments_validate(client, model):
    choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=200, **GREEDY).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check(choice.message.tool_calls)


def test_a_named_function_is_called_exactly_once_or_the_reply_says_it_was_cut(client, model):
    finished = 0
    for seed in range(4):
        choice = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "5 km in miles?"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "convert"}}, max_tokens=160, temperature=1.0,
            seed=seed).choices[0]
        if choice.finish_reason == "length":
            assert choice.message.tool_calls is None and choice.message.content is None, (seed, choice)
            continue
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert [c.function.name for c in choice.message.tool_calls] == ["convert"], seed
        _check(choice.message.tool_calls)
        finished += 1
    assert finished  # else this test checked no call


def test_auto_answers_with_a_call_or_with_text(client, model):
    for seed in range(3):
        choice = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=120,
                                                temperature=1.0, seed=seed).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _check(choice.message.tool_calls)
        elif choice.message.content is None:
            assert choice.finish_reason == "length"  # a call, cut
        else:  # a plain answer never opens like a call block
            assert choice.finish_reason in ("stop", "length") and not choice.message.content.startswith("<")


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_deltas_add_up_to_the_calls_without_stream(client, model, choice):
    ask = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0, seed=7)
    streamed = _streamed(client, **ask)
    assert streamed == _whole(client, **ask)  # the very argument strings
    content, calls, reason = streamed
    if choice == "required":
        assert content == "" and reason == "tool_calls" and calls
    for name, arguments in calls:
        SCHEMAS[name].model_validate_json(arguments)


def test_a_two_turn_conversation_with_a_tool_result(client, model, tokenizer):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, **GREEDY).choices[0]
    call = first.message.tool_calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=60, **GREEDY)
    choice = second.choices[0]
    assert choice.message.tool_calls or isinstance(choice.message.content, str)
    # The prompt is the template's rendering of the call (as the model wrote it) and of its result
    fmt, tools = registry.get("qwen3_coder"), [Tool.model_validate(t) for t in TOOLS]
    history = fmt.template_messages([ChatMessage.model_validate(m) for m in messages], tools, None)
    rendered = tokenizer.render_chat(history, tools=fmt.template_tools(tools))
    arguments = json.loads(call.function.arguments)
    assert f"<function={call.function.name}>\n" in rendered and '<tool_response>\n{"forecast": "sunny"}' in rendered
    assert all(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>" in rendered
               for k, v in arguments.items())
    assert second.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_a_tool_call_through_the_messages_api(stack):
    client = anthropic.Anthropic(base_url=stack.urls[0], api_key="unused", max_retries=0, timeout=120)
    weather = {"name": "get_weather", "description": "The weather in a city.",
               "input_schema": TOOLS[0]["function"]["parameters"]}
    message = client.messages.create(model=stack.model_name, max_tokens=200, extra_body=GREEDY, tools=[weather],
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    Weather.model_validate(calls[0].input)  # typed: days an integer, city a string
