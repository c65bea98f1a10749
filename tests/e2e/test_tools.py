"""OpenAI tool calling through the whole stack on the tiny llama model, with the official openai
client, in both tool formats (the generic one, api/core/tools.py, and the Hermes one of templates that
know tools, api/core/parsers/hermes.py): the arguments always validate against the function's schema, closed;
a named function is called exactly once; a reply cut by max_tokens says so and holds no call, with
stream or without. Sampled at temperature 1 with tight limits, not only greedy."""
from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from api.core.parsers import generic as tool_format
from api.core.tools import Tool
from shared.tokenizer import Tokenizer
from tests.stack import Stack
from streamq.testing.tiny_models import CHAT_TEMPLATE, HERMES_TEMPLATE, build_model


@pytest.fixture(scope="module", params=["generic", "hermes"])
def stack(request, redis_url, tmp_path_factory) -> Stack:
    """A tiny llama of 2,048 positions (the tools' description in the prompt outgrows 256), with
    a chat template that knows no tools (the generic format), or Qwen2.5's shortened, which
    renders them and asks for <tool_call> blocks (the Hermes format)."""
    template = HERMES_TEMPLATE if request.param == "hermes" else CHAT_TEMPLATE
    model = build_model(tmp_path_factory.mktemp(f"tiny-llama-{request.param}"), "llama", context=2048,
                        chat_template=template)
    with Stack(redis_url, model, tmp_path_factory.mktemp("tools")) as running:
        running.tool_format = request.param
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
    """`add`'s arguments as its schema reads once closed: a and b, nothing else."""

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
# As a user writes it, without additionalProperties: the server closes it.
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMAS = {"get_weather": Weather, "convert": Convert, "add": Add}
SEEDS = range(6)


def _check(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        SCHEMAS[call.function.name].model_validate_json(call.function.arguments)


def _valid(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        SCHEMAS[name].model_validate_json(arguments)


def _streamed(client, deltas: dict | None = None, **ask) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed reply's content, its tool calls (name, arguments) added up from the deltas, and
    its finish reason, the last chunk's; `deltas` gets each call's count of argument deltas.
    Arguments that are whole JSON come in one layout (_layout), as the model wrote them or not."""
    content, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": "", "deltas": 0})
                entry["id"] = delta.id or entry["id"]
                if delta.function:
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
                    entry["deltas"] += bool(delta.function.arguments)
    assert all(e["id"].startswith("call_") for e in calls.values())
    assert all(r is None for r in reasons[:-1])
    if deltas is not None:
        deltas.update({i: e["deltas"] for i, e in calls.items()})
    return content, [(e["name"], _layout(e["arguments"])) for _, e in sorted(calls.items())], reasons[-1]


def _whole(client, **ask) -> tuple[str, list[tuple[str, str]], str]:
    """The same, without stream."""
    choice = client.chat.completions.create(**ask).choices[0]
    calls = [(c.function.name, _layout(c.function.arguments)) for c in choice.message.tool_calls or []]
    return choice.message.content or "", calls, choice.finish_reason


def _layout(arguments: str) -> str:
    """Whole JSON arguments in one layout (a stream sends the model's own characters); a cut
    call's as they are."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return arguments


def test_required_gives_tool_calls_whose_arguments_validate(client, model):
    reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check(choice.message.tool_calls)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("lean", [False, True])
def test_a_named_function_is_called_exactly_once_or_the_reply_says_it_was_cut(client, model, tokenizer, parallel,
                                                                               lean):
    """At temperature 1 with a tight max_tokens: one call of `add` whose arguments validate
    against its closed schema, or finish reason length with neither a call nor content. Leaning (a
    bias) towards "," and a newline, which begin another key or another call, the model would add
    keys or calls until max_tokens were the schema open or a second call allowed: no call would
    finish."""
    separators = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t], skip_special_tokens=False)
                  in (",", "\n")]
    finished = 0
    for seed in SEEDS:
        choice = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS + [ADD],
            tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=parallel,
            max_tokens=90, temperature=1.0, seed=seed,
            logit_bias={str(t): 4 for t in separators} if lean else None).choices[0]
        if choice.finish_reason == "length":
            assert choice.message.tool_calls is None and choice.message.content is None, (seed, choice)
            continue
        assert choice.finish_reason == "tool_calls", (seed, choice)
        calls = choice.message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "add", (seed, calls)
        _check(calls)
        finished += 1
    assert finished  # else this test checked no call


def test_auto_answers_with_a_call_or_with_text(client, model, stack):
    for seed in range(3):
        reply = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=200,
                                               temperature=1.0, seed=seed)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _check(choice.message.tool_calls)
        elif choice.message.content is None:
            assert choice.finish_reason == "length"  # a call, cut
        else:
            assert choice.finish_reason in ("stop", "length")
            if stack.tool_format == "hermes":  # a plain answer cannot open like a call block
                assert not choice.message.content.startswith("<")


