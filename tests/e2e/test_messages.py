"""Anthropic's Messages API through the whole stack, with the official `anthropic` client (pinned in
pyproject), unchanged: non-stream and stream give the chat endpoint's greedy text; a tool round
trip (tool_use, then a tool_result answered); count_tokens; Anthropic's errors; x-api-key."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from api.anthropic.answers import AnthropicError, MessageAnswer, TokenCount
from tests.stack import Stack
from streamq.testing.tiny_models import CHAT_TEMPLATE, build_model

# The client (2.x) has no sampling arguments of its own; the API still takes them, as the body's.
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory) -> Stack:
    model = build_model(tmp_path_factory.mktemp("tiny-llama-messages"), "llama", context=2048,
                        chat_template=CHAT_TEMPLATE)
    with Stack(redis_url, model, tmp_path_factory.mktemp("messages")) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.urls[0], api_key="unused", max_retries=0, timeout=120)


def _chat_text(stack: Stack, messages: list[dict], max_tokens: int) -> str:
    chat = openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = chat.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=max_tokens,
                                         temperature=0)
    return reply.choices[0].message.content


def test_a_message_and_its_stream_give_the_chat_endpoints_text(stack, client):
    ask = [{"role": "user", "content": "Tell me about Paris"}]
    message = client.messages.create(model=stack.model_name, max_tokens=24, extra_body=GREEDY, system="Be brief.",
                                     messages=ask)
    expected = _chat_text(stack, [{"role": "system", "content": "Be brief."}, *ask], 24)
    assert message.type == "message" and message.role == "assistant" and message.model == stack.model_name
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == expected
    assert message.stop_reason in ("max_tokens", "end_turn") and message.usage.output_tokens <= 24
    MessageAnswer.model_validate(message.to_dict())
    counted = client.messages.count_tokens(model=stack.model_name, system="Be brief.", messages=ask)
    TokenCount.model_validate(counted.to_dict())
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted.input_tokens

    with client.messages.stream(model=stack.model_name, max_tokens=24, extra_body=GREEDY, system="Be brief.",
                                messages=ask) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert streamed.content[0].text == expected and streamed.stop_reason == message.stop_reason
    assert streamed.usage.output_tokens == message.usage.output_tokens
    # The second run found the first's prompt in the cache: Anthropic counts it as read from it.
    assert streamed.usage.cache_read_input_tokens > 0


def test_a_stop_sequence_is_reported(stack, client):
    free = client.messages.create(model=stack.model_name, max_tokens=24, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "Count"}])
    text = free.content[0].text
    stop = text.strip()[len(text.strip()) // 2:][:3]  # a piece of the greedy text: it must stop there
    assert stop.strip()
    cut = client.messages.create(model=stack.model_name, max_tokens=24, extra_body=GREEDY, stop_sequences=[stop],
                                 messages=[{"role": "user", "content": "Count"}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("stream", [False, True], ids=["message", "stream"])
def test_a_tool_round_trip(stack, client, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    create = dict(model=stack.model_name, max_tokens=200, extra_body=GREEDY, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"}, messages=ask)
    pieces = []
    if stream:
        with client.messages.stream(**create) as events:
            pieces = [e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
            first = events.get_final_message()
    else:
        first = client.messages.create(**create)
        MessageAnswer.model_validate(first.to_dict())  # its tool_use block
    assert first.stop_reason == "tool_use"
    if stream:  # the input streamed as the model wrote it: 20 characters or more in pieces
        assert len(pieces) >= (2 if len("".join(pieces)) >= 20 else 1), pieces
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(calls[0].input["city"], str)
    follow = client.messages.create(model=stack.model_name, max_tokens=16, extra_body=GREEDY, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"}]}])
    # The call and its result are in the prompt now (the random tiny model's answer is no test).
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    def prompt(m) -> int:
        return m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert prompt(follow) > prompt(first) + first.usage.output_tokens // 2


def test_anthropic_errors_come_in_anthropics_shape(stack, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=stack.model_name, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in bad.value.body["error"]["message"]
    AnthropicError.model_validate(bad.value.body)
    with pytest.raises(anthropic.BadRequestError) as thinking:
        client.messages.create(model=stack.model_name, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking" in thinking.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nonexistent", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    reply = httpx.post(f"{stack.urls[0]}/v1/messages", json={"model": stack.model_name, "messages": []})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