def test_the_prompt_is_in_the_templates_own_tool_format(client, model, stack, tokenizer):
    """The Hermes template renders the tools itself and reads earlier calls as <tool_call>
    blocks; the generic format describes them in a system message. The prompt's token count is
    the rendering's, each way."""
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    if stack.tool_format == "hermes":
        rendered = tokenizer.render_chat([ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}], tools=TOOLS)
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in rendered
        assert '"name": "convert"' in rendered and "<tool_response>\nsunny" in rendered
    else:
        rendered = tokenizer.render_chat([{"role": "system", "content": tool_format.system_text(
            [Tool.model_validate(t) for t in TOOLS], None)}, ASK[0], {"role": "assistant", "content": json.dumps(
                {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]})},
            {"role": "tool", "content": "[call_1] sunny"}])
    assert reply.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


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
    ask = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    deltas: dict = {}
    content, calls, reason = _streamed(client, deltas, **ask)
    assert reason == "tool_calls" and content == ""
    _valid(calls)
    assert _whole(client, **ask) == (content, calls, reason)
    # The arguments stream as the model writes them: a call of 20 characters or more in pieces.
    for (_, arguments), pieces in zip(calls, (deltas[i] for i in sorted(deltas))):
        assert pieces >= (2 if len(arguments) >= 20 else 1), (arguments, pieces)


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


def test_a_plain_answer_under_auto_streams_as_it_comes_in_the_hermes_format(client, model, stack, tokenizer):
    """No token may open with "<" (a bias), so under auto the reply is a plain answer. In the
    Hermes format it is then text to its end, and streams token by token; the generic format's
    answer is JSON, held and read whole."""
    opening = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t], skip_special_tokens=False)[:1] == "<"]
    bias = {str(t): -100 for t in opening}
    ask = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=30, temperature=0, logit_bias=bias)
    whole = client.chat.completions.create(**ask).choices[0]
    deltas = [c.choices[0].delta.content for c in client.chat.completions.create(**ask, stream=True)
              if c.choices and c.choices[0].delta.content]
    if stack.tool_format == "hermes":
        assert whole.message.tool_calls is None and not whole.message.content.startswith("<")
        assert len(deltas) > 1 and "".join(deltas) == whole.message.content
    else:
        assert len(deltas) <= 1 and "".join(deltas) == (whole.message.content or "")


@pytest.mark.parametrize("max_tokens", [6, 90])
def test_required_streams_tool_call_deltas_or_says_it_was_cut_never_raw_json(client, model, max_tokens):
    """Streamed at temperature 1: tool_calls deltas with finish reason tool_calls, or finish reason
    length with nothing else; never the reply's JSON or blocks as content. The same seed without
    stream gives the same."""
    reasons = set()
    for seed in SEEDS:
        ask = dict(model=model, messages=ASK, tools=TOOLS + [ADD], tool_choice="required", max_tokens=max_tokens,
                   temperature=1.0, seed=seed)
        content, calls, reason = _streamed(client, **ask)
        assert content == "", (seed, content)
        if reason == "tool_calls":
            _valid(calls)
            assert _whole(client, **ask) == (content, calls, reason), seed
        else:  # cut: a call streamed so far stays (never taken back), unclosed; without stream, none
            assert reason == "length" and all(name in SCHEMAS for name, _ in calls), (seed, reason, calls)
            assert _whole(client, **ask) == ("", [], "length"), seed
        reasons.add(reason)
    assert reasons == ({"length"} if max_tokens == 6 else {"length", "tool_calls"})


def test_auto_streams_what_it_answers_without_stream(client, model):
    """Under auto at temperature 1, cut or not: the same content (a plain answer as far as it got,
    never a call's JSON), calls and finish reason with stream as without."""
    for seed in SEEDS:
        for max_tokens in (8, 90):
            ask = dict(model=model, messages=ASK, tools=TOOLS + [ADD], max_tokens=max_tokens, temperature=1.0,
                       seed=seed)
            content, calls, reason = _streamed(client, **ask)
            whole = _whole(client, **ask)
            if reason == "length" and calls:  # a call cut as it streamed: without stream, none
                assert whole == ("", [], "length"), (seed, max_tokens)
            else:
                assert whole == (content, calls, reason), (seed, max_tokens)
            assert reason in ("stop", "length", "tool_calls") and (reason != "tool_calls" or calls)


def test_a_responses_function_call_round_trip_in_either_format(client, model):
    """The Responses API on the same tool formats: the stream's function call items are the
    stored response's, and a function_call_output item continues the conversation."""
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    events = list(client.responses.create(model=model, input=ASK[0]["content"], tools=tools, temperature=0,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=120, stream=True))
    final = events[-1].response
    assert final.status == "completed", final
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    Weather.model_validate_json(calls[0].arguments)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [calls[0].arguments]
    # The arguments streamed as the model wrote them, and their pieces add up to the item's.
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == calls[0].arguments and len(pieces) >= (2 if len(calls[0].arguments) >= 20 else 1)
    assert client.responses.retrieve(final.id).output == final.output
    answered = client.responses.create(model=model, previous_response_id=final.id, tools=tools, tool_choice="none",
                                       temperature=0, max_output_tokens=5,
                                       input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                               "output": "sunny"}])
    assert answered.output[0].type == "message"
